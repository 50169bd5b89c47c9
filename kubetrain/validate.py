"""Check TrainingJob manifests before they reach a cluster.

Every TrainingJob document in each FILE is checked against the API models and
against the CRD's OpenAPI schema (the one the API server enforces). Every problem
is printed with its file, field path and a hint; the exit code is 1 if any was
found. Documents of other kinds (a Secret beside the job, say) are skipped.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from functools import cache
from typing import Any

from jsonschema import Draft4Validator

from kubetrain.api.crd import open_api_schema
from kubetrain.api.manifest import InvalidManifest, Problem, load_documents, parse_job
from kubetrain.api.scheduling import kueue_path
from kubetrain.api.trainingjob import KIND, TrainerSpec, TrainingJob


@cache
def _schema_validator() -> Draft4Validator:
    # OpenAPI v3.0 schemas use draft-4 semantics (boolean exclusiveMinimum); Kubernetes'
    # x-kubernetes-* keywords are unknown to jsonschema and ignored by it.
    return Draft4Validator(open_api_schema())


def schema_problems(document: dict[str, Any]) -> Iterator[Problem]:
    """Problems the API server's schema check would report for this document."""
    for error in sorted(_schema_validator().iter_errors(document), key=lambda e: list(e.path)):
        path = ""
        for part in error.absolute_path:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
        yield Problem(path, error.message, "rejected by the CRD schema")


def check_document(document: Any) -> list[Problem]:
    """Every problem with one TrainingJob manifest document; empty when it is valid."""
    try:
        parse_job(document)
        problems: list[Problem] = []
    except InvalidManifest as invalid:
        problems = list(invalid.problems)
    if isinstance(document, dict):
        seen = {p.path for p in problems}
        problems += [p for p in schema_problems(document) if p.path not in seen]
    return problems


def own_code_summary(trainer: TrainerSpec) -> str:
    """What applies to a job that runs its own code, for `kubetrain validate`'s report."""
    program = " ".join(trainer.torchrun_arguments())
    return (f"  own code: each worker pod runs `torchrun {program}` in {trainer.image}, "
            "under kubetrain's elastic launch (docs/own-code.md)\n"
            "  applies: workers, runPolicy, checkpoint.uri, keepLast and resumeFrom (the "
            "folders your code marks complete are uploaded there and the newest restored "
            "before it starts), storage, metrics; the typed training fields (model, data, "
            "optimization, evaluation, parallelism, distillation) are kubetrain's trainer's")


def placement_summary(job: TrainingJob) -> str | None:
    """How the job's workers are placed and queued, for `kubetrain validate`'s report;
    None for a job that leaves every choice at its default."""
    scheduling = job.spec.scheduling
    kueue = kueue_path(scheduling.queue, job.metadata.labels)
    if job.spec.managed_elsewhere:
        return (f"  managed by {job.spec.managed_by}: kubetrain's operator leaves this job "
                "alone (no pods, no status writes)")
    if scheduling == type(scheduling)() and kueue is None:
        return None
    gang = {"Auto": "gang Auto (the operator picks from the APIs the cluster serves and says "
            "which in status.scheduling)",
            "None": "no gang (pods placed one by one)"}.get(scheduling.gang,
                                                         f"gang {scheduling.gang}")
    lines = [f"  placement: {gang}"]
    if scheduling.topology is not None:
        lines.append(f"  topology: {scheduling.topology.mode.lower()} within one "
                     f"{scheduling.topology.level} domain")
    if kueue is not None:
        path, queue, why = kueue
        where = "Kueue Workload" if path == "Workload" else "Kueue pod group"
        lines.append(f"  queue: {queue}, as a {where}: {why}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="manifest files ('-' for stdin)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only problems")


def run(args: argparse.Namespace) -> int:
    failed = False
    for file in args.files:
        try:
            documents = load_documents(file)
        except (OSError, InvalidManifest) as error:
            print(f"{file}: {error}", file=sys.stderr)
            failed = True
            continue
        jobs = [d for d in documents if isinstance(d, dict) and d.get("kind") == KIND]
        if not jobs:
            print(f"{file}: no {KIND} found", file=sys.stderr)
            failed = True
        for document in jobs:
            metadata = document.get("metadata")
            name = metadata.get("name", "?") if isinstance(metadata, dict) else "?"
            problems = check_document(document)
            failed |= bool(problems)
            for problem in problems:
                print(f"{file}: {KIND} {name}: {problem}", file=sys.stderr)
            if not problems and not args.quiet:
                print(f"{file}: {KIND} {name} is valid")
                if (job := parse_job(document)).spec.trainer is not None:
                    print(own_code_summary(job.spec.trainer))
                if (placement := placement_summary(job)) is not None:
                    print(placement)
    return 1 if failed else 0
