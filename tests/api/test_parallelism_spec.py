"""parallelism.strategy hsdp/auto and parallelism.tensorParallel: what the server (CEL) and the
models (`kubetrain validate`) accept, and how a refusal names the field and the fix."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_crd import (  # the server's CEL, evaluated; the models' refusal
    cel_violations,
    models_refusal,
    validate_command,
    with_sections,
)

# (sections, the words the refusal must contain; None: accepted by both)
CASES: list[tuple[dict[str, dict[str, Any]], str | None]] = [
    ({"parallelism": {"strategy": "hsdp"}}, None),
    ({"parallelism": {"strategy": "auto"}}, None),
    ({"parallelism": {"strategy": "fsdp", "tensorParallel": 2},
      "workers": {"procsPerWorker": 4}}, None),
    ({"parallelism": {"strategy": "hsdp", "tensorParallel": 2},
      "workers": {"procsPerWorker": 4, "replicas": 2}}, None),
    ({"parallelism": {"tensorParallel": 2}},
     "tensorParallel (2) must divide workers.procsPerWorker"),
    ({"parallelism": {"tensorParallel": 3}, "workers": {"procsPerWorker": 4}},
     "tensorParallel (3) must divide workers.procsPerWorker"),
    ({"parallelism": {"strategy": "ddp", "tensorParallel": 2},
      "workers": {"procsPerWorker": 2}}, "needs strategy fsdp, hsdp or auto"),
    ({"parallelism": {"precision": "fp8", "tensorParallel": 2},
      "workers": {"procsPerWorker": 2}}, "use precision bf16, or tensorParallel 1"),
    ({"parallelism": {"tensorParallel": 2}, "workers": {"procsPerWorker": 2},
      "model": {"preset": "tiny", "architecture": "ssm"}}, "state-space model"),
    ({"parallelism": {"tensorParallel": 2}, "workers": {"procsPerWorker": 2},
      "model": {"preset": "tiny", "dynamics": {"enabled": True}}}, "INL dynamics"),
    ({"parallelism": {"tensorParallel": 2}, "workers": {"procsPerWorker": 2},
      "distillation": {"teacher": "s3://models/teacher"}}, "distillation"),
]


@pytest.mark.parametrize(("sections", "refused"), CASES)
def test_tensor_parallel_combinations_are_judged_alike_by_the_server_and_the_models(
        minimal_manifest: dict[str, Any], sections: dict[str, dict[str, Any]],
        refused: str | None) -> None:
    document = with_sections(minimal_manifest, **sections)
    server = cel_violations(document)
    models = models_refusal(document)
    if refused is None:
        assert server == [] and models is None, (server, models)
        return
    assert models is not None and "spec.parallelism.tensorParallel" in models, models
    assert refused in models, models
    assert len(server) == 1, server
    # The server's message names the field and the same fix.
    assert server[0].startswith("tensorParallel") and refused.split("(")[0].strip() in server[0]


def test_model_dimensions_tensor_parallelism_cannot_split_are_refused_naming_them(
        minimal_manifest: dict[str, Any]) -> None:
    """The server cannot resolve a preset; the models can: llama-125m's 12 heads do not split
    8 ways, and a seqLen of 101 does not split 2 ways."""
    document = with_sections(minimal_manifest, parallelism={"tensorParallel": 8},
                    workers={"procsPerWorker": 8}, model={"preset": "llama-125m"})
    refusal = models_refusal(document)
    assert refusal is not None and "must divide model.nHeads (12)" in refusal
    document = with_sections(minimal_manifest, parallelism={"tensorParallel": 2},
                    workers={"procsPerWorker": 2}, data={"seqLen": 101})
    refusal = models_refusal(document)
    assert refusal is not None and "must divide data.seqLen (101)" in refusal


def test_kubetrain_validate_prints_the_field_and_the_fix(
        minimal_manifest: dict[str, Any], tmp_path: Path) -> None:
    done = validate_command(with_sections(
        minimal_manifest, parallelism={"strategy": "ddp", "tensorParallel": 2},
        workers={"procsPerWorker": 2}), tmp_path)
    assert done.returncode == 1
    assert ("spec.parallelism.tensorParallel (2) needs strategy fsdp, hsdp or auto"
            in done.stderr), done.stderr
