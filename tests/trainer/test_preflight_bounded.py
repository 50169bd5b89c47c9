"""The preflight's one way to wait on a call that may never return (`run_bounded`): joining
the group, forming a mesh's groups and connecting to the attempt's store each run on a
daemon thread given up at the check's deadline. Its result comes back, its error is raised
again, and at the deadline the caller goes on without it; and the join and the store
connection turn what it gives into the check's failure. In-process, no torchrun."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from kubetrain.api.trainingjob import PreflightPolicy
from kubetrain.trainer.bounded import run_bounded
from kubetrain.trainer.distributed import attempt_store
from kubetrain.trainer.preflight import Preflight, PreflightFailed, StorePortTaken, open_store


def test_a_call_that_returns_in_time_gives_its_result_from_a_daemon_thread() -> None:
    ran_on: list[threading.Thread] = []

    def call() -> int:
        ran_on.append(threading.current_thread())
        return 42

    outcome = run_bounded(call, 5.0, name="preflight-test")
    assert outcome.finished and outcome.error is None
    assert outcome.value("late") == 42
    [thread] = ran_on
    assert thread is not threading.current_thread()
    assert thread.daemon and thread.name == "preflight-test"


def test_a_call_that_raises_in_time_has_its_own_error_raised_again() -> None:
    raised = ConnectionRefusedError("the store's host refused")

    def call() -> int:
        raise raised

    outcome = run_bounded(call, 5.0, name="preflight-test")
    assert outcome.finished and outcome.error is raised
    with pytest.raises(ConnectionRefusedError) as caught:
        outcome.value("late")
    assert caught.value is raised


def test_a_call_still_running_at_the_deadline_is_left_behind() -> None:
    release = threading.Event()
    ran_on: list[threading.Thread] = []

    def call() -> str:
        ran_on.append(threading.current_thread())
        release.wait(30)
        return "too late"

    started = time.monotonic()
    outcome = run_bounded(call, 0.3, name="preflight-test")
    waited = time.monotonic() - started
    try:
        assert 0.3 <= waited < 5.0, waited
        assert not outcome.finished and outcome.error is None
        with pytest.raises(TimeoutError, match="did not return by the deadline"):
            outcome.value("did not return by the deadline")
        # Left behind, still running, and a daemon: the process may end without it.
        [thread] = ran_on
        assert thread.is_alive() and thread.daemon
    finally:
        release.set()
    ran_on[0].join(5)
    assert not ran_on[0].is_alive()
    assert not outcome.finished  # what the caller was given does not change afterwards


def test_a_deadline_already_passed_waits_for_nothing() -> None:
    release = threading.Event()
    started = time.monotonic()
    outcome = run_bounded(lambda: release.wait(30), -3.0, name="preflight-test")
    assert time.monotonic() - started < 1.0
    assert not outcome.finished
    release.set()


def test_a_store_that_refuses_fails_the_check_naming_rank_0() -> None:
    def connect(timeout: timedelta) -> dist.Store:
        raise ConnectionRefusedError("nobody listens")

    with pytest.raises(PreflightFailed, match=r"rank 0 .* did not serve the attempt's store to "
                                              r"rank 1 .*nobody listens") as caught:
        open_store(PreflightPolicy(timeout_seconds=1), 1, connect)
    assert isinstance(caught.value.__cause__, ConnectionRefusedError)


def test_a_store_port_taken_before_rank_0_listens_restarts_the_attempt_blaming_no_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun's agent finds MASTER_PORT free, and another socket of the host may take it
    before rank 0 listens (seen on CI): rank 0's real TCPStore cannot bind, and the error is
    no preflight verdict naming rank 0's node, for a restart's new port mends it."""
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(StorePortTaken, match="EADDRINUSE"):
            open_store(PreflightPolicy(timeout_seconds=5), 0, attempt_store)


def test_a_join_that_raises_fails_the_check_without_leaving_a_thread_behind() -> None:
    store = dist.HashStore()
    check = Preflight(PreflightPolicy(timeout_seconds=2), rank=0, world_size=2,
                      device=torch.device("cpu"), store=store)

    def init() -> None:
        raise RuntimeError("connection reset by peer")

    with pytest.raises(PreflightFailed, match="connection reset by peer"):
        check.join(init, lambda: store)
    assert not check.abandoned_join
