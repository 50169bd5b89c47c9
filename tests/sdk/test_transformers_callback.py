"""KubetrainCallback in a real transformers Trainer: saved folders marked, SIGTERM saves, exits."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kubetrain.protocol import EXIT_SIGNALLED  # noqa: E402
from kubetrain.sdk import checkpoints  # noqa: E402
from kubetrain.sdk.transformers_callback import KubetrainCallback  # noqa: E402


class _Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: Any, y: Any) -> dict[str, Any]:
        return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y)}


class _Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, Any]:
        x = torch.full((4,), float(index % 7))
        return {"x": x, "y": x.sum()}


class _SigtermAt(transformers.TrainerCallback):  # type: ignore[misc]
    """What the kubelet does to a pod being drained, at a chosen step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _trainer(output: Path, callbacks: list[Any]) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(output), max_steps=6, save_steps=3, per_device_train_batch_size=4,
        report_to=[], use_cpu=True, logging_steps=100, disable_tqdm=True)
    return transformers.Trainer(model=_Regression(), args=args, train_dataset=_Data(),
                                callbacks=callbacks)


@pytest.fixture(autouse=True)
def _default_sigterm(monkeypatch: pytest.MonkeyPatch) -> Any:
    from kubetrain.sdk import stop

    monkeypatch.delenv("KUBEFLOW_TRAINER_SERVER_URL", raising=False)
    previous = signal.getsignal(signal.SIGTERM)
    stop._installed = False  # each test's callback installs its own handler
    stop._seen.clear()
    yield
    signal.signal(signal.SIGTERM, previous)
    stop._installed = False
    stop._seen.clear()


def test_every_checkpoint_the_trainer_saves_is_marked_complete(tmp_path: Path) -> None:
    _trainer(tmp_path, [KubetrainCallback()]).train()
    saved = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-"))
    assert saved == ["checkpoint-3", "checkpoint-6"]
    for name in saved:
        part = checkpoints.ready_part(tmp_path / name)
        assert part is not None and part.step == int(name.split("-")[1]) and part.parts == 1
        assert (tmp_path / name / "model.safetensors").exists()


def test_sigterm_saves_at_the_next_step_end_stops_and_exits_143(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        _trainer(tmp_path, [_SigtermAt(2), KubetrainCallback()]).train()
    assert exited.value.code == EXIT_SIGNALLED
    assert checkpoints.complete_here(tmp_path / "checkpoint-2") == 2
    assert not (tmp_path / "checkpoint-3").exists()  # it stopped there
