"""The kubetrain trainer: what every TrainingJob worker runs, and `Trainer` for notebooks.

`from kubetrain.trainer import Trainer` loads torch only when `Trainer` is first
touched: `kubetrain --help` imports this package's command modules (estimate,
prepare, generate) and must stay torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubetrain.trainer.loop import Trainer

__all__ = ["Trainer"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from kubetrain.trainer.loop import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
