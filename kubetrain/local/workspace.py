"""Where a local run keeps its files, and the demo data it prepares on first use.

Everything a `kubetrain run` of job NAME writes locally lives in `runs/NAME/`
(relative to the current directory):

    runs/NAME/job.yaml          the manifest the trainer reads, relative paths resolved
    runs/NAME/metrics.jsonl     the trainer's metrics log (the progress bar reads it)
    runs/NAME/logs/worker-I.log the output of simulated node I, all attempts appended
    runs/NAME/logs/torchrun/    torchrun's own files (`--log-dir`), a folder per agent
    runs/NAME/corpus/           the demo corpus, when the job prepares one (below)

Relative paths in the manifest's URIs (`spec.model.init`, `spec.data.*`,
`spec.checkpoint.uri`, `spec.checkpoint.resumeFrom`) are resolved under `runs/NAME/`
too, so a local job keeps its data and checkpoints beside its logs; absolute paths,
`file://` and `s3://` URIs are used unchanged (S3 with `spec.storage` and credentials
from the environment, as on Kubernetes).

The annotation `kubetrain.io/prepare-from` names a corpus to prepare when
`spec.data.train` holds no prepared data yet: a path or URI given to `kubetrain
prepare`, or `python-stdlib` for the Python standard library's own source files,
a real corpus present on every machine. The quickstart uses it. A job with
`spec.model.init` is prepared with the tokenizer.json of that model's folder (an
export has one), so the token ids are the ones its embedding learned.
"""

from __future__ import annotations

import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetrain.api.trainingjob import TrainingJob
from kubetrain.pod_conventions import job_snapshot

RUNS_DIR = Path("runs")
PREPARE_FROM_ANNOTATION = "kubetrain.io/prepare-from"
PYTHON_STDLIB = "python-stdlib"

# Demo-data shape: small shards so every data-parallel rank reads from several, and a
# validation split large enough for a stable loss on a corpus of a few MB.
DEMO_SHARD_TOKENS = 1 << 18
DEMO_VALIDATION_FRACTION = 0.05


@dataclass(frozen=True)
class Workspace:
    """The local files of one job; see the module docstring."""

    root: Path

    @classmethod
    def of(cls, job: TrainingJob) -> Workspace:
        return cls(RUNS_DIR / job.metadata.name)

    @property
    def manifest(self) -> Path:
        return self.root / "job.yaml"

    @property
    def metrics_log(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def torchrun_logs(self) -> Path:
        """torchrun's own files (`--log-dir`): a folder per agent, named by its rendezvous."""
        return self.logs / "torchrun"

    def worker_log(self, index: int) -> Path:
        return self.logs / f"worker-{index}.log"

    def resolve(self, uri: str) -> str:
        """`uri` as the trainer should see it: a relative path is placed under the run folder."""
        if "://" in uri or Path(uri).is_absolute():
            return uri
        return str(self.root / uri)

    def localize(self, job: TrainingJob) -> TrainingJob:
        """The job with every relative model, data, checkpoint and teacher path resolved
        under the run folder (own code has only the checkpoint's)."""
        model, data, checkpoint = job.spec.model, job.spec.data, job.spec.checkpoint
        checkpoint = checkpoint.model_copy(update={
            "uri": self.resolve(checkpoint.uri),
            "resume_from": self._resolve_optional(checkpoint.resume_from),
        })
        if job.spec.own_code or data is None:
            return job.model_copy(update={"spec": job.spec.model_copy(
                update={"checkpoint": checkpoint})})
        optional = self._resolve_optional
        distillation = job.spec.distillation
        if distillation is not None:
            distillation = distillation.model_copy(
                update={"teacher": self.resolve(distillation.teacher)})
        spec = job.spec.model_copy(update={
            "model": model.model_copy(update={"init": optional(model.init)}),
            "distillation": distillation,
            "data": data.model_copy(update={
                "train": self.resolve(data.train),
                "validation": optional(data.validation),
                "tokenizer": optional(data.tokenizer),
            }),
            "checkpoint": checkpoint,
        })
        return job.model_copy(update={"spec": spec})

    def _resolve_optional(self, uri: str | None) -> str | None:
        return None if uri is None else self.resolve(uri)

    def write_manifest(self, job: TrainingJob) -> Path:
        """Write the manifest the trainer reads: the same snapshot the operator mounts in pods."""
        self.logs.mkdir(parents=True, exist_ok=True)
        self.manifest.write_text(job_snapshot(job))
        return self.manifest


def corpus_inputs(source: str, workspace: Workspace) -> list[str]:
    """The inputs `kubetrain prepare` reads for a prepare-from annotation value."""
    if source != PYTHON_STDLIB:
        return [source]
    # The top level of the standard library: a few MB of real Python, without the
    # site-packages and test data that share its folder. Copied into one folder of
    # the run, so the user can see what the model trains on.
    return [str(copy_stdlib_sources(workspace.root / "corpus"))]


def copy_stdlib_sources(folder: Path, *, max_bytes: int | None = None,
                        max_file_bytes: int | None = None) -> Path:
    """Copy the standard library's top-level `.py` files into `folder`, in name order.

    A real text corpus every machine has. With `max_bytes`, files are taken while they
    fit in that total; with `max_file_bytes`, larger files are passed over. Returns
    `folder`. The demo, the tests and the benchmarks all train on this corpus.
    """
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        size = path.stat().st_size
        if max_file_bytes is not None and size > max_file_bytes:
            continue
        if max_bytes is not None and total + size > max_bytes:
            continue
        shutil.copyfile(path, folder / path.name)
        total += size
    return folder


def ensure_data(job: TrainingJob, workspace: Workspace) -> str | None:
    """Make sure `spec.data.train` holds prepared data before any worker starts.

    Prepares it from the job's prepare-from corpus when it is missing and returns
    that corpus; returns None when the data was already there. Without the
    annotation, missing data raises FileNotFoundError at once, rather than after
    every restart the run policy allows. `job` must be localized
    (`Workspace.localize`).
    """
    from kubetrain.trainer.prepare import INDEX_NAME, TOKENIZER_NAME, prepare
    from kubetrain.trainer.storage import open_storage

    source = job.metadata.annotations.get(PREPARE_FROM_ANNOTATION)
    train = job.spec.data.train
    if open_storage(train, job.spec.storage).exists(INDEX_NAME):
        return None
    if source is None:
        raise FileNotFoundError(
            f"spec.data.train ({train}) holds no prepared data: run `kubetrain prepare "
            f"CORPUS -o {train.rstrip('/').removesuffix('/train')}`, or annotate the job with "
            f"{PREPARE_FROM_ANNOTATION}: CORPUS to have `kubetrain run` prepare it")
    output, _, split = train.rstrip("/").rpartition("/")
    if split != "train" or not output:
        raise ValueError(f"spec.data.train ({train}) must end in /train to be prepared from "
                         f"the {PREPARE_FROM_ANNOTATION} annotation: `kubetrain prepare` writes "
                         "OUTPUT/train and OUTPUT/validation")
    init = job.spec.model.init
    if job.spec.model.from_teacher and job.spec.distillation is not None:
        init = job.spec.distillation.teacher  # a student sized from it shares its vocabulary
    # A pretrained model reads token ids of its own tokenizer: the one its folder holds.
    tokenizer: dict[str, Any] = (
        {"tokenizer": f"{init.rstrip('/')}/{TOKENIZER_NAME}"} if init is not None
        else {"vocab_size": job.spec.model.resolve().vocab_size})
    prepare(corpus_inputs(source, workspace), output, **tokenizer,
            shard_tokens=DEMO_SHARD_TOKENS, validation_fraction=DEMO_VALIDATION_FRACTION,
            storage=job.spec.storage)
    return source
