"""Leader election over a coordination.k8s.io Lease: of several operator replicas, one acts.

The same protocol as client-go's leaderelection: the leader renews the Lease every
`retry_seconds`; a candidate takes it over once it has seen the same holder and
renew time for `lease_seconds` (measured on its own clock, so clocks need not
agree), and every write carries the resourceVersion it read as a precondition, so
two candidates cannot both win. The leader stops acting when it could not renew for two thirds
of the lease, before any candidate may take over, and hands the Lease back when it
stops, so a standby takes over within one retry.

The operator keeps watching while it stands by (its indexes stay warm) and only
its writes wait for the Lease: `is_leader()` gates every reconcile.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

LEASE_NAME = "kubetrain-operator"
# The leader stops acting this far into its lease without a renewal (client-go's renewDeadline).
RENEW_DEADLINE_FRACTION = 2 / 3

log = logging.getLogger(__name__)


class LeaderElection:
    """Holds or waits for the Lease `namespace/LEASE_NAME` on behalf of `identity`."""

    def __init__(self, api: client.ApiClient, namespace: str, identity: str, *,
                 lease_seconds: float, retry_seconds: float,
                 on_elected: Callable[[], None]) -> None:
        self.leases = client.CoordinationV1Api(api)
        self.namespace = namespace
        self.identity = identity
        self.lease_seconds = lease_seconds
        self.retry_seconds = retry_seconds
        self.on_elected = on_elected
        self._leading_until = 0.0  # monotonic
        self._seen: tuple[str | None, datetime | None] | None = None  # (holder, renewTime)
        self._seen_at = 0.0

    def is_leader(self) -> bool:
        """True while this replica holds an unexpired Lease it renewed itself."""
        return time.monotonic() < self._leading_until

    def run(self, stop: threading.Event) -> None:
        """Acquire and renew until `stop` is set; then hand the Lease back if held."""
        try:
            while not stop.is_set():
                try:
                    self._try_acquire_or_renew()
                except ApiException as error:
                    log.warning("leader election: %s %s", error.status, error.reason)
                stop.wait(self.retry_seconds)
        finally:
            self._release()

    def _try_acquire_or_renew(self) -> None:
        started = time.monotonic()
        now = datetime.now(UTC)
        try:
            lease = self.leases.read_namespaced_lease(LEASE_NAME, self.namespace)
        except ApiException as error:
            if error.status != 404:
                raise
            self._create(now, started)
            return
        spec = lease.spec or client.V1LeaseSpec()
        seen = (spec.holder_identity, spec.renew_time)
        if seen != self._seen:
            self._seen, self._seen_at = seen, started
        held_by_other = (bool(spec.holder_identity) and spec.holder_identity != self.identity
                         and started < self._seen_at + self.lease_seconds)
        if held_by_other:
            self._leading_until = 0.0
            return
        update: dict[str, Any] = {
            "holderIdentity": self.identity,
            "renewTime": _micro_time(now),
            "leaseDurationSeconds": math.ceil(self.lease_seconds),
        }
        if spec.holder_identity != self.identity:
            update["acquireTime"] = _micro_time(now)
            update["leaseTransitions"] = (spec.lease_transitions or 0) + 1
        if self._write(_version(lease), update):
            self._elected(started)

    def _write(self, resource_version: str | None, spec: dict[str, Any]) -> bool:
        """Patch the Lease's spec unless someone wrote it since `resource_version` was read."""
        # A resourceVersion in a patch is a precondition: the API server answers 409 Conflict
        # when the Lease changed since, so of two candidates only one can win.
        body = {"metadata": {"resourceVersion": resource_version}, "spec": spec}
        try:
            self.leases.patch_namespaced_lease(LEASE_NAME, self.namespace, body)
        except ApiException as error:
            if error.status != 409:
                raise
            return False
        return True

    def _create(self, now: datetime, started: float) -> None:
        lease = client.V1Lease(
            metadata=client.V1ObjectMeta(name=LEASE_NAME, namespace=self.namespace),
            spec=client.V1LeaseSpec(holder_identity=self.identity, acquire_time=now,
                                    renew_time=now, lease_transitions=0,
                                    lease_duration_seconds=math.ceil(self.lease_seconds)))
        try:
            self.leases.create_namespaced_lease(self.namespace, lease)
        except ApiException as error:
            if error.status != 409:  # another replica created it first
                raise
            return
        self._elected(started)

    def _elected(self, started: float) -> None:
        newly = not self.is_leader()
        self._leading_until = started + self.lease_seconds * RENEW_DEADLINE_FRACTION
        if newly:
            log.info("leader election: %s now leads (lease %s/%s)", self.identity,
                     self.namespace, LEASE_NAME)
            self.on_elected()

    def _release(self) -> None:
        """Hand the Lease back so a standby need not wait for it to expire."""
        if not self.is_leader():
            return
        self._leading_until = 0.0
        try:
            lease = self.leases.read_namespaced_lease(LEASE_NAME, self.namespace)
            if lease.spec is None or lease.spec.holder_identity != self.identity:
                return
            # Empty rather than absent: a patch leaves out what it does not change.
            self._write(_version(lease),
                        {"holderIdentity": "", "renewTime": _micro_time(datetime.now(UTC))})
        except ApiException as error:
            log.warning("leader election: could not hand the lease back: %s %s",
                        error.status, error.reason)


def _version(lease: client.V1Lease) -> str | None:
    return lease.metadata.resource_version if lease.metadata is not None else None


def _micro_time(moment: datetime) -> str:
    """Kubernetes MicroTime: RFC 3339 with microseconds, in UTC."""
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
