"""spec.trainer: your own training code, and the rules that keep the typed fields out of it.

The typed training sections (model, data, optimization, ...) are kubetrain's trainer's; a
job with spec.trainer leaves them at their defaults, checked here both as pydantic code
(`changed_fields`) and as CEL (`own_code_rules`, `at_default_cel`).
"""

from __future__ import annotations

import re
from typing import Any, Final

from pydantic import BaseModel, Field, model_validator
from pydantic.json_schema import JsonDict

from kubetrain.api.base import ApiModel, cel, problem
from kubetrain.api.checkpoint import CheckpointSpec
from kubetrain.api.evaluation import EvaluationSpec
from kubetrain.api.model import ModelSpec
from kubetrain.api.optimization import OptimizationSpec
from kubetrain.api.parallelism import ParallelismSpec
from kubetrain.api.workers import EnvVar

# torchrun's options that kubetrain sets from spec.workers and spec.runPolicy: a command
# that runs torchrun itself must leave them out, or its group would not be the job's.
KUBETRAIN_TORCHRUN_OPTIONS = (
    "--nnodes", "--nproc-per-node", "--nproc_per_node", "--rdzv-backend", "--rdzv_backend",
    "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--max-restarts",
    "--max_restarts", "--node-rank", "--node_rank", "--master-addr", "--master_addr",
    "--master-port", "--master_port", "--standalone",
)
# Interpreter switches that change nothing torchrun's workers need; any other is refused.
_PYTHON_SWITCHES = frozenset({"-u", "-B", "-O", "-OO", "-s", "-E", "-I", "-q"})


class TrainerSpec(ApiModel):
    """Your own training code (Kubeflow TrainJob's spec.trainer): each worker pod runs it
    under kubetrain's elastic torchrun launch, with checkpoints synced to
    spec.checkpoint.uri (docs/own-code.md)."""

    image: str = Field(
        min_length=1,
        description="Container image of your code. It needs torch (torchrun) and kubetrain "
        "(`pip install 'kubetrain[own-code]'`), which restores and uploads checkpoints.",
    )
    command: list[str] = Field(
        min_length=1, max_length=256,
        description="What each training process runs, with args appended: a Python script "
        "or module (`python train.py`, `python -m pkg.train`, or `torchrun train.py` "
        "without the options kubetrain sets), or any other program (run with torchrun's "
        "--no-python). torchrun starts procsPerWorker of them per pod, with RANK, "
        "LOCAL_RANK and WORLD_SIZE set.",
    )
    args: list[str] = Field(
        default_factory=list, max_length=1024,
        description="Arguments appended to command.",
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=256,  # bounds keep the CEL rule's cost in budget
        description="Environment variables of your code (besides workers.template.env).",
    )

    @model_validator(mode="after")
    def _launchable(self) -> TrainerSpec:
        self.torchrun_arguments()
        return self

    def torchrun_arguments(self) -> list[str]:
        """What follows kubetrain's own options on the torchrun command line.

        `python [switches] train.py ...` and `python -m pkg ...` become torchrun's script
        or module; `torchrun ...` (or `python -m torch.distributed.run ...`) keeps its
        own options, none of those kubetrain sets; any other program runs with
        --no-python. Raises a `problem` naming the command when none of these fits.
        """
        argv = [*self.command, *self.args]
        program = argv[0].rsplit("/", 1)[-1]
        if program == "torchrun":
            return self._without_kubetrain_options(argv[1:])
        if not re.fullmatch(r"python[0-9.]*", program):
            return ["--no-python", *argv]
        rest = argv[1:]
        while rest and rest[0] in _PYTHON_SWITCHES:
            rest = rest[1:]
        if rest[:2] == ["-m", "torch.distributed.run"]:
            return self._without_kubetrain_options(rest[2:])
        if rest[:1] == ["-m"] and len(rest) > 1:
            return rest
        if rest and not rest[0].startswith("-"):
            return rest
        raise problem("command", f"{' '.join(argv[:3])!r} runs Python without a script or "
                      "a module (`-m`) that torchrun can start in each process: give "
                      "`python train.py` or `python -m package.module`")

    @staticmethod
    def _without_kubetrain_options(arguments: list[str]) -> list[str]:
        for argument in arguments:
            name = argument.split("=", 1)[0]
            if name in KUBETRAIN_TORCHRUN_OPTIONS:
                raise problem("command", f"sets torchrun's {name}, which kubetrain sets from "
                              "spec.workers (and runPolicy.maxRestarts) so that every pod "
                              "joins one elastic group: remove it")
        return arguments


# The typed training fields: what kubetrain's trainer reads and own code (spec.trainer)
# has no use for, with what the user's code does instead. Each one is refused with
# spec.trainer unless it is left at its default (the API server fills in a section's
# defaults, so "left out" and "at its default" are the same to it).
TYPED_ONLY: Final[dict[str, str]] = {
    "model": "your code builds its own model",
    "data": "your code reads its own data",
    "optimization": "your code sets its own optimizer, schedule and batch size (read "
    "kubetrain.sdk's micro_batch_size to let out-of-memory restarts halve it)",
    "evaluation": "your code runs its own evaluation",
    "parallelism": "your code applies its own parallelism and precision",
    "distillation": "your code computes its own loss",
}
# Of spec.checkpoint, own code uses uri, keepLast and resumeFrom.
CHECKPOINT_TYPED_ONLY: Final = ("every_steps", "keep_best", "export_from", "async_", "export",
                                "memory")
CHECKPOINT_WHY: Final = ("your code decides when to save (kubetrain uploads each folder it "
                         "marks complete) and exports its own model; of spec.checkpoint only "
                         "uri, keepLast and resumeFrom apply")


def _cel_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_cel_literal(item) for item in value) + "]"
    return repr(value)


def at_default_cel(model: type[BaseModel], path: str,
                   fields: tuple[str, ...] | None = None) -> str:
    """A CEL expression true when every field of `model` at `path` is absent or at its
    default: how the API server tells a section the user left alone from one they set."""
    terms = []
    for name, info in model.model_fields.items():
        if fields is not None and name not in fields:
            continue
        at = f"{path}.{info.alias or name}"
        factory = info.default_factory
        if isinstance(factory, type) and issubclass(factory, BaseModel):
            terms.append(f"(!has({at}) || ({at_default_cel(factory, at)}))")
            continue
        default = info.get_default(call_default_factory=True)
        if default is None:
            terms.append(f"!has({at})")
        elif isinstance(default, float):
            # double(): the server's value is a double already; a test's may be an int.
            terms.append(f"(!has({at}) || double({at}) == {default!r})")
        else:
            terms.append(f"(!has({at}) || {at} == {_cel_literal(default)})")
    return " && ".join(terms)


def changed_fields(value: BaseModel, default: BaseModel,
                   fields: tuple[str, ...] | None = None) -> list[str]:
    """The camelCase paths of `value`'s fields that differ from `default`'s."""
    changed = []
    for name, info in type(value).model_fields.items():
        if fields is not None and name not in fields:
            continue
        mine, theirs = getattr(value, name), getattr(default, name)
        if isinstance(mine, BaseModel) and isinstance(theirs, BaseModel):
            changed += [f"{info.alias or name}.{sub}" for sub in changed_fields(mine, theirs)]
        elif mine != theirs:
            changed.append(info.alias or name)
    return changed


def own_code_rules() -> list[JsonDict]:
    rules = [
        cel("has(self.trainer) || has(self.data)",
            "set spec.data to train with kubetrain's trainer, or spec.trainer (image, "
            "command) to run your own training code"),
        cel("!has(self.trainer) || !has(self.data)",
            "spec.trainer and spec.data are both set: a job runs either its own code "
            "(spec.trainer) or kubetrain's trainer (spec.data and the typed training "
            "fields): remove one", ".trainer"),
        cel("has(self.trainer) || has(self.image)",
            "spec.image, kubetrain's trainer image, is required (or set spec.trainer to run "
            "your own code in its own image)"),
        cel("!has(self.trainer) || !has(self.image)",
            "spec.image is kubetrain's trainer image; your own code names its image in "
            "spec.trainer.image: remove spec.image", ".image"),
    ]
    sections: dict[str, type[BaseModel]] = {
        "model": ModelSpec, "optimization": OptimizationSpec, "evaluation": EvaluationSpec,
        "parallelism": ParallelismSpec}
    for section, why in TYPED_ONLY.items():
        if section == "data":
            continue  # the rule above
        model = sections.get(section)
        unset = (f"!has(self.{section})" if model is None
                 else f"!has(self.{section}) || ({at_default_cel(model, f'self.{section}')})")
        rules.append(cel(f"!has(self.trainer) || {unset}",
                         f"spec.{section} is read only by kubetrain's trainer; with "
                         f"spec.trainer {why}: remove spec.{section}", f".{section}"))
    rules.append(cel(
        "!has(self.trainer) || "
        + at_default_cel(CheckpointSpec, "self.checkpoint", CHECKPOINT_TYPED_ONLY),
        "spec.checkpoint.everySteps, keepBest, exportFrom, async, export and memory are read "
        f"only by kubetrain's trainer; with spec.trainer {CHECKPOINT_WHY}", ".checkpoint"))
    return rules

