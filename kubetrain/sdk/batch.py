"""The micro-batch and gradient accumulation own code should use after out-of-memory restarts.

The operator cannot see your script's batch, so it passes how many times the job ran out
of memory (KUBETRAIN_OUT_OF_MEMORY_RESTARTS) and your script, through these functions,
halves its own micro-batch that many times, with the same rule as kubetrain's trainer:
each step moves to the largest divisor of your micro-batch at most half of the current one
(8 -> 4 -> 2 -> 1; 6 -> 3 -> 1), and accumulation grows by the same factor, so the global
batch stays yours exactly. A script that does not call them still gets its out-of-memory
failures classed, just not halved.
"""

from __future__ import annotations

import os

OUT_OF_MEMORY_RESTARTS_ENV = "KUBETRAIN_OUT_OF_MEMORY_RESTARTS"


def _halvings() -> int:
    try:
        return max(0, int(os.environ.get(OUT_OF_MEMORY_RESTARTS_ENV, "0")))
    except ValueError:
        return 0


def micro_batch_size(yours: int) -> int:
    """The micro-batch to run: `yours`, halved once per out-of-memory restart (at least 1)."""
    if yours < 1:
        raise ValueError(f"a micro-batch size is at least 1, got {yours}")
    current = yours
    for _ in range(_halvings()):
        smaller = next((size for size in range(current // 2, 0, -1) if yours % size == 0), None)
        if smaller is None:
            break
        current = smaller
    return current


def gradient_accumulation_steps(yours: int, micro_batch: int) -> int:
    """Accumulation steps for your global batch when `micro_batch_size(micro_batch)` runs:
    `yours` times the factor the micro-batch shrank by."""
    return yours * (micro_batch // micro_batch_size(micro_batch))
