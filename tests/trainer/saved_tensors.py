"""What autograd keeps for backward, measured: the ground truth `kubetrain estimate`'s
activation terms are tested against."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def bytes_saved_for_backward(model: nn.Module, forward: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves while `forward` runs, the model's own
    parameters aside (the planner counts those in other rows)."""
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(size for pointer, size in kept.items() if pointer not in own)
