"""Checkpoint staging (staging.py), shared by both tiers: a snapshot taken at step N holds
step N's state, bit for bit, although the next step runs before anything waits for its
copy; a trainer killed while the copy is in flight restores the snapshot before it; and the
loop waits right before the optimizer step, after the next forward and backward.

The CPU has no streams, so the copies run on a stand-in that defers them as a CUDA side
stream would, to the latest moment the code allows (deferred_stream.py): a wait that is
missing or misplaced shows as a snapshot of a later step. The CUDA path itself is run by
bench/memory_checkpoints.py --device cuda, which checks its snapshots bit for bit too."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

sys.path.insert(0, str(Path(__file__).parent))
from deferred_stream import DeferredStream

from kubetrain.api.manifest import load_job
from kubetrain.api.trainingjob import TrainingJobSpec, step_folder
from kubetrain.memory_budget import FOLDER_ENV, device_phase_fits
from kubetrain.trainer.checkpoint import Checkpointer, ModelState, RandomState
from kubetrain.trainer.loop import Trainer
from kubetrain.trainer.memory_checkpoint import MemoryCheckpoints
from kubetrain.trainer.staging import Layout, Staging, StateDictStaging

KILL_WORKER = Path(__file__).with_name("staging_kill_worker.py")
GIB = 1 << 30


@pytest.fixture
def group_of_one() -> Any:
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        gc.collect()  # the dead group's threads alive while it is collected


def _spec(tmp_path: Path) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({
        "image": "kubetrain/trainer:test", "data": {"train": "s3://bucket/train"},
        "checkpoint": {"uri": str(tmp_path / "s3"), "async": True,
                       "memory": {"everySteps": 1}}})


def _training(seed: int) -> tuple[dict[str, Any], torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": ModelState(model, optimizer), "rng": RandomState()}, model, optimizer


def _forward_backward(model: torch.nn.Module) -> None:
    model(torch.randn(4, 8)).square().mean().backward()


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, staging: Staging) -> None:
    """One training step as the loop takes it: the wait right before the optimizer step."""
    _forward_backward(model)
    staging.before_update()
    optimizer.step()
    optimizer.zero_grad()


def _state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [*(p.detach().clone() for p in model.parameters()),
            *(optimizer.state[p][key].clone() for p in model.parameters()
              for key in ("exp_avg", "exp_avg_sq"))]


def _assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), index


def _restored_from_memory(tmp_path: Path, folder: Path) -> tuple[int, list[torch.Tensor]]:
    app_state, model, optimizer = _training(seed=7)
    restarted = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1, folder=folder)
    restored = restarted.load_latest(app_state)
    restarted.close()
    assert restored is not None
    return restored.step, _state_of(model, optimizer)


# --- a snapshot holds its step's state while the next step runs -------------------------


def test_a_memory_snapshot_holds_its_steps_state_bit_for_bit_though_the_next_step_runs_first(
    tmp_path: Path, group_of_one: Any,
) -> None:
    stream = DeferredStream()
    staging = Staging(torch.device("cpu"), stream)
    app_state, model, optimizer = _training(seed=1)
    folder = tmp_path / "mem"
    tier = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1, folder=folder,
                             staging=staging)
    for _ in range(2):
        _step(model, optimizer, staging)
    tier.save(2, app_state)
    at_two = _state_of(model, optimizer)
    assert stream.pending == 1, "the copy is in flight when save returns"
    _forward_backward(model)  # the next step's forward and backward, beside the copy
    assert stream.pending == 1 and not list(folder.glob("*.meta")), "nothing committed yet"
    staging.before_update()
    assert stream.pending == 0
    optimizer.step()  # changes the weights the snapshot was copied from
    optimizer.zero_grad()
    assert not torch.equal(next(model.parameters()), at_two[0])
    tier.close()

    step, restored = _restored_from_memory(tmp_path, folder)
    assert step == 2
    _assert_bitwise(restored, at_two)


def test_without_the_wait_the_optimizer_step_would_change_the_snapshot_under_its_copy(
    tmp_path: Path, group_of_one: Any,
) -> None:
    """What the test above guards against: with the stand-in's copy deferred as a stream
    defers it, an optimizer step that does not wait changes what the copy reads."""
    stream = DeferredStream()
    staging = Staging(torch.device("cpu"), stream)
    app_state, model, optimizer = _training(seed=1)
    folder = tmp_path / "mem"
    tier = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1, folder=folder,
                             staging=staging)
    _step(model, optimizer, staging)
    tier.save(1, app_state)
    at_one = _state_of(model, optimizer)
    _forward_backward(model)
    optimizer.step()  # no before_update
    optimizer.zero_grad()
    at_two = _state_of(model, optimizer)
    tier.close()

    step, restored = _restored_from_memory(tmp_path, folder)
    assert step == 1
    _assert_bitwise(restored, at_two)  # labelled step 1, holding step 2's weights
    assert not torch.equal(restored[0], at_one[0])


def test_an_async_s3_save_holds_its_steps_state_though_the_next_step_runs_first(
    tmp_path: Path, group_of_one: Any,
) -> None:
    stream = DeferredStream()
    staging = Staging(torch.device("cpu"), stream)
    app_state, model, optimizer = _training(seed=1)
    committed: list[int] = []
    checkpointer = Checkpointer(_spec(tmp_path), rank=0, world_size=1, staging=staging,
                                on_commit=lambda info: committed.append(info.step))
    for _ in range(3):
        _step(model, optimizer, staging)
    checkpointer.save(3, app_state, blocking=False)
    at_three = _state_of(model, optimizer)
    assert stream.pending == 1 and committed == []
    _step(model, optimizer, staging)  # waits before its optimizer step, then changes weights
    assert stream.pending == 0 and not torch.equal(next(model.parameters()), at_three[0])
    checkpointer.wait()
    assert committed == [3]
    checkpointer.close()

    fresh_state, fresh_model, fresh_optimizer = _training(seed=7)
    loader = Checkpointer(_spec(tmp_path), rank=0, world_size=1)
    assert loader.load_latest(fresh_state) == 3
    loader.close()
    _assert_bitwise(_state_of(fresh_model, fresh_optimizer), at_three)


def test_the_s3_tiers_staging_buffer_is_allocated_once_and_reused_from_save_to_save(
    group_of_one: Any,
) -> None:
    app_state, model, optimizer = _training(seed=1)
    _step(model, optimizer, Staging(torch.device("cpu")))
    stager = StateDictStaging(Staging(torch.device("cpu")).area("S3 checkpoints"))
    first = stager.stage(app_state["model"].state_dict()).result()
    _step(model, optimizer, Staging(torch.device("cpu")))
    second = stager.stage(app_state["model"].state_dict()).result()
    for key, tensor in first["model"].items():
        again = second["model"][key]
        assert again.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr(), key
        assert torch.equal(again, dict(model.named_parameters())[key].detach()), key
    stager.close()


# --- a kill while the copy is in flight ---------------------------------------------------


def test_a_trainer_killed_while_a_snapshot_is_copied_restores_the_snapshot_before_it(
    tmp_path: Path, group_of_one: Any,
) -> None:
    folder, expected = tmp_path / "mem", tmp_path / "expected.pt"
    killed = subprocess.run([sys.executable, str(KILL_WORKER), str(folder), str(expected)],
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr[-3000:]
    # Step 3's part went into step 1's slot: its data file is there, its commit is not.
    assert sorted(path.name for path in folder.glob("*.meta")) == ["0-1.meta"]
    assert sorted(path.name for path in folder.glob("*.data")) == ["0-0.data", "0-1.data"]

    step, restored = _restored_from_memory(tmp_path, folder)
    assert step == 2
    saved = torch.load(expected)
    _assert_bitwise(restored[:4], saved["weights"])
    _assert_bitwise(restored[4::2], saved["moments"])


# --- the loop's wait --------------------------------------------------------------------


def test_the_loop_waits_for_snapshots_right_before_the_optimizer_step_after_forward_and_backward(
    tiny_job: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tiny_job("staged", optimization={"maxSteps": 7, "warmupSteps": 2},
                    checkpoint={"everySteps": 3, "async": True, "keepLast": 5,
                                "memory": {"everySteps": 2}})
    monkeypatch.setenv(FOLDER_ENV, str(tmp_path / "shm"))
    events: list[str] = []
    stream = DeferredStream(events)
    model: list[torch.nn.Module] = []
    after: dict[int, dict[str, torch.Tensor]] = {}  # step -> the model's state after it

    def forward(module: torch.nn.Module, args: Any) -> None:
        if not model:
            model.append(module)  # the first forward's module is the whole model
        if events[-1:] != ["forward"]:
            events.append("forward")

    def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        events.append("optimizer step")

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        after[len(after) + 1] = {name: tensor.detach().clone()
                                 for name, tensor in get_model_state_dict(model[0]).items()}

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(forward),
             register_optimizer_step_pre_hook(before_step),
             register_optimizer_step_post_hook(after_step)]
    try:
        result = Trainer(load_job(path).spec, metrics_log=tmp_path / "log.jsonl",
                         serve_metrics=False, copy_stream=stream).fit()
    finally:
        for hook in hooks:
            hook.remove()
    assert result.step == 7

    # Snapshots into memory at 2, 4 and 6, async S3 saves at 3 and 6; the last, blocking.
    enqueued = [index for index, event in enumerate(events) if event == "copy enqueued"]
    assert len(enqueued) == 5
    steps = [index for index, event in enumerate(events) if event == "optimizer step"]
    for index in enqueued:
        following = next(step for step in steps if step > index)
        between = events[index + 1:following]
        # Nothing waited for the copy until the next forward and backward had run ...
        assert "forward" in between and between.index("forward") < between.index("hold"), between
        assert "copy ran" not in between[:between.index("hold")], between
        # ... and then the optimizer step waited for it, with nothing in between.
        assert set(between[between.index("hold"):]) <= {"hold", "copy ran"}, between
    # The S3 checkpoints of steps 3 and 6 hold those steps' weights, bit for bit.
    checkpoints = tmp_path / "staged" / "checkpoints"
    for step in (3, 6):
        loaded = {"model": {"model": {name: torch.empty_like(tensor)
                                      for name, tensor in after[step].items()}}}
        dcp.load(loaded, checkpoint_id=str(checkpoints / step_folder(step)))
        _assert_bitwise(list(loaded["model"]["model"].values()), list(after[step].values()))
        assert any(not torch.equal(after[step][name], after[step + 1][name])
                   for name in after[step]), "the next step changed the weights"


# --- the pieces -------------------------------------------------------------------------


def test_a_layout_puts_the_tensors_on_the_staging_device_first_in_one_range() -> None:
    here = [torch.zeros(3), torch.zeros(2, 5, dtype=torch.float64), torch.zeros(7)]
    there = torch.empty(10, device="meta")  # stands for the device's tensors
    layout = Layout.of([here[0], there, here[1], there], torch.device("meta"))
    assert layout.on_device == (1, 3) and layout.elsewhere == (0, 2)
    assert layout.offsets[1] == 0 and layout.offsets[3] == 64 and layout.device_bytes == 128
    assert layout.offsets[0] == 128 and layout.offsets[2] == 192 and layout.size == 192 + 128
    views = layout.views(torch.zeros(layout.size, dtype=torch.uint8))
    assert [view.shape for view in views] == [(3,), (10,), (2, 5), (10,)]
    assert views[2].dtype == torch.float64


@pytest.mark.parametrize(("free", "needed", "total", "fits"), [
    (60 * GIB, 14 * GIB, 141 * GIB, True),  # an H200 with room: 7 GiB kept free
    (20 * GIB, 14 * GIB, 141 * GIB, False),
    (18 * GIB, 14 * GIB, 80 * GIB, True),  # an H100: 4 GiB kept free
    (17 * GIB, 14 * GIB, 80 * GIB, False),
])
def test_the_device_side_phase_is_taken_only_where_it_leaves_the_headroom_free(
    free: int, needed: int, total: int, fits: bool,
) -> None:
    assert device_phase_fits(free, needed, total) is fits


# --- on a GPU: the real side stream --------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("device_phase", [True, False], ids=["device-phase", "host-copy"])
def test_on_cuda_both_tiers_hold_their_steps_state_though_the_next_step_runs_first(
    tmp_path: Path, group_of_one: Any, device_phase: bool,
) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    staging = Staging(device, device_phase=device_phase)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 256)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    app_state = {"model": ModelState(model, optimizer), "rng": RandomState()}

    def step() -> None:
        model(torch.randn(64, 256, device=device)).square().mean().backward()
        staging.before_update()
        optimizer.step()
        optimizer.zero_grad()

    tier = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1, folder=tmp_path / "mem",
                             staging=staging)
    checkpointer = Checkpointer(_spec(tmp_path), rank=0, world_size=1, staging=staging)
    for _ in range(2):
        step()
    tier.save(2, app_state)
    checkpointer.save(2, app_state, blocking=False)
    at_two = [tensor.cpu() for tensor in _state_of(model, optimizer)]
    step()  # enqueued right behind the copies, which it waits for before its update
    torch.cuda.synchronize()
    assert not torch.equal(next(model.parameters()).cpu(), at_two[0])
    assert tier.staging_path == ("device-side first phase" if device_phase
                                 else "overlapped host copy")
    tier.close()
    checkpointer.close()

    # Restored into the live model, which holds step 3's state.
    restarted = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1,
                                  folder=tmp_path / "mem", staging=Staging(device))
    restored = restarted.load_latest(app_state)
    restarted.close()
    assert restored is not None and restored.step == 2
    _assert_bitwise([tensor.cpu() for tensor in _state_of(model, optimizer)], at_two)
    loader = Checkpointer(_spec(tmp_path), rank=0, world_size=1)
    step()  # the S3 checkpoint of step 2 must put the weights back, bit for bit
    assert loader.load_latest(app_state) == 2
    loader.close()
    _assert_bitwise([tensor.cpu() for tensor in _state_of(model, optimizer)], at_two)
