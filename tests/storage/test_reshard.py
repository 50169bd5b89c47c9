"""FSDP2 checkpoints written by 2 ranks load on 1 rank with identical full state (DCP reshards)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("fsdp_checkpoint_worker.py")


def _torchrun(ranks: int, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={ranks}", str(WORKER), *args],
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


@pytest.mark.slow
def test_a_two_rank_fsdp_checkpoint_loads_on_one_rank(
        s3_endpoint: str, s3_bucket: str, tmp_path: Path) -> None:
    uri = f"s3://{s3_bucket}/reshard"
    _torchrun(2, "save", uri, s3_endpoint, str(tmp_path / "saved.pt"))
    _torchrun(1, "load", uri, s3_endpoint, str(tmp_path / "loaded.pt"))
    saved = torch.load(tmp_path / "saved.pt")
    loaded = torch.load(tmp_path / "loaded.pt")
    _assert_equal_states(saved, loaded)
