"""Which model a job builds: `model.architecture` picks the transformer (model.py) or the
state-space model (ssm.py).

The two share their interface - `dims`, `max_seq_len`, `tok_embeddings`, `layers` (the
blocks `parallelize` wraps one by one), `norm`, `output`, `output_loss` and
`forward(tokens, targets=None, *, final_hidden=False)` - so the trainer, distillation,
checkpoints, export and model.init treat them alike; the few places that differ (the
export's config.json, generation, FLOPs) ask `architecture_of`.
"""

from __future__ import annotations

from typing import Literal

from kubetrain.api.trainingjob import DynamicsSpec, ModelDims
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.ssm import StateSpaceModel

LanguageModel = Transformer | StateSpaceModel
Architecture = Literal["transformer", "ssm"]


def build_model(architecture: str, dims: ModelDims, max_seq_len: int, dropout: float = 0.0,
                dynamics: DynamicsSpec | None = None) -> LanguageModel:
    """A freshly initialised model of `architecture` (ModelSpec.architecture) and `dims`.
    `dynamics` applies to the transformer only (the API refuses it with ssm)."""
    if architecture == "ssm":
        return StateSpaceModel(dims, max_seq_len=max_seq_len, dropout=dropout)
    return Transformer(dims, max_seq_len=max_seq_len, dropout=dropout, dynamics=dynamics)


def architecture_of(model: LanguageModel) -> Architecture:
    """The ModelSpec.architecture `model` was built with."""
    return "ssm" if isinstance(model, StateSpaceModel) else "transformer"
