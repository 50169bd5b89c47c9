"""bench/peers.py, the peers bench/mfu.py measures kubetrain against, checked on the CPU.

The GPU figures come from the benchmark itself; here the harness must train what it
says it trains: transformers' Llama with the tiny dimensions, a loss that starts at
about ln(vocabulary) on random tokens, and a clear `unavailable` (not a crash) for a
peer whose packages do not import.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "bench" / "peers.py"


def run_peer(tmp_path: Path, *arguments: str) -> dict[str, object]:
    result = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(PEERS), "--cpu", "--micro-batch", "2",
                           "--steps", "2", "--result", str(result), *arguments],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.exists(), done.stderr[-3000:]
    outcome: dict[str, object] = json.loads(result.read_text())
    return outcome


def test_the_hf_peer_trains_transformers_llama_and_reports_its_throughput(
        tmp_path: Path) -> None:
    result = run_peer(tmp_path, "--peer", "hf", "--checkpointing", "full")
    assert result["status"] == "ok", result
    assert result["variant"] == "hf+ac-full"
    assert isinstance(result["tokens_per_second"], float) and result["tokens_per_second"] > 0
    # Random ids over a 2048-token vocabulary: a fresh model's loss is about ln(2048) = 7.6.
    assert isinstance(result["loss"], float) and abs(result["loss"] - math.log(2048)) < 0.5


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is not None,
                    reason="torchtitan is installed here: the peer would run, not report")
def test_a_peer_that_does_not_import_is_reported_unavailable_with_why(tmp_path: Path) -> None:
    result = run_peer(tmp_path, "--peer", "torchtitan", "--compile")
    assert result["status"] == "unavailable"
    assert result["variant"] == "torchtitan+compile"
    assert "torchtitan" in str(result["reason"])


def test_variant_names_round_trip() -> None:
    sys.path.insert(0, str(PEERS.parent))
    try:
        import peers  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(PEERS.parent))
    for liger in (False, True):
        for compile_ in (False, True):
            for checkpointing in ("none", "selective", "full"):
                name = peers.variant_name("hf", liger, compile_, checkpointing)
                assert peers.parse_variant(name) == {
                    "peer": "hf", "liger": liger, "compile_": compile_,
                    "checkpointing": checkpointing}
    with pytest.raises(ValueError, match="not a peer variant"):
        peers.parse_variant("deepspeed+compile")
