"""kubetrain.sdk: what your own training code (spec.trainer) may call, all optional.

    from kubetrain import sdk

    sdk.stop_requested()                       # once at start: SIGTERM now sets a flag
    start = sdk.latest_checkpoint()            # restored by kubetrain before the start
    for step in range(first, total):
        ...
        sdk.report(step, total_steps=total, loss=loss)
        if step % 500 == 0 or sdk.stop_agreed():
            path = sdk.checkpoint_dir() / f"step-{step}"
            save(path)                         # every rank, or rank 0 alone
            sdk.mark_complete(path, step)      # kubetrain uploads it to checkpoint.uri
        if sdk.stop_agreed():
            break
    sdk.mark_finished()                        # last: a teardown that hangs is ended

Torch-free on import: `stop_agreed` imports torch.distributed when called, and the
transformers callback lives in `kubetrain.sdk.transformers_callback`. Outside a cluster
every call still works and does nothing that needs one: `report` sends nothing without
KUBEFLOW_TRAINER_SERVER_URL, `checkpoint_dir` is ./checkpoints. The contract (the
environment, SIGTERM, exit codes) is docs/own-code.md.
"""

from __future__ import annotations

from kubetrain.sdk.batch import gradient_accumulation_steps, micro_batch_size
from kubetrain.sdk.checkpoints import (
    checkpoint_dir,
    latest_checkpoint,
    mark_complete,
    mark_finished,
)
from kubetrain.sdk.progress import report
from kubetrain.sdk.stop import stop_agreed, stop_requested

__all__ = [
    "checkpoint_dir", "gradient_accumulation_steps", "latest_checkpoint", "mark_complete",
    "mark_finished", "micro_batch_size", "report", "stop_agreed", "stop_requested",
]
