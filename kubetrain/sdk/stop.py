"""SIGTERM as a flag: stop at a step boundary, save, exit, instead of dying mid-step.

Kubernetes sends SIGTERM before preemption, a rescale, a suspend or a node drain, then
waits the pod's grace period. The first `stop_requested()` call installs a handler that
only records the signal; from then on your loop decides when to stop. Under
torch.distributed one rank may be signalled before the others, and a checkpoint is a
collective: `stop_agreed()` all-reduces the flag (MAX), so every rank sees the same answer
at the same step and they save together. Until the first call, SIGTERM keeps its default
(the process ends), so importing the SDK changes nothing.

Once `stop_agreed()` has said yes, the process is stopping: the checkpoint it marks next
(`mark_complete`) is its stop checkpoint, and the marker says so, so that kubetrain's entry
knows the process has nothing left to save (`stopping()`).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

_seen = threading.Event()
_agreed = threading.Event()
_installed = False


def _handle(signum: int, frame: FrameType | None) -> None:
    _seen.set()


def _install() -> None:
    global _installed
    if _installed:
        return
    try:
        signal.signal(signal.SIGTERM, _handle)
    except ValueError:  # not the main thread: the main thread's first call installs it
        return
    _installed = True


def stop_requested() -> bool:
    """Whether this process has been sent SIGTERM (the first call starts listening)."""
    _install()
    return _seen.is_set()


def stop_agreed() -> bool:
    """Whether any rank of the torch.distributed group was sent SIGTERM: the same answer on
    every rank. A collective: call it on every rank at the same step. Without an
    initialized process group it is `stop_requested()`."""
    signalled = stop_requested()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if signalled:
            _agreed.set()
        return signalled
    import torch

    backend = dist.get_backend()
    device = (torch.device("cuda", torch.cuda.current_device())
              if backend == "nccl" else torch.device("cpu"))
    flag = torch.tensor([1 if signalled else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        _agreed.set()
    return bool(flag.item())


def stopping() -> bool:
    """Whether `stop_agreed()` has said yes in this process: it is saving its last
    checkpoint and then ends."""
    return _agreed.is_set()
