"""The process group, the device mesh, and the stop request every rank agrees on.

One code path for every launch: under torchrun the group comes from its
environment (RANK, WORLD_SIZE, MASTER_ADDR...); a plain `python` process or a
notebook gets a one-member group over an in-memory store, so collectives
(checkpoints, the stop flag) work the same everywhere. gloo on CPU, NCCL on GPU.
The attempt's key-value store (`attempt_store`) exists before the group does: the
preflight check (preflight.py) reports through it before any rank joins the group.

A stop is a collective decision. The SIGTERM/SIGINT handler only sets a flag;
`StopRequest.agreed()` all-reduces it (MAX) at a step boundary, so every rank
sees the same answer at the same step and they save one checkpoint together.
Some failures are not worth torchrun's in-place restart (the same micro-batch runs out
of memory again; a broken GPU or a stalled peer stays where it is): `stop_torchrun_agent`
asks the worker's agent to stop, so the pod ends and the operator (or `kubetrain run`)
decides with the failure's class.
This module must not touch the model or the loop.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kubetrain.protocol import AGENT_PID_ENV, EXIT_RESTART


@dataclass(frozen=True)
class World:
    """This process's place in the training group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that serves metrics and writes logs."""
        return self.rank == 0


def local_device() -> tuple[torch.device, str]:
    """This process's device (its LOCAL_RANK's GPU, else the CPU) and the backend for it."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def init_world(store: dist.Store | None = None) -> World:
    """Join (or create) the process group and build a 1-D data-parallel device mesh.

    `store` is the attempt's store when the caller already opened it (`attempt_store`).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device, backend = local_device()
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            # device_id binds NCCL communicators to this GPU eagerly (no lazy first-use init).
            dist.init_process_group(backend=backend, store=store or attempt_store(),
                                    rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]),
                                    device_id=device if backend == "nccl" else None)
        else:
            # Not launched by torchrun: a group of one over an in-memory store.
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    world_size = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    return World(rank=dist.get_rank(), world_size=world_size, local_rank=local_rank,
                 device=device, mesh=mesh)


STORE_TIMEOUT = timedelta(minutes=10)


def attempt_store(timeout: timedelta = STORE_TIMEOUT) -> dist.Store:
    """torchrun's key-value store for this restart attempt, the same on every rank.

    The operator's pods run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each
    rendezvous round then gets a fresh store that rank 0 hosts on a new port, so no key
    of an earlier attempt is ever seen. When torchrun's agent hosts one store for every
    round (its default), the previous attempt's keys remain there and gloo would dial
    the dead processes' addresses, so each attempt gets a namespace named by the restart
    count. That count is the same on every rank only under one agent (`kubetrain run`,
    `--standalone`): with several, an agent whose worker failed counts the restart and
    one that restarts for the new membership does not.

    `timeout` bounds connecting and every wait on it (the preflight check's deadline
    while it runs; `set_timeout` puts it back). Rank 0 hosting it does not wait for the
    others to connect: a peer that never starts must not hold it up.
    """
    rank = int(os.environ["RANK"])
    # Under torchrun the agent hosts the store; a bare launch makes rank 0 host it.
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size=int(os.environ["WORLD_SIZE"]),
                          is_master=rank == 0 and not agent_hosts_it,
                          timeout=timeout, wait_for_workers=False)
    if not agent_hosts_it:
        return store
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"kubetrain/attempt-{attempt}", store)


def stop_torchrun_agent() -> bool:
    """Ask this worker's torchrun agent to stop instead of restarting the group in place.

    Only under torchrun (TORCHELASTIC_RUN_ID), when the agent would restart in place
    (TORCHELASTIC_RESTART_COUNT under TORCHELASTIC_MAX_RESTARTS) and the agent is torchrun
    or kubetrain.trainer.launch (the parent process, or the launcher's pid it names): a
    test runner, a notebook or `kubetrain run`'s own process is never signalled. The
    agent stops every worker and exits non-zero, so the pod fails with the termination
    message. From here on this worker ignores SIGTERM, the agent's
    included, so that it finishes writing why it failed and exits by itself: call this
    before writing. One signal per agent and attempt, however many of its workers fail
    (a second one would interrupt the agent's own shutdown). Returns whether this call
    signalled the agent.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt >= int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")):
        return False  # no restart in place is left: the agent exits by itself
    agent = int(os.environ.get(AGENT_PID_ENV, os.getppid()))
    try:
        with open(f"/proc/{agent}/cmdline", "rb") as cmdline:
            command = [arg.decode(errors="replace") for arg in cmdline.read().split(b"\0")]
    except OSError:
        return False
    if not _is_torchrun(command):
        return False
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.close(os.open(_stop_marker(agent, attempt), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False  # another worker of this agent asked already
    os.kill(agent, signal.SIGTERM)
    return True


def _stop_marker(agent: int, attempt: int) -> str:
    """The file whose creation claims the one signal of an agent's attempt.

    In torchrun's folder for the attempt (the one above each worker's error file), which
    its --log-dir keeps or the container takes with it; in the temporary folder only
    where torchrun names no error file.
    """
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        return os.path.join(os.path.dirname(os.path.dirname(error_file)), "kubetrain-stop-agent")
    run = os.environ["TORCHELASTIC_RUN_ID"]
    return os.path.join(tempfile.gettempdir(), f"kubetrain-stop-agent-{run}-{agent}-{attempt}")


def _is_torchrun(command: list[str]) -> bool:
    """Whether a command line runs torchrun: `torchrun ...`, `python .../torchrun ...`,
    `python [options] -m torch.distributed.run ...` or `-m kubetrain.trainer.launch ...`
    (not merely mentions it)."""
    if command and os.path.basename(command[0]) == "torchrun":
        return True
    for index, arg in enumerate(command[1:], start=1):
        if arg == "-m":
            return command[index + 1:index + 2] in (["torch.distributed.run"],
                                                    ["kubetrain.trainer.launch"])
        if not arg.startswith("-"):  # the script python runs
            return os.path.basename(arg) == "torchrun"
    return False


def shutdown_world() -> None:
    """Leave the process group (safe to call when none exists)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_from_rank0(value: Any, group: dist.ProcessGroup | None) -> Any:
    """Rank 0's `value` on every rank of `group` (a picklable object; None: no group, as is)."""
    if group is None:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]


def all_ranks_agree(ok: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether `ok` holds on every rank of `group` (None: this rank's own answer)."""
    if group is None:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


# A signalled rank that has been inside one collective for this many of its longest spans
# between two step boundaries (and at least STOP_DEADLINE_FLOOR seconds) is blocked on a
# peer that is gone: the group can save nothing together.
STOP_DEADLINE_SPANS = 4
STOP_DEADLINE_FLOOR = 3.0
STOP_DEADLINE_POLL = 0.1
# The spans that count: the latest few, so that a slow stretch just past (a straggler's
# steps and its checkpoint saves at a fraction of a CPU) does not keep the deadline long
# once the steps are short again.
STOP_DEADLINE_RECENT = 4


class StopRequest:
    """SIGTERM/SIGINT turned into a flag that all ranks agree on at step boundaries.

    A rank blocked in a collective whose peer vanished with its node (no connection
    reset: gloo and NCCL wait minutes) never reaches the next boundary, and its torchrun
    agent, told to restart the group once the lost rank's replacement joins, would wait
    its shutdown timeout (30 s) before killing it. So once signalled, a rank that has been
    inside one collective (`inside_since`, rank_timing's clock) for longer than a deadline
    derived from the latest steps measured (`deadline`) exits at once with EXIT_RESTART,
    after `on_give_up` (the lifeline's last word). Python runs signal handlers only
    between bytecodes, which a rank blocked in a collective never reaches, so a thread
    reading the signal wakeup fd watches. Never before a whole step was measured (a first
    step's compilation), never outside a collective or a checkpoint's wait on the other
    ranks (a long evaluation or copy goes on to its checkpoint), and without a signal
    never at all: a long but healthy step moves the deadline with it. On a GPU the host
    does not wait inside NCCL's collectives, so this applies on CPU (gloo) only; NCCL's
    own timeout stands there.
    """

    def __init__(self, on_give_up: Callable[[str], None] | None = None,
                 inside_since: Callable[[], float | None] | None = None) -> None:
        self.signalled = False
        self.on_give_up = on_give_up
        self.inside_since = inside_since
        self._previous: dict[int, object] = {}
        self._previous_wakeup = -1
        self._pipe: tuple[int, int] | None = None
        self._agreed = threading.Event()  # a stop was agreed: the peers are there
        self._boundary = time.monotonic()  # the last step boundary (`agreed`)
        self._boundaries = 0
        # Seconds between two boundaries, the latest STOP_DEADLINE_RECENT of them.
        self._spans: deque[float] = deque(maxlen=STOP_DEADLINE_RECENT)

    def install(self) -> None:
        """Catch SIGTERM and SIGINT (main thread only; a notebook's other threads skip it)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:
                return
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._pipe = (read, write)
        threading.Thread(target=self._watch, args=(read,), name="stop-deadline",
                         daemon=True).start()

    def uninstall(self) -> None:
        """Restore the handlers that were there before `install`."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            os.close(self._pipe[1])  # the watcher reads end-of-file and closes the other end
            self._pipe = None
        self._agreed.set()

    @property
    def longest_span(self) -> float:
        """The longest of the latest spans between two step boundaries; 0 before one."""
        return max(self._spans, default=0.0)

    def deadline(self) -> float:
        """Seconds a signalled rank may take to reach the stop agreement."""
        return max(STOP_DEADLINE_FLOOR, STOP_DEADLINE_SPANS * self.longest_span)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the loop decides at the next step boundary, together with the other ranks.
        self.signalled = True

    def _watch(self, read: int) -> None:
        """Start the deadline at the first SIGTERM or SIGINT the wakeup fd reports."""
        try:
            while chunk := os.read(read, 64):
                if any(signum in (signal.SIGTERM, signal.SIGINT) for signum in chunk):
                    break
            else:
                return  # uninstalled
            # The handler may not have run yet (the main thread is in a collective).
            while not self._agreed.wait(STOP_DEADLINE_POLL):
                if not self._previous:
                    return  # uninstalled: the attempt is over
                since = self.inside_since() if self.inside_since is not None else None
                deadline = self.deadline()
                if (since is not None and self.longest_span > 0
                        and time.monotonic() - since > deadline):
                    break
            else:
                return
            why = (f"stop not agreed: inside one collective for over {deadline:.1f}s (4 of "
                   f"its longest recent steps, {self.longest_span:.2f}s): a peer is gone, so no "
                   f"checkpoint can be saved; exiting for torchrun to re-form the group")
            print(f"rank {os.environ.get('RANK', '0')}: {why}", file=sys.stderr, flush=True)
            if self.on_give_up is not None:
                self.on_give_up(why)
            os._exit(EXIT_RESTART)
        finally:
            os.close(read)

    def agreed(self, device: torch.device) -> bool:
        """True on every rank when any rank was signalled (a collective: call it on all ranks)."""
        now = time.monotonic()
        if self._boundaries:  # from the first boundary on: start-up is no step
            self._spans.append(now - self._boundary)
        self._boundaries += 1
        flag = torch.tensor([1 if self.signalled else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._boundary = time.monotonic()
        if flag.item():
            self._agreed.set()
        return bool(flag.item())
