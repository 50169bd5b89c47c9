"""Checkpoints: manifest-last commits, async saves, rotation, refusal of corrupt or foreign ones."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import torch

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import StorageSpec, TrainingJobSpec
from kubetrain.trainer.checkpoint import (
    MANIFEST_NAME,
    Checkpointer,
    CheckpointInfo,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    ModelState,
    RandomState,
    committed_checkpoints,
    latest_checkpoint,
    step_folder,
)
from kubetrain.trainer.data import TokenDataset
from kubetrain.trainer.prepare import PreparedDataset
from kubetrain.trainer.storage import HASH_CHUNK, open_storage

# Checkpoints are collectives: these tests run in a one-process group.
pytestmark = pytest.mark.usefixtures("process_group")


def _spec(uri: str, storage: StorageSpec | None, train_uri: str,
          **checkpoint: Any) -> TrainingJobSpec:
    return parse_job({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "ckpt"},
        "spec": {"image": "trainer", "model": {"preset": "tiny"},
                 "data": {"train": train_uri, "seqLen": 16},
                 "optimization": {"maxSteps": 100, "microBatchSize": 2},
                 "checkpoint": {"uri": uri, **checkpoint},
                 "storage": storage.wire() if storage else {}},
    }).spec


class Progress:
    """A stand-in for the loop's train state: a step and the best validation loss."""

    def __init__(self) -> None:
        self.step, self.best_val_loss = 0, float("inf")

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "best_val_loss": self.best_val_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.best_val_loss = state["step"], state["best_val_loss"]


def _app(spec: TrainingJobSpec, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    data = TokenDataset(spec.data.train, seq_len=spec.data.seq_len, micro_batch_size=2)
    return {"model": ModelState(model, optimizer), "scheduler": scheduler, "data": data,
            "train": Progress(), "rng": RandomState()}


def _train(app: dict[str, Any], steps: int) -> None:
    model, optimizer = app["model"].model, app["model"].optimizer
    for _ in range(steps):
        inputs, _ = next(app["data"])
        loss = model(inputs[:, :16].float()).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        app["scheduler"].step()
        app["train"].step += 1
        app["train"].best_val_loss = min(app["train"].best_val_loss, loss.item())


def _snapshot(app: dict[str, Any]) -> dict[str, Any]:
    model, optimizer = app["model"].model, app["model"].optimizer
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "moments": [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()],
        "lr": optimizer.param_groups[0]["lr"],
        "data": app["data"].state_dict(), "train": app["train"].state_dict(),
        "rng": torch.get_rng_state(),
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a["moments"], b["moments"], strict=True))
    assert (a["lr"], a["data"], a["train"]) == (b["lr"], b["data"], b["train"])
    assert torch.equal(a["rng"], b["rng"])


@pytest.fixture
def s3_spec(s3_endpoint: str) -> StorageSpec:
    return StorageSpec(endpoint=s3_endpoint, region="us-east-1")


def test_a_loaded_checkpoint_restores_every_part_of_the_training_state(
        s3_bucket: str, s3_spec: StorageSpec, prepared_corpus: PreparedDataset) -> None:
    spec = _spec(f"s3://{s3_bucket}/job", s3_spec, prepared_corpus.train_uri)
    app = _app(spec, seed=1)
    _train(app, 3)
    saver = Checkpointer(spec, rank=0, world_size=1)
    saver.save(3, app)
    saved = _snapshot(app)
    saver.close()

    fresh = _app(spec, seed=2)
    loader = Checkpointer(spec, rank=0, world_size=1)
    assert loader.load_latest(fresh) == 3
    _assert_same(_snapshot(fresh), saved)
    manifest = open_storage(f"s3://{s3_bucket}/job/{step_folder(3)}", s3_spec)
    assert b'"preset": "tiny"' in manifest.read_bytes(MANIFEST_NAME)  # the config that made it
    loader.close()


def test_a_checkpoint_without_an_optional_entry_still_loads_the_rest(
        tmp_path: Any, prepared_corpus: PreparedDataset) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from kubetrain.trainer.goodput import GoodputLedger

    spec = _spec(str(tmp_path / "job"), None, prepared_corpus.train_uri)
    app = _app(spec, seed=1)
    _train(app, 2)
    saver = Checkpointer(spec, rank=0, world_size=1)
    saver.save(2, app)  # as a kubetrain from before goodput accounting saved it
    saved = _snapshot(app)
    saver.close()

    fresh = {**_app(spec, seed=2), "goodput": GoodputLedger(attempt_started=0.0)}
    with pytest.raises(CheckpointException) as refused:  # what a plain load says
        Checkpointer(spec, rank=0, world_size=1).load_latest(fresh)
    assert "Missing key in checkpoint state_dict: goodput" in str(refused.value)
    fresh = {**_app(spec, seed=2), "goodput": GoodputLedger(attempt_started=0.0)}
    loader = Checkpointer(spec, rank=0, world_size=1, optional_state=frozenset({"goodput"}))
    assert loader.load_latest(fresh) == 2
    _assert_same(_snapshot(fresh), saved)
    loader.close()


def test_an_async_save_keeps_the_state_of_the_step_it_was_called_at(
        s3_bucket: str, s3_spec: StorageSpec, prepared_corpus: PreparedDataset) -> None:
    spec = _spec(f"s3://{s3_bucket}/job", s3_spec, prepared_corpus.train_uri, **{"async": True})
    app = _app(spec, seed=1)
    _train(app, 2)
    committed: list[int] = []
    checkpointer = Checkpointer(spec, rank=0, world_size=1,
                                on_commit=lambda info: committed.append(info.step))
    checkpointer.save(2, app, blocking=False)
    saved = _snapshot(app)
    _train(app, 2)  # training goes on while the upload runs
    checkpointer.wait()
    assert committed == [2]

    fresh = _app(spec, seed=3)
    assert Checkpointer(spec, rank=0, world_size=1).load_latest(fresh) == 2
    _assert_same(_snapshot(fresh), saved)
    checkpointer.close()


def test_a_checkpoint_loads_into_an_optimizer_of_another_kernel_which_keeps_its_own() -> None:
    """Param groups come back with the saving process's kernel (`fused`, `foreach`): the
    loading optimizer keeps its own, which its grad scaler was set up for (the trainer's
    fused CPU Adam resuming a checkpoint of the per-parameter loop, torch's default)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    saving = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    saving.step()
    state = ModelState(model, saving).state_dict()
    loading = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ModelState(model, loading).load_state_dict(state)
    assert all(group["fused"] for group in loading.param_groups)
    assert loading.state_dict()["state"][0]["step"] == 1  # the state itself came back
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    scaler.step(loading)  # the loop's kernel would refuse the scale the scaler hands it
    assert loading.state_dict()["state"][0]["step"] == 2


def test_uncommitted_saves_are_ignored_and_rotation_keeps_the_newest(
        s3_bucket: str, s3_spec: StorageSpec, prepared_corpus: PreparedDataset) -> None:
    uri = f"s3://{s3_bucket}/job"
    spec = _spec(uri, s3_spec, prepared_corpus.train_uri, keepLast=2)
    app = _app(spec, seed=1)
    checkpointer = Checkpointer(spec, rank=0, world_size=1)
    store = open_storage(uri, s3_spec)
    for step in (1, 2, 3):
        _train(app, 1)
        checkpointer.save(step, app)
    checkpointer.wait()  # step 1's rotation, in the background, before the folders change
    at_three = _snapshot(app)
    # A save that crashed before its manifest: files but no commit, older and newer.
    for step in (2, 9):
        folder = store.join(step_folder(step))
        folder.write_bytes("__0_0.distcp", b"partial")
        folder.delete([MANIFEST_NAME])
    assert [info.step for info in committed_checkpoints(uri, s3_spec)] == [3]
    assert latest_checkpoint(uri, s3_spec).step == 3  # type: ignore[union-attr]

    _train(app, 1)
    checkpointer.save(4, app)
    checkpointer.wait()  # rotation runs after the commit, in the background
    folders = {obj.key.partition("/")[0] for obj in store.list()}
    assert folders == {step_folder(3), step_folder(4), step_folder(9)}

    fresh = _app(spec, seed=5)
    resumed = Checkpointer(spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(
        update={"keep_last": 1})}), rank=0, world_size=1)
    store.delete([f"{step_folder(4)}/{MANIFEST_NAME}"])  # as if step 4 never committed
    assert resumed.load_latest(fresh) == 3
    _assert_same(_snapshot(fresh), at_three)
    checkpointer.close()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_rotation_that_finds_no_commit_stops_neither_saves_nor_later_rotations(
        blocking: bool, tmp_path: Any, prepared_corpus: PreparedDataset) -> None:
    # The manifest just written is gone from the listing when the rotation runs (deleted
    # by hand, or a store whose listing lags its writes): the folder holds files but no
    # commit. That clean-up has nothing to do; training goes on saving.
    uri = str(tmp_path / "job")
    spec = _spec(uri, None, prepared_corpus.train_uri, keepLast=1, **{"async": not blocking})
    store = open_storage(uri)

    def delete_the_manifest(info: CheckpointInfo) -> None:
        if info.step == 1:
            store.delete([f"{step_folder(1)}/{MANIFEST_NAME}"])

    app = _app(spec, seed=1)
    checkpointer = Checkpointer(spec, rank=0, world_size=1, on_commit=delete_the_manifest)
    for step in (1, 2, 3):
        _train(app, 1)
        checkpointer.save(step, app, blocking=blocking)  # waits for the last one's rotation
    checkpointer.wait()
    assert [info.step for info in committed_checkpoints(uri)] == [3]  # rotation works again
    assert {obj.key.partition("/")[0] for obj in store.list()} == {step_folder(3)}
    at_three = _snapshot(app)
    checkpointer.close()

    fresh = _app(spec, seed=2)
    assert Checkpointer(spec, rank=0, world_size=1).load_latest(fresh) == 3
    _assert_same(_snapshot(fresh), at_three)


@pytest.mark.parametrize("damage", ["truncate", "flip-a-byte"])
def test_a_damaged_file_is_refused_and_the_previous_checkpoint_resumed(
        damage: str, tmp_path: Any, prepared_corpus: PreparedDataset,
        caplog: pytest.LogCaptureFixture) -> None:
    spec = _spec(str(tmp_path / "ckpt"), None, prepared_corpus.train_uri)
    app = _app(spec, seed=1)
    checkpointer = Checkpointer(spec, rank=0, world_size=1)
    _train(app, 1)
    checkpointer.save(1, app)
    at_one = _snapshot(app)
    _train(app, 1)
    checkpointer.save(2, app)
    shard = tmp_path / "ckpt" / step_folder(2) / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100] if damage == "truncate" else
                      data[:50] + bytes([data[50] ^ 1]) + data[51:])

    fresh = _app(spec, seed=9)
    assert Checkpointer(spec, rank=0, world_size=1).load_latest(fresh) == 1
    _assert_same(_snapshot(fresh), at_one)
    assert "truncated or modified" in caplog.text and "__0_0.distcp" in caplog.text
    checkpointer.close()


def test_a_checkpoint_from_before_blake3_loads_and_is_still_verified(
        tmp_path: Any, prepared_corpus: PreparedDataset,
        caplog: pytest.LogCaptureFixture) -> None:
    spec = _spec(str(tmp_path / "ckpt"), None, prepared_corpus.train_uri)
    app = _app(spec, seed=1)
    checkpointer = Checkpointer(spec, rank=0, world_size=1)
    _train(app, 2)
    checkpointer.save(2, app)
    checkpointer.close()
    saved = _snapshot(app)
    # Rewrite the manifest as v2 wrote it: sha256 chunk digests under their old key.
    folder = tmp_path / "ckpt" / step_folder(2)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest["format"] = "kubetrain-checkpoint-v2"
    del manifest["digest"]
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        del entry["chunks"]
        entry["chunk_sha256"] = [hashlib.sha256(data[at:at + HASH_CHUNK]).hexdigest()
                                 for at in range(0, len(data), HASH_CHUNK)]
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))

    fresh = _app(spec, seed=9)
    assert Checkpointer(spec, rank=0, world_size=1).load_latest(fresh) == 2
    _assert_same(_snapshot(fresh), saved)

    shard = folder / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:50] + bytes([data[50] ^ 1]) + data[51:])
    with pytest.raises(CorruptCheckpoint, match="no intact committed checkpoint"):
        Checkpointer(spec, rank=0, world_size=1).load_latest(_app(spec, seed=9))
    assert "truncated or modified" in caplog.text


def test_a_checkpoint_of_another_model_is_refused_with_the_differences(
        tmp_path: Any, prepared_corpus: PreparedDataset) -> None:
    spec = _spec(str(tmp_path / "ckpt"), None, prepared_corpus.train_uri)
    app = _app(spec, seed=1)
    Checkpointer(spec, rank=0, world_size=1).save(1, app)
    wider = spec.model.model_copy(update={"dim": 128})
    other = spec.model_copy(update={"model": wider})
    with pytest.raises(IncompatibleCheckpoint, match=r"dim: 64 there, 128 here"):
        Checkpointer(other, rank=0, world_size=1).load_latest(_app(spec, seed=1))


@pytest.mark.parametrize(("saved_with", "loaded_with"), [("transformer", "ssm"),
                                                         ("ssm", "transformer")])
def test_a_checkpoint_of_another_architecture_is_refused_naming_the_field(
        tmp_path: Any, prepared_corpus: PreparedDataset, saved_with: str,
        loaded_with: str) -> None:
    """The same dimensions, another model: refused before DCP's missing keys would say so."""
    def built_as(spec: TrainingJobSpec, architecture: str) -> TrainingJobSpec:
        model = spec.model.model_copy(update={"architecture": architecture})
        return spec.model_copy(update={"model": model})

    spec = _spec(str(tmp_path / "ckpt"), None, prepared_corpus.train_uri)
    Checkpointer(built_as(spec, saved_with), rank=0, world_size=1).save(1, _app(spec, seed=1))
    with pytest.raises(IncompatibleCheckpoint) as refused:
        Checkpointer(built_as(spec, loaded_with), rank=0, world_size=1).load_latest(
            _app(spec, seed=1))
    assert (f"architecture {saved_with} (spec.model.architecture), here it is {loaded_with}: "
            f"set spec.model.architecture: {saved_with} to resume") in str(refused.value)


@pytest.mark.parametrize("saved_with", [True, False], ids=["dynamics-on", "dynamics-off"])
def test_a_checkpoint_with_the_dynamics_switched_is_refused_naming_the_field(
        tmp_path: Any, prepared_corpus: PreparedDataset, saved_with: bool) -> None:
    def switched(spec: TrainingJobSpec, on: bool) -> TrainingJobSpec:
        model = spec.model.model_copy(update={
            "dynamics": spec.model.dynamics.model_copy(update={"enabled": on})})
        return spec.model_copy(update={"model": model})

    spec = _spec(str(tmp_path / "ckpt"), None, prepared_corpus.train_uri)
    saving, loading = switched(spec, saved_with), switched(spec, not saved_with)
    Checkpointer(saving, rank=0, world_size=1).save(1, _app(spec, seed=1))
    with pytest.raises(IncompatibleCheckpoint) as refused:
        Checkpointer(loading, rank=0, world_size=1).load_latest(_app(spec, seed=1))
    state = "on" if saved_with else "off"
    assert f"INL dynamics {state} (spec.model.dynamics.enabled)" in str(refused.value)
    assert f"spec.model.dynamics.enabled: {str(saved_with).lower()} to resume" \
        in str(refused.value)
    # The same switch as the checkpoint's loads it.
    assert Checkpointer(saving, rank=0, world_size=1).load_latest(_app(spec, seed=1)) == 1


def test_resume_from_starts_a_new_job_from_another_jobs_checkpoint(
        s3_bucket: str, s3_spec: StorageSpec, prepared_corpus: PreparedDataset) -> None:
    first = _spec(f"s3://{s3_bucket}/first", s3_spec, prepared_corpus.train_uri)
    app = _app(first, seed=1)
    _train(app, 2)
    Checkpointer(first, rank=0, world_size=1).save(2, app)
    saved = _snapshot(app)

    second = _spec(f"s3://{s3_bucket}/second", s3_spec, prepared_corpus.train_uri,
                   resumeFrom=f"s3://{s3_bucket}/first")
    fresh = _app(second, seed=4)
    checkpointer = Checkpointer(second, rank=0, world_size=1)
    assert checkpointer.load_latest(fresh) == 2
    _assert_same(_snapshot(fresh), saved)
    assert latest_checkpoint(f"s3://{s3_bucket}/second", s3_spec) is None


def test_keep_best_keeps_the_lowest_validation_loss_out_of_rotation_across_resumes(
        tmp_path: Any, prepared_corpus: PreparedDataset) -> None:
    uri = str(tmp_path / "job")
    spec = _spec(uri, None, prepared_corpus.train_uri, keepLast=1, keepBest=True)
    app = _app(spec, seed=1)
    checkpointer = Checkpointer(spec, rank=0, world_size=1)
    store = open_storage(uri)
    at_best: dict[str, Any] = {}
    # Validation losses by step: the best (2.0) comes early, then only worse ones.
    for step, val_loss in ((1, 3.0), (2, 2.0), (3, 2.5), (4, None), (5, 2.2)):
        _train(app, 1)
        if val_loss is not None and checkpointer.improves_best(val_loss):
            at_best = _snapshot(app)
        checkpointer.save(step, app, val_loss=val_loss)
        checkpointer.wait()
    folders = {obj.key.partition("/")[0] for obj in store.list()}
    assert folders == {step_folder(2), step_folder(5)}  # the best, and keepLast 1
    assert checkpointer.best is not None and checkpointer.best.step == 2
    assert checkpointer.best.val_loss == 2.0
    assert checkpointer.best.uri == store.join(step_folder(2)).uri
    checkpointer.close()

    # A resumed job remembers it, keeps it through later rotations and can load it.
    fresh = _app(spec, seed=7)
    resumed = Checkpointer(spec, rank=0, world_size=1)
    assert resumed.load_latest(fresh) == 5
    assert resumed.best == checkpointer.best
    _train(fresh, 1)
    resumed.save(6, fresh, val_loss=2.1)
    resumed.wait()
    assert {obj.key.partition("/")[0] for obj in store.list()} == {step_folder(2),
                                                                  step_folder(6)}
    assert resumed.load_best({"model": fresh["model"]}) == 2  # the model and its optimizer
    loaded = _snapshot(fresh)
    assert all(torch.equal(x, y) for x, y in zip(loaded["params"], at_best["params"],
                                                 strict=True))
    assert all(torch.equal(x, y) for x, y in zip(loaded["moments"], at_best["moments"],
                                                 strict=True))
    resumed.close()

    # Without keepBest nothing is kept beyond keepLast.
    plain = _spec(str(tmp_path / "plain"), None, prepared_corpus.train_uri, keepLast=1)
    assert not Checkpointer(plain, rank=0, world_size=1).improves_best(0.1)
