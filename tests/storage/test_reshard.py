"""FSDP2 checkpoints under torchrun: 2 ranks load on 1 (DCP reshards), and each of 2 loading
ranks reads only part of the checkpoint."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from forked_torchrun import command as forked_torchrun  # (tests/) torchrun, ranks forked

from kubetrain.api.trainingjob import StorageSpec
from kubetrain.trainer.checkpoint import MANIFEST_NAME, latest_checkpoint
from kubetrain.trainer.storage import open_storage

WORKER = Path(__file__).with_name("fsdp_checkpoint_worker.py")


def _torchrun(ranks: int, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        forked_torchrun("--standalone", f"--nproc-per-node={ranks}", str(WORKER), *args),
        check=True, env=env, timeout=120, capture_output=True,
    )


def _assert_equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            _assert_equal_states(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.fixture(scope="module")
def saved_and_loaded(s3_endpoint: str, new_bucket: Callable[[str], str],
                     tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """Two FSDP2 ranks save one checkpoint blocking (`reshard`) and one asynchronously
    (`staged`), in one launch; one rank loads each, in another. Per checkpoint, the state
    the saving ranks held and the state the loading rank loaded."""
    folder = tmp_path_factory.mktemp("reshard")
    bucket = new_bucket("t-saved-and-loaded")
    uris = {name: f"s3://{bucket}/{name}" for name in ("reshard", "staged")}
    _torchrun(2, s3_endpoint, "24",
              "save", uris["reshard"], str(folder / "reshard-saved.pt"),
              "save-async", uris["staged"], str(folder / "staged-saved.pt"))
    _torchrun(1, s3_endpoint, "24", *(part for name, uri in uris.items() for part in (
        "load", uri, str(folder / f"{name}-loaded.pt"))))
    return {name: (torch.load(folder / f"{name}-saved.pt"),
                   torch.load(folder / f"{name}-loaded.pt")) for name in uris}


@pytest.mark.slow
def test_a_two_rank_fsdp_checkpoint_loads_on_one_rank(saved_and_loaded) -> None:
    _assert_equal_states(*saved_and_loaded["reshard"])


@pytest.mark.slow
def test_an_async_two_rank_fsdp_save_holds_its_steps_sharded_state_though_the_next_step_ran(
        saved_and_loaded) -> None:
    """DTensor shards staged into the S3 tier's host buffer (staging.py) and rebuilt as
    DTensors over it for DCP: loaded on one rank, the state is step 2's, not step 3's."""
    _assert_equal_states(*saved_and_loaded["staged"])


@pytest.mark.slow
def test_each_of_two_loading_ranks_reads_less_than_the_whole_checkpoint(
        s3_endpoint: str, s3_bucket: str, faulty_s3: Callable[..., Any], tmp_path: Path) -> None:
    uri = f"s3://{s3_bucket}/ranged"
    # Layers of 1024 x 1024: each rank's file spans several verification chunks.
    _torchrun(2, s3_endpoint, "1024", "save", uri, str(tmp_path / "saved.pt"))
    # One fault-free proxy per rank: what each one serves is what that rank read.
    proxies = [faulty_s3(fault_ratio=0.0) for _ in range(2)]
    _torchrun(2, ",".join(p.endpoint for p in proxies), "1024",
              "load", uri, str(tmp_path / "loaded.pt"))
    _assert_equal_states(torch.load(tmp_path / "saved.pt"), torch.load(tmp_path / "loaded.pt"))

    spec = StorageSpec(endpoint=s3_endpoint)
    info = latest_checkpoint(uri, spec)
    assert info is not None
    folder = open_storage(info.uri, spec)
    sizes = {obj.key: obj.size for obj in folder.list() if obj.key != MANIFEST_NAME}
    whole = sum(sizes.values())
    for rank, proxy in enumerate(proxies):
        own = sizes[f"__{rank}_0.distcp"]
        assert own <= proxy.served < whole, (rank, proxy.served, sizes)
