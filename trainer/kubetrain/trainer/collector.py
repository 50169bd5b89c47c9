"""Imports without the cyclic garbage collector's passes over what they create.

Importing torch creates hundreds of thousands of objects, none of them garbage, and the
collector's generational passes over them are a tenth to a fifth of the import's CPU. Paused
while the imports run, and the objects they created then frozen out of every later pass
(`gc.freeze`): for the rest of the process, and in the processes forked from it, a pass
walks only what was created after.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Within the block, no collection; after it, what exists is frozen out of later
    passes, and the collector runs again if it ran before."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
