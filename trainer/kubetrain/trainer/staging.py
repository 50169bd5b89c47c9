"""Staging a snapshot: a rank's state copied off the tensors training updates, into host
memory a checkpoint tier writes from, while the next step computes. One mechanism for both
tiers: the in-memory tier (memory_checkpoint.py) stages into its slot's own pages, the S3
tier (checkpoint.py) into a host buffer it keeps, entering through DCP's own hook for
staging (`dcp.async_save(..., async_stager=StateDictStaging)`). The loop only says when to
wait: `Staging.before_update()`, right before the optimizer step, the one thing in a step
that changes what a snapshot reads.

    staging = Staging(device)                    # one per attempt, shared by both tiers
    area = staging.area("in-memory checkpoints")   # one per tier
    staged = area.stage(tensors, host, layout)   # returns at once on CUDA
    ...                                          # the next forward and backward
    staging.before_update()                      # the loop, before optimizer.step()
    staged.land()                                # a tier, before it commits

On CUDA (`CudaSideStream`):
- the copies run on a side stream that first waits for the work the training stream has
  enqueued so far (the step that made the state), as non-blocking copies;
- into host memory the GPU copies into at full speed: the host buffer's own pages
  registered with CUDA (`cudaHostRegister`, `Staging.register`) once, so the in-memory
  tier's slot file needs no second, pinned buffer beside it;
- with a device-side first phase where the device has room: the tensors are first copied
  within the GPU into one device buffer, and from there to the host in one copy that runs
  on over the next steps (CheckFreq's two phases). Whether there is room is decided at an
  area's first snapshot from the free device memory (`memory_budget.device_phase_fits`) and
  logged; without room, the overlapped host copy alone;
- the wait before the optimizer step is the training stream waiting for the copy's event
  (`hold`): the host goes on enqueueing, and with the device-side phase the event is the
  copy within the GPU, not the host copy. A tier waits on the host (`land`) only in its
  background thread before it commits, and before a restore, a save over the same memory,
  and exit. Evaluation changes nothing and waits for nothing.

On the CPU (`InPlace`): no stream; the copies are done when `stage` returns, on the caller's
thread, as the tiers did before; there is nothing to wait for.

Where the S3 tier's asynchronous save spent its time before this (torch 2.11-2.13's DCP):
`_StreamingWriter` is DCP's FileSystemWriter, which is also a `BlockingAsyncStager`, and
`async_save` stages through it when given no stager. Its `stage` builds a fresh CPU copy of
the state dict at every save (`_create_cpu_state_dict`, then `_copy_state_dict`): new
pageable memory for the whole state each time, whose pages fault in as the copy writes them;
for each DTensor `obj.to("cpu")` first, a whole synchronous device-to-host copy that is
thrown away before the second copy; and the training thread waits for both. On the H200
that was 8.6-10.8 s for llama-1b's 13.8 GiB, two pageable copies at about 15 GB/s less the
page faults of 27.6 GiB of fresh memory. Planning and writing already ran in DCP's upload
thread. DCP's `DefaultStager` (StagingOptions: pinned memory, a stream, non-blocking copies)
is the same idea in torch, and the reason this module goes through the same hook, but it
does not fit both tiers: it stages into buffers it allocates itself, one per storage, and
cannot write into the in-memory tier's slot files; its stream does not wait for the
training stream (the caller must synchronise the device first); it has no device-side
phase; and the caller waits on the host (`staging_completion`) before the optimizer step.

This module owns the copies and their order. It does not know the tiers' files, formats or
commits, and it never decides when to snapshot (loop.py and the tiers do).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from kubetrain.memory_budget import device_headroom, device_phase_fits

log = logging.getLogger(__name__)

ALIGN = 64  # every tensor's bytes start at a multiple of this, so any dtype view is aligned
GIB = 1 << 30


# --- where the tensors lie in a host buffer ------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where a snapshot's tensors lie in its flat host buffer (uint8): each one's dtype and
    shape in order (`signature`), its offset, and the buffer's size. The tensors on the
    staging device (`on_device`, their indices) are laid out first, so their bytes are one
    range, `[0, device_bytes)`, that a device-side first phase sends to the host in one
    copy; the rest (CPU tensors: RNG states, a CPU optimizer's step counts) follow."""

    signature: tuple[tuple[torch.dtype, torch.Size], ...]
    offsets: list[int]
    size: int
    on_device: tuple[int, ...]
    elsewhere: tuple[int, ...]
    device_bytes: int

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], device: torch.device) -> Layout:
        """The layout of `tensors`, those on `device` first."""
        on_device = tuple(index for index, tensor in enumerate(tensors)
                          if tensor.device == device)
        chosen = set(on_device)
        elsewhere = tuple(index for index in range(len(tensors)) if index not in chosen)
        offsets, size = [0] * len(tensors), 0
        for index in on_device:
            offsets[index], size = size, size + _aligned(tensors[index])
        device_bytes = size
        for index in elsewhere:
            offsets[index], size = size, size + _aligned(tensors[index])
        return cls(tuple((tensor.dtype, tensor.shape) for tensor in tensors), offsets,
                   max(size, ALIGN), on_device, elsewhere, device_bytes)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """A view of `buffer` (uint8, at least `size` bytes, on any device) for each tensor."""
        return [buffer[offset:offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)
                for (dtype, shape), offset in zip(self.signature, self.offsets, strict=True)]


def _aligned(tensor: torch.Tensor) -> int:
    return -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN


# --- where the copies run: the seam between staging and the device ----------------------


class CopyStream(Protocol):
    """Where a snapshot's copies run, and how the training thread orders its own work after
    them. `CudaSideStream` on CUDA, `InPlace` elsewhere. The CPU has no streams, so a test
    that shows the order of the waits gives a stand-in that defers the copies as a stream
    would (tests/trainer/deferred_stream.py)."""

    def enqueue(self, copies: Callable[[], None]) -> Any:
        """Run `copies` after the work the training thread has enqueued so far; a marker of
        their end (None where they are done on return)."""

    def hold(self, marker: Any) -> None:
        """Make the training thread's work from here on wait for `marker`."""

    def synchronize(self, marker: Any) -> None:
        """Wait on the host, on any thread, until `marker` is reached."""


class InPlace:
    """No stream: the copies run on the caller's thread when enqueued (the CPU)."""

    def enqueue(self, copies: Callable[[], None]) -> None:
        copies()

    def hold(self, marker: Any) -> None:
        """Nothing is in flight."""

    def synchronize(self, marker: Any) -> None:
        """Nothing is in flight."""


class CudaSideStream:
    """A CUDA side stream for the copies: it waits for the training stream's work so far,
    and the training stream waits for its events only where it must (`hold`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def enqueue(self, copies: Callable[[], None]) -> torch.cuda.Event:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            copies()
        # Blocking: a thread waiting for it sleeps rather than spins on a core.
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream)
        return event

    def hold(self, marker: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(marker)

    def synchronize(self, marker: torch.cuda.Event) -> None:
        marker.synchronize()


# --- staging ---------------------------------------------------------------------------


class Staged:
    """One snapshot's copies in flight: `captured` once the state is off the tensors
    training updates (the device buffer, or the host), `landed` once all of it is in host
    memory. The two are the same where there is no device-side phase. It keeps the source
    tensors until landed: one the caller drops meanwhile (a state dict's temporary) must
    not go back to the allocator, for the training stream to reuse, while the copy reads it."""

    def __init__(self, stream: CopyStream, captured: Any, landed: Any,
                 sources: Sequence[torch.Tensor]) -> None:
        self._stream, self.captured, self.landed = stream, captured, landed
        self._sources: Sequence[torch.Tensor] | None = sources

    def land(self) -> None:
        """Wait on the host until the snapshot is in host memory (any thread)."""
        self._stream.synchronize(self.landed)
        self._sources = None


class Staging:
    """This process's staging, shared by both checkpoint tiers: the copy stream, the
    captures the next optimizer step must wait for, and the host memory registered with
    CUDA. See the module docstring."""

    def __init__(self, device: torch.device, stream: CopyStream | None = None, *,
                 device_phase: bool | None = None) -> None:
        """`device`: where training keeps the state. `stream`: where the copies run
        (default: a CUDA side stream on CUDA, in place elsewhere). `device_phase`: whether
        areas take a device-side first phase; None decides it from the free device memory
        at each area's first snapshot (bench/memory_checkpoints.py sets it to compare)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream: CopyStream = stream if stream is not None else (
            CudaSideStream(device) if device.type == "cuda" else InPlace())
        self.device_phase = device_phase
        self._holds: list[Any] = []
        self._registered: dict[int, int] = {}  # data_ptr -> bytes registered with CUDA

    @property
    def cuda(self) -> bool:
        """Whether copies run on a CUDA stream into registered host memory."""
        return isinstance(self.stream, CudaSideStream)

    def area(self, name: str) -> StagingArea:
        """A tier's own staging area (`name` is what the log calls it)."""
        return StagingArea(self, name)

    def before_update(self) -> None:
        """Make what comes next (the optimizer step) wait until every snapshot in flight is
        off the tensors it changes. The loop calls it right before the optimizer step, the
        tiers before a restore. On CUDA a wait of the training stream, not of the host."""
        for marker in self._holds:
            self.stream.hold(marker)
        self._holds.clear()

    def captured(self, marker: Any) -> None:
        """Note a snapshot's capture for the next `before_update` (StagingArea's)."""
        if marker is not None:
            self._holds.append(marker)

    def register(self, host: torch.Tensor) -> None:
        """Register `host`'s pages with CUDA, once, so that copies into it run at the GPU's
        full speed and without the host (pinned memory, without a second buffer). Nothing
        on the CPU. `release` before the memory is freed or unmapped."""
        pointer = host.data_ptr()
        if not self.cuda or pointer in self._registered or host.nbytes == 0:
            return
        started = time.perf_counter()
        try:
            _cuda_host_register(pointer, host.nbytes)
        except RuntimeError as error:
            # Still correct without it: copies into pageable memory hold the host until done.
            log.warning("checkpoint staging: could not register %.2f GiB of host memory with "
                        "CUDA (%s): snapshots copy into pageable memory, slower and holding "
                        "the training thread", host.nbytes / GIB, error)
            return
        self._registered[pointer] = host.nbytes
        log.info("checkpoint staging: registered %.2f GiB of host memory with CUDA in %.2f s",
                 host.nbytes / GIB, time.perf_counter() - started)

    def release(self, host: torch.Tensor) -> None:
        """Undo `register` (nothing where it was not registered). Never raises: it runs
        while an attempt closes, where a failed GPU's error must stay the one reported."""
        if self._registered.pop(host.data_ptr(), None) is None:
            return
        try:
            _cuda_host_unregister(host.data_ptr())
        except (RuntimeError, AssertionError) as error:
            log.warning("checkpoint staging: could not unregister %.2f GiB of host memory "
                        "from CUDA (%s); it stays page-locked until the process ends",
                        host.nbytes / GIB, error)


def _cuda_host_register(pointer: int, size: int) -> None:
    # DCP's own helper for its pinned staging (torch.cuda._pin_memory_utils): cudaHostRegister.
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.pin_memory(pointer, size)


def _cuda_host_unregister(pointer: int) -> None:
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.unpin_memory(pointer)


class StagingArea:
    """One tier's staging: its views of the host buffers it stages into, and its device
    buffer where it takes a device-side first phase."""

    def __init__(self, staging: Staging, name: str) -> None:
        self.staging, self.name = staging, name
        self.path: str | None = None  # what its first snapshot chose, for the log and bench
        self._views: dict[int, tuple[torch.Tensor, Layout, list[torch.Tensor]]] = {}
        self._device_buffer: torch.Tensor | None = None
        self._device_views: tuple[Layout, list[torch.Tensor]] | None = None
        self._decided: int | None = None  # the device bytes the path was chosen for

    def stage(self, sources: Sequence[torch.Tensor], host: torch.Tensor,
              layout: Layout) -> Staged:
        """Copy `sources` into `host` (flat uint8 of at least `layout.size` bytes, laid out by
        `layout`). On the CPU done on return; on CUDA in flight: the next optimizer step
        waits for it (`Staging.before_update`), and `Staged.land` waits for it on the host."""
        staging = self.staging
        views = self.views(host, layout)
        if layout.elsewhere:  # CPU tensors beside a CUDA state: copied now, by the host
            with torch.no_grad():
                torch._foreach_copy_([views[index] for index in layout.elsewhere],
                                     [sources[index] for index in layout.elsewhere])
        if layout.elsewhere:
            targets = [views[index] for index in layout.on_device]
            moved = [sources[index] for index in layout.on_device]
        else:  # every tensor on the device (always on the CPU): no lists to build
            targets, moved = views, list(sources)
        non_blocking = staging.cuda
        buffer = self._buffer(layout) if staging.cuda and moved else None

        def copy_to_host() -> None:
            with torch.no_grad():
                torch._foreach_copy_(targets, moved, non_blocking=non_blocking)

        if buffer is None:
            captured = landed = staging.stream.enqueue(copy_to_host)
        else:
            within = self._within(buffer, layout)

            def copy_within_device() -> None:
                with torch.no_grad():
                    torch._foreach_copy_(within, moved, non_blocking=True)

            def send_to_host() -> None:
                host[:layout.device_bytes].copy_(buffer, non_blocking=True)

            captured = staging.stream.enqueue(copy_within_device)
            landed = staging.stream.enqueue(send_to_host)
        staging.captured(captured)
        return Staged(staging.stream, captured, landed, sources)

    def views(self, host: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
        """Views of `host` for each tensor, kept while the buffer and layout stay."""
        cached = self._views.get(host.data_ptr())
        if cached is not None and cached[0] is host and cached[1] is layout:
            return cached[2]
        views = layout.views(host)
        self._views[host.data_ptr()] = (host, layout, views)
        return views

    def _within(self, buffer: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
        """Views of the device buffer for the tensors on the device, kept as `views` are."""
        if self._device_views is None or self._device_views[0] is not layout:
            views = layout.views(buffer)
            self._device_views = (layout, [views[index] for index in layout.on_device])
        return self._device_views[1]

    def forget(self, host: torch.Tensor) -> None:
        """Drop the views of `host` (it is being unmapped or freed)."""
        self._views.pop(host.data_ptr(), None)

    def _buffer(self, layout: Layout) -> torch.Tensor | None:
        """The device buffer of a device-side first phase, or None for the host copy alone:
        chosen at the first snapshot (and again if the state's size changes)."""
        if self._decided == layout.device_bytes:
            return self._device_buffer
        self._device_buffer, self._device_views = None, None
        self._decided = layout.device_bytes
        device, needed = self.staging.device, layout.device_bytes
        free, total = torch.cuda.mem_get_info(device)
        chosen = self.staging.device_phase
        fits = device_phase_fits(free, needed, total) if chosen is None else chosen
        if fits:
            self._device_buffer = torch.empty(needed, dtype=torch.uint8, device=device)
            self.path = "device-side first phase"
            log.info("checkpoint staging of the %s: a device-side first phase, %.2f GiB of "
                     "device memory (%.2f GiB free at the first snapshot, %.2f GiB kept "
                     "free), then to host memory over the next steps", self.name,
                     needed / GIB, free / GIB, device_headroom(total) / GIB)
        else:
            self.path = "overlapped host copy"
            log.info("checkpoint staging of the %s: the overlapped host copy (a device-side "
                     "first phase needs %.2f GiB and %.2f GiB kept free; %.2f GiB free at the "
                     "first snapshot)", self.name, needed / GIB,
                     device_headroom(total) / GIB, free / GIB)
        return self._device_buffer

    def close(self) -> None:
        """Free the device buffer and the views (after the last snapshot has landed)."""
        self._device_buffer, self._device_views, self._decided = None, None, None
        self._views.clear()


# --- the S3 tier: DCP's hook for staging ------------------------------------------------


@dataclass(frozen=True)
class _Slot:
    """Where a tensor of a DCP state dict was: its index among the staged tensors, and its
    DTensor spec (None for a plain tensor)."""

    index: int
    spec: Any


class StateDictStaging(AsyncStager):
    """The S3 tier's staging through DCP's own hook: `dcp.async_save(..., async_stager=)`.

    `stage` lays the state dict's tensors (a DTensor's local shard) out in one host buffer,
    allocated at the first save and kept (registered with CUDA), stages them through its
    area, and returns at once a future of the same state dict over that buffer (DTensors
    rebuilt over their staged shards); DCP's upload thread waits for the future, which
    holds once the copies have landed, and then plans and writes as before. The caller
    waits for the previous upload before the next save (Checkpointer.save): the buffer is
    never written while it is read."""

    _synchronize_after_execute = False  # the future says when staging is done

    def __init__(self, area: StagingArea) -> None:
        self.area = area
        self.staged: Staged | None = None
        self._host: torch.Tensor | None = None
        self._layout: Layout | None = None

    def stage(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]]:
        tensors: list[torch.Tensor] = []
        skeleton = _strip(state_dict, tensors, {})
        layout = self._layout
        if layout is None or layout.signature != tuple((t.dtype, t.shape) for t in tensors):
            layout = self._layout = Layout.of(tensors, self.area.staging.device)
        host = self._buffer(layout.size)
        self.staged = staged = self.area.stage(tensors, host, layout)
        staged_dict = _fill(skeleton, self.area.views(host, layout))
        done: Future[dict[str, Any]] = Future()

        def landed() -> None:
            try:
                staged.land()
            except BaseException as error:
                done.set_exception(error)
            else:
                done.set_result(staged_dict)

        if isinstance(self.area.staging.stream, InPlace):
            landed()
        else:
            threading.Thread(target=landed, name="checkpoint-staging", daemon=True).start()
        return done

    def land(self) -> None:
        """Wait on the host until the last save's staging has landed."""
        if self.staged is not None:
            self.staged.land()

    def synchronize_staging(self) -> None:
        """DCP's older way to wait for staging (its future is the newer): `land`."""
        self.land()

    def _buffer(self, size: int) -> torch.Tensor:
        host = self._host
        if host is None or host.numel() != size:
            if host is not None:
                self.area.forget(host)
                self.area.staging.release(host)
            host = self._host = torch.empty(size, dtype=torch.uint8)
            self.area.staging.register(host)
        return host

    def close(self) -> None:
        """Release the host buffer, after the last save's staging has landed (a device that
        failed raises its error in `land`, to the caller that waits; not here)."""
        try:
            self.land()
        except RuntimeError:
            log.debug("the last staged save did not land", exc_info=True)
        if self._host is not None:
            self.area.forget(self._host)
            self.area.staging.release(self._host)
        self._host = self._layout = self.staged = None
        self.area.close()


def _strip(value: Any, tensors: list[torch.Tensor], seen: dict[int, _Slot]) -> Any:
    """`value` with each tensor replaced by its `_Slot`, the tensors (a DTensor's local
    shard) appended to `tensors`; a tensor met twice (tied weights) is staged once."""
    if isinstance(value, torch.Tensor):
        slot = seen.get(id(value))
        if slot is None:
            local = value._local_tensor if isinstance(value, DTensor) else value
            tensors.append(local.detach())
            slot = seen[id(value)] = _Slot(len(tensors) - 1,
                                           value._spec if isinstance(value, DTensor) else None)
        return slot
    if isinstance(value, dict):
        return {key: _strip(item, tensors, seen) for key, item in value.items()}
    if isinstance(value, list | tuple):
        items = [_strip(item, tensors, seen) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _fill(value: Any, views: list[torch.Tensor]) -> Any:
    """`_strip`'s skeleton with each `_Slot` replaced by its staged view: a DTensor over the
    view where it was one (built as DTensor's own operators build one, from its spec: the
    public `from_local` would move the shard back to the mesh's device)."""
    if isinstance(value, _Slot):
        view = views[value.index]
        return view if value.spec is None else DTensor(view, value.spec, requires_grad=False)
    if isinstance(value, dict):
        return {key: _fill(item, views) for key, item in value.items()}
    if isinstance(value, list | tuple):
        items = [_fill(item, views) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


__all__ = ["ALIGN", "CopyStream", "CudaSideStream", "InPlace", "Layout", "Staged", "Staging",
           "StagingArea", "StateDictStaging"]
