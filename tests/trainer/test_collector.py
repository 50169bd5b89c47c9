"""kubetrain.trainer.collector: imports without the collector's passes, their objects frozen."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from kubetrain.trainer.collector import collector_paused


@pytest.fixture(autouse=True)
def _collector_as_it_was() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    gc.unfreeze()  # this worker's objects collectable again, as before the test
    if enabled:
        gc.enable()
    else:
        gc.disable()


def test_no_collection_within_and_what_was_made_is_frozen_after() -> None:
    gc.enable()
    gc.unfreeze()
    with collector_paused():
        assert not gc.isenabled()
        made = [[] for _ in range(1000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(made)
    walked = {id(o) for o in gc.get_objects()}  # the generations a pass walks
    assert not any(id(m) in walked for m in made)


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_an_import_that_fails_still_lets_the_collector_run_again() -> None:
    gc.enable()
    with pytest.raises(ModuleNotFoundError), collector_paused():
        import kubetrain.trainer.no_such_module  # type: ignore[import-not-found]  # noqa: F401
    assert gc.isenabled()
