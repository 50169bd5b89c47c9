"""Where a local run keeps its files, and the corpus the demo data is prepared from.

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
prepare`, or `python-stdlib` for the Python standard library's own source files
(`copy_stdlib_sources`), a real corpus present on every machine. The quickstart uses it;
the `kubetrain run` command prepares it (`kubetrain.run.ensure_data`).
"""

from __future__ import annotations

import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from kubetrain.api.trainingjob import TrainingJob
from kubetrain.pod_conventions import job_snapshot

RUNS_DIR = Path("runs")
PREPARE_FROM_ANNOTATION = "kubetrain.io/prepare-from"
PYTHON_STDLIB = "python-stdlib"



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
