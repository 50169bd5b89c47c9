"""torchrun's c10d rendezvous, looking at the shared state every 0.1 s instead of every second.

Every restart of a group is a new rendezvous round: the agent whose worker failed (or a
replacement pod's) asks for one, the others learn of it and stop their workers, and all
of them join. torch's dynamic rendezvous, which the c10d backend uses, waits a second
between two reads of the round's shared state while it waits for the other agents
(`_delay(seconds=1)` in its op executor), and answers a read asked for within a second of
the last one from its cache (`cache_duration=1`): that is what a running agent's monitor
loop asks every 0.1 s to learn that another agent waits for a new round. So on each
restart a surviving agent learns up to a second late that a round was asked for, and each
agent sees the others' steps in the round up to a second late: one to two seconds of
waiting in every restart, against a trainer kill's four in all (issue 33).

The `kubetrain` backend (PET_RDZV_BACKEND in the pods the operator makes and in `kubetrain
run`; torchrun finds it through the `torchrun.handlers` entry point) is the c10d backend
with both intervals at `poll_seconds`. The shared state and what each agent writes to it
are c10d's own: an agent on the plain c10d backend joins the same rounds, and only sees
their changes later.

Each agent waiting in a round reads the state once per interval from the store on worker
0, so the interval grows with the group: 0.1 s up to 100 nodes, a thousandth of a second
per node above that, and torch's own second from 1,000 nodes on (at most about 1,000 reads
a second).

The two names it changes are torch's private ones (the module's `_delay` and the state
holder's `_cache_duration`): with a torch that renamed either, it warns once and is the
plain c10d backend.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kubetrain.protocol import RENDEZVOUS_BACKEND as BACKEND  # torchrun's --rdzv-backend

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

TORCH_POLL_SECONDS = 1  # torch's interval, which this shortens

log = logging.getLogger(__name__)


def handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The entry point torchrun loads (group `torchrun.handlers`): the handler's creator."""
    return create_handler


def register_rendezvous() -> None:
    """Register the backend with torchrun's registry in this process, where the entry point
    was not found (own code's image may hold kubetrain as files, not as a distribution)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    # Registering the creator the entry point registered already is no error.
    rendezvous_handler_registry.register(BACKEND, create_handler)


def poll_seconds(max_nodes: int) -> float:
    """Seconds between two reads of a round's shared state, for a group of up to `max_nodes`."""
    return min(float(TORCH_POLL_SECONDS), max(0.1, max_nodes / 1000))


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The c10d backend's handler (torch's `_create_c10d_handler`), polling every
    `poll_seconds(params.max_nodes)`."""
    import torch
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    c10d, store = create_backend(params)
    created = dynamic_rendezvous.create_handler(store, _named(c10d), params)
    holder = getattr(created, "_state_holder", None)
    if not hasattr(dynamic_rendezvous, "_delay") or not hasattr(holder, "_cache_duration"):
        log.warning("kubetrain rendezvous: this torch (%s) has no dynamic_rendezvous._delay or "
                    "state holder cache to shorten: polling every %gs as c10d does",
                    torch.__version__, TORCH_POLL_SECONDS)
        return created
    poll = poll_seconds(params.max_nodes)
    holder._cache_duration = poll  # type: ignore[union-attr]
    _poll_every(dynamic_rendezvous, poll)
    return created


def _named(c10d: Any) -> Any:
    """c10d's backend under this backend's name: torchrun refuses a handler whose backend
    is not the one it asked for."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    class Named(RendezvousBackend):
        @property
        def name(self) -> str:
            return BACKEND

        def get_state(self) -> Any:
            return c10d.get_state()

        def set_state(self, state: bytes, token: Any | None = None) -> Any:
            return c10d.set_state(state, token)

    return Named()


def _poll_every(module: Any, poll: float) -> None:
    """Make the module's `_delay` wait `poll` where torch asks for its one-second poll (other
    delays, such as the first round's random skew, are left as they are)."""
    original = getattr(module._delay, "__wrapped__", module._delay)

    @functools.wraps(original)
    def _delay(seconds: float | tuple[float, float]) -> None:
        original(seconds=poll if seconds == TORCH_POLL_SECONDS else seconds)

    module._delay = _delay
