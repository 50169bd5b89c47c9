"""kmock's Kubernetes emulator, served over HTTP, with what an API server does beyond it.

`EmulatedCluster` serves kmock's `KubernetesEmulator` on a random loopback port, in a
thread of the test process, and writes a kubeconfig for it; clients in other processes
(the operator, the node agent's pods) reach it over HTTP like any API server.

What it does as kube-apiserver does: uid, creationTimestamp, resourceVersion and
generation on objects; optimistic concurrency (a stale resourceVersion is refused with
409 Conflict, a failed JSON-patch test with 422); the status and scale subresources of
TrainingJobs and the status subresources of Pods and Nodes; graceful deletion of pods
bound to a node (deletionTimestamp and deletionGracePeriodSeconds are set and the pod
stays until its kubelet deletes it with grace 0, uid precondition honoured), immediate
deletion of the others; the placement APIs a test asks for (Kubernetes' Workload API,
Volcano's and scheduler-plugins' PodGroups, Kueue's Workload and ResourceFlavor, pinned in
tests/cluster/scheduling_apis.py), listed in discovery, with their status subresources
and their objects checked against those pinned schemas; list and watch, with
equality-based label selectors; a pod's log (`GET pods/{name}/log`, with follow,
sinceSeconds, sinceTime, tailLines, limitBytes and timestamps), proxied to the kubelet
that runs the pod as the API server proxies it: here, the node agent registered in
`kubelets` (tests/cluster/pod_logs.py).

Stand-in, not shown by any test here: the garbage collector. `_collect_garbage` deletes
an object whose ownerReference points at an object that is gone, as
kube-controller-manager's garbage collector does in background propagation, though at
once, without a pod's grace period; it is what deletes a deleted job's children. It runs
inside the emulator after each delete.

What it does not: no Namespace objects (kmock misreads `POST /api/v1/namespaces`, and
objects need no namespace to exist first), no authentication or RBAC (every request is
allowed), no admission, no OpenAPI schema validation (but of the placement kinds) or CEL
rules (the operator's own validation is what refuses a bad spec here), no field
selectors and no set-based label selectors, no server-side apply, no Table printing (so
kubectl's `get` shows no printer columns), no OpenAPI documents (kubectl needs
--validate=false). Tests that need any of these are in tests/real_server and run against
a real kube-apiserver.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import types
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp.web
import jsonschema
import kmock
import yaml
from kubernetes import client
from kubernetes import config as kube_config
from pod_logs import ContainerLog, LogQuery, LogQueryError, render, select
from scheduling_apis import PlacementApi

from kubetrain.operator.handlers import USER_AGENT

JOBS = "kubetrain.io/v1alpha1/trainingjobs"
PODS = "v1/pods"
# The grace period of a pod deleted without one, as the API server's default.
DEFAULT_GRACE_SECONDS = 30
# How often a followed log is read again for new lines.
LOG_FOLLOW_SECONDS = 0.1
# A kubelet as the API server reaches it for a pod's log: (namespace, name, uid) → the
# log of that pod's container, or None when it does not run that pod (or not yet).
Kubelet = Callable[[str, str, str], ContainerLog | None]

# `Emulator` replaces two of kmock's private lookups, found by their name-mangled names
# (`_KubernetesEmulator__get_objs`, `__check`). Python calls a replacement only while kmock's
# own methods still call that name: were one renamed in a kmock release, kmock would use its
# own lookup again, silently (right, but quadratic: hours for the 500-job benchmark). So
# each emulator checks at start-up that these calls are still in kmock's code: (caller,
# callee), both by their names in kmock's source.
KMOCK_LOOKUP_CALLS = (
    ("_serve_list", "__get_objs"), ("_serve_watch", "__get_objs"), ("_serve_watch", "__check"),
    ("__get_obj", "__get_objs"), ("_serve_fetch", "__get_obj"), ("_serve_create", "__get_obj"),
    ("_serve_update", "__get_obj"), ("_serve_delete", "__get_obj"),
)


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the API-server behaviour the operator depends on."""

    _versions = itertools.count(1)

    def __init__(self) -> None:
        missing = unreached_lookups(kmock.KubernetesEmulator)
        if missing:
            raise RuntimeError(
                f"kmock {kmock.__version__} changed the private lookups that "
                f"tests/cluster/emulator.py replaces: {'; '.join(missing)}. Replace the "
                "lookups kmock calls now, or bound kmock in pyproject.toml.")
        super().__init__()
        self._same_resource: dict[tuple[Any, Any], bool] = {}
        self.served: list[kmock.Request] = []  # routed requests, oldest first
        self.kubelets: list[Kubelet] = []  # asked in turn for a pod's log
        # The placement kinds served (tests/cluster/scheduling_apis.py), by resource key.
        self.placement: dict[str, PlacementApi] = {}

    def requests(self) -> list[kmock.Request]:
        """Every request so far: the routed ones, then those not routed yet."""
        return [*self.served, *self._requests]

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource == PODS and request.subresource == "log" and request.name \
                and request.method == kmock.method.GET:
            self._retire(request)
            return await self._serve_log(request)
        if request.action == kmock.action.DELETE and request.resource == PODS and request.name:
            marked = await self._delete_pod_gracefully(request)
            if marked is not None:
                self._retire(request)
                return aiohttp.web.json_response(marked)
        if isinstance(request.data, dict) and request.resource is not None:
            self._server_side_fields(request)
            self._validate_placement(request)
        elif isinstance(request.data, list) and request.action == kmock.action.UPDATE:
            self._json_patch_concurrency(request)
        try:
            response = await super()._handle(request)
        finally:
            self._retire(request)
        if request.action in (kmock.action.DELETE, kmock.action.UPDATE) and request.name:
            stored = self._stored(request)
            if stored is None or stored.deleted:
                await self._collect_garbage()
        return response

    async def _delete_pod_gracefully(self, request: kmock.Request) -> dict[str, Any] | None:
        """A pod's DELETE as the API server treats it; the marked pod if it stays.

        A pod bound to a node and not finished is only marked (deletionTimestamp = now +
        grace, deletionGracePeriodSeconds = grace): its kubelet stops the containers and
        deletes it with grace 0. A DELETE whose uid precondition names another
        incarnation of the pod is refused with 409. Returns None where the pod goes at
        once (kmock's own DELETE), else the pod as it stays, the DELETE's answer.
        """
        options = request.data if isinstance(request.data, dict) else {}
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            stored = self._objects[key] if key in self._objects else None  # noqa: SIM401
            if stored is None or stored.deleted:
                return None
            meta = stored.get("metadata", {})
            wanted_uid = (options.get("preconditions") or {}).get("uid")
            if wanted_uid and wanted_uid != meta.get("uid"):
                raise kmock.KubernetesError(status=409, reason="Conflict", message=(
                    f"Precondition failed: UID in precondition: {wanted_uid}, "
                    f"UID in object meta: {meta.get('uid')}"))
            grace = options.get("gracePeriodSeconds", request.params.get("gracePeriodSeconds"))
            if grace is None:
                grace = stored.get("spec", {}).get("terminationGracePeriodSeconds",
                                                   DEFAULT_GRACE_SECONDS)
            grace = int(grace)
            bound = bool(stored.get("spec", {}).get("nodeName"))
            finished = stored.get("status", {}).get("phase") in ("Succeeded", "Failed")
            if grace <= 0 or not bound or finished:
                return None
            if not meta.get("deletionTimestamp"):
                # A second DELETE may shorten the grace period, never lengthen it.
                deadline = datetime.now(UTC) + timedelta(seconds=grace)
                stored.patch({"metadata": {
                    "deletionTimestamp": deadline.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "deletionGracePeriodSeconds": grace,
                    "resourceVersion": str(next(self._versions))}})
                await self._buses[request.resource].put({"type": "MODIFIED",
                                                         "object": stored.raw})
            return dict(stored.raw)

    async def _serve_log(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """`GET pods/{name}/log`: the pod's container log from its kubelet, as text.

        Refused as the API server refuses: 404 for no such pod, 400 for another container's
        name, a previous container (restartPolicy Never has none), bad options, or a
        container not started yet. With follow, the answer stays open and carries each new
        line until the container has ended or this incarnation of the pod is gone.
        """
        stored = self._stored(request)
        if stored is None or stored.deleted:
            raise kmock.KubernetesError(status=404, reason="NotFound",
                                        message=f'pods "{request.name}" not found')
        pod = stored.raw
        uid = pod.get("metadata", {}).get("uid", "")
        containers = [c["name"] for c in pod.get("spec", {}).get("containers", [])]
        container = request.params.get("container") or (containers[:1] or [""])[0]
        if container not in containers:
            raise kmock.KubernetesError(status=400, reason="BadRequest", message=(
                f"container {container} is not valid for pod {request.name}"))
        if request.params.get("previous", "false").lower() in ("true", "1"):
            raise kmock.KubernetesError(status=400, reason="BadRequest", message=(
                f'previous terminated container "{container}" in pod "{request.name}" '
                "not found"))
        try:
            query = LogQuery.parse(request.params)
        except LogQueryError as error:
            raise kmock.KubernetesError(status=400, reason="BadRequest",
                                        message=str(error)) from None
        log = await asyncio.get_running_loop().run_in_executor(
            None, self._kubelet_log, request.namespace or "", request.name or "", uid)
        if log is None:
            raise kmock.KubernetesError(status=400, reason="BadRequest", message=(
                f'container "{container}" in pod "{request.name}" is waiting to start: '
                "ContainerCreating"))
        lines = log.lines()
        chosen = select(lines, query)
        if not query.follow:
            body = b"".join(render(line, query) for line in chosen)
            if query.limit_bytes is not None:
                body = body[:query.limit_bytes]
            return aiohttp.web.Response(body=body, content_type="text/plain")
        assert request._raw_request is not None  # served over HTTP
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request._raw_request)
        sent, seen = 0, len(lines)
        for line in chosen:
            sent += await self._send_line(response, render(line, query), query, sent)
        while query.limit_bytes is None or sent < query.limit_bytes:
            ended = log.finished or self._gone(request, uid)
            lines = log.lines()
            for line in lines[seen:]:
                sent += await self._send_line(response, render(line, query), query, sent)
            seen = len(lines)
            if ended:
                break
            await asyncio.sleep(LOG_FOLLOW_SECONDS)
        await response.write_eof()
        return response

    def _kubelet_log(self, namespace: str, name: str, uid: str) -> ContainerLog | None:
        """The pod's log from the first kubelet that has it: asked off the event loop, as
        the API server asks a kubelet over the network, so a kubelet that is busy calling
        this API never holds up the answer to its own call."""
        return next((found for kubelet in self.kubelets
                     if (found := kubelet(namespace, name, uid))), None)

    @staticmethod
    async def _send_line(response: aiohttp.web.StreamResponse, data: bytes, query: LogQuery,
                         sent: int) -> int:
        if query.limit_bytes is not None:
            data = data[:max(0, query.limit_bytes - sent)]
        if data:
            await response.write(data)
        return len(data)

    def _gone(self, request: kmock.Request, uid: str) -> bool:
        """Whether the pod of `uid` is no longer in the API (its name may be reused)."""
        stored = self._stored(request)
        return (stored is None or stored.deleted
                or stored.raw.get("metadata", {}).get("uid") != uid)

    def _retire(self, request: kmock.Request) -> None:
        """Move a routed request out of kmock's history into `served` (once).

        kmock routes each request by filtering its whole history of requests, which makes
        every request slower than the one before; only requests not yet routed need to be
        there, so each one leaves as soon as it reaches the handler that serves it.
        """
        for position in range(len(self._requests) - 1, -1, -1):
            if self._requests[position] is request:
                del self._requests[position]
                self.served.append(request)
                return

    async def _serve_list(self, request: kmock.Request) -> Any:
        self._retire(request)
        selector = label_selector(request.params.get("labelSelector", ""))
        listed = await super()._serve_list(request)
        listed["items"] = [item for item in listed["items"] if selector(item)]
        return listed

    async def _serve_watch(self, request: kmock.Request) -> Any:
        self._retire(request)
        selector = label_selector(request.params.get("labelSelector", ""))
        async for event in super()._serve_watch(request):
            if not isinstance(event, dict) or selector(event.get("object") or {}):
                yield event

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        self._retire(request)
        return await super()._serve_fetch(request)

    async def _serve_create(self, request: kmock.Request) -> Any:
        self._retire(request)
        return await super()._serve_create(request)

    async def _serve_update(self, request: kmock.Request) -> Any:
        self._retire(request)
        return await super()._serve_update(request)

    async def _serve_delete(self, request: kmock.Request) -> Any:
        self._retire(request)
        return await super()._serve_delete(request)

    # kmock finds an object by scanning all of them and comparing resources with regular
    # expressions: quadratic in the object count, hours for the 500-job benchmark. These two
    # overrides of its private lookups keep its semantics: a dict lookup for one object,
    # and resource comparisons remembered. `__init__` checks that kmock still calls them
    # (KMOCK_LOOKUP_CALLS).
    def _KubernetesEmulator__get_objs(self, request: kmock.Request,
                                      strict: bool) -> list[Any]:
        if strict and request.name is not None:
            key = (request.resource, request.namespace, request.name)
            return [self._objects[key]] if key in self._objects else []
        return [obj for (resource, namespace, name), obj in self._objects.items()
                if self._KubernetesEmulator__check(request, resource, namespace, name, strict)]

    def _KubernetesEmulator__check(self, request: kmock.Request, resource: Any,
                                   namespace: str | None, name: str, strict: bool) -> bool:
        namespace_ok = (namespace == request.namespace if strict else
                        request.namespace is None or namespace == request.namespace)
        if not namespace_ok or (request.name is not None and name != request.name):
            return False
        same = self._same_resource.get((resource, request.resource))
        if same is None:
            same = self._same_resource[resource, request.resource] = bool(
                resource == request.resource)
        return same

    def _json_patch_concurrency(self, request: kmock.Request) -> None:
        """A JSON patch's resourceVersion test fails with 422, as the API server answers."""
        stored = self._stored(request)
        current = stored.get("metadata", {}).get("resourceVersion") if stored else None
        for op in request.data:
            if op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion" \
                    and op.get("value") != current:
                raise kmock.KubernetesError(status=422, reason="Invalid",
                                            message="the object has been modified")
        request.data.append({"op": "replace", "path": "/metadata/resourceVersion",
                             "value": str(next(self._versions))})

    def _stored(self, request: kmock.Request) -> Any:
        key = (request.resource, request.namespace, request.name)
        return self.objects[key] if key in self.objects else None  # noqa: SIM401 (no .get)

    def _server_side_fields(self, request: kmock.Request) -> None:
        data = request.data
        meta = data.setdefault("metadata", {})
        if request.action == kmock.action.UPDATE and meta.get("resourceVersion"):
            stored = self._stored(request)
            current = stored.get("metadata", {}).get("resourceVersion") if stored else None
            if meta["resourceVersion"] != current:
                raise kmock.KubernetesError(status=409, reason="Conflict",
                                            message="the object has been modified")
        meta["resourceVersion"] = str(next(self._versions))
        if request.action == kmock.action.CREATE:
            if request.namespace:  # as the API server: the URL's namespace is the object's
                meta["namespace"] = request.namespace
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp",
                            datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            meta.setdefault("generation", 1)
            if request.resource == JOBS:
                data.pop("status", None)
            elif request.resource == PODS:
                # The API server's pod strategy: a new pod's status is Pending, whatever was sent.
                data["status"] = {"phase": "Pending"}
            return
        if request.action != kmock.action.UPDATE or request.resource != JOBS:
            return
        stored = self._stored(request)
        if request.subresource == "scale":
            # The CRD's scale subresource maps Scale.spec.replicas to .spec.workers.replicas.
            replicas = data.get("spec", {}).get("replicas")
            data.clear()
            data.update({"metadata": meta, "spec": {"workers": {"replicas": replicas}}})
        elif request.subresource == "status":
            for key in list(data):
                if key not in ("status", "metadata"):
                    del data[key]
            return
        else:
            data.pop("status", None)  # the main resource ignores status, as with a real CRD
        # metadata.generation counts changes of the spec: a re-apply of the same spec is none.
        old_spec = stored.raw.get("spec", {}) if stored is not None else {}
        if "spec" in data and stored is not None and _merged(old_spec, data["spec"]) != old_spec:
            meta["generation"] = int(stored.get("metadata", {}).get("generation", 1)) + 1

    def _validate_placement(self, request: kmock.Request) -> None:
        """A placement object (a PodGroup, a Workload) as its API server takes it: status
        only through the status subresource and only status there, and the object after a
        create, a replace or a merge patch valid for its pinned schema, else 422 naming the
        field, as the API server's schema validation answers."""
        api = next((api for key, api in self.placement.items() if request.resource == key),
                   None)
        if api is None or request.action not in (kmock.action.CREATE, kmock.action.UPDATE):
            return
        data = request.data
        if request.subresource == "status":
            for key in list(data):
                if key not in ("status", "metadata"):
                    del data[key]
        elif api.status and request.action == kmock.action.UPDATE:
            data.pop("status", None)
        stored = self._stored(request)
        after = data if request.action == kmock.action.CREATE or stored is None or \
            request.method == kmock.method.PUT else _merged(stored.raw, data)
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft4Validator(api.schema).iter_errors(after))
        if error is not None:
            where = ".".join(str(part) for part in error.absolute_path) or "(root)"
            raise kmock.KubernetesError(status=422, reason="Invalid", message=(
                f"{api.kind}.{api.group} {(after.get('metadata') or {}).get('name')!r} is "
                f"invalid: {where}: {error.message}"))

    async def _collect_garbage(self) -> None:
        """Delete objects whose owner is gone, as the garbage collector does (background)."""
        while True:
            async with self._lock:
                live = {obj.get("metadata", {}).get("uid") for obj in self._objects.values()
                        if not obj.deleted}
                orphans = [(key, obj) for key, obj in self._objects.items()
                           if not obj.deleted and any(
                               ref.get("uid") not in live
                               for ref in obj.get("metadata", {}).get("ownerReferences", []))]
                for (resource, _, _), obj in orphans:
                    raw = obj.raw
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})
            if not orphans:
                return


def unreached_lookups(base: type) -> list[str]:
    """Each call of `KMOCK_LOOKUP_CALLS` that `base`'s code no longer makes, in words.

    A method "calls" a private lookup when its code, or code nested in it, names the
    lookup's mangled attribute (`self.__check` compiles to `_KubernetesEmulator__check`).
    `Emulator` replaces `__get_objs` and `__check`; each must also still be defined by
    `base`, or the replacement has nothing to replace.
    """
    prefix = f"_{base.__name__}"
    missing = [f"{base.__name__} defines no {name}" for name in ("__get_objs", "__check")
               if not callable(getattr(base, prefix + name, None))]
    for caller, callee in KMOCK_LOOKUP_CALLS:
        method = getattr(base, prefix + caller if caller.startswith("__") else caller, None)
        code = getattr(method, "__code__", None)
        if code is None or prefix + callee not in set(_names(code)):
            missing.append(f"{base.__name__}.{caller} no longer calls {callee}")
    return missing


def _names(code: types.CodeType) -> Iterator[str]:
    """The attribute and global names that `code` and the code nested in it use."""
    yield from code.co_names
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _names(constant)


def label_selector(text: str) -> Callable[[dict[str, Any]], bool]:
    """A predicate on objects for a label selector of equality terms, as the API server reads it.

    Terms are comma-separated: `key=value`, `key==value`, `key!=value`, `key`, `!key`.
    Set-based terms (`in`, `notin`) are refused with 400, as nothing here uses them.
    """
    terms: list[tuple[str, str, str]] = []
    for term in filter(None, (part.strip() for part in text.split(","))):
        if " in " in term or " notin " in term or "(" in term:
            raise kmock.KubernetesError(status=400, reason="BadRequest", message=(
                f"the emulator reads equality-based label selectors only, not {term!r}"))
        if "!=" in term:
            key, value = term.split("!=", 1)
            terms.append((key.strip(), "!=", value.strip()))
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            terms.append((key.strip(), "=", value.strip()))
        elif term.startswith("!"):
            terms.append((term[1:].strip(), "absent", ""))
        else:
            terms.append((term, "present", ""))

    def selected(obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        for key, op, value in terms:
            if ((op == "=" and labels.get(key) != value)
                    or (op == "!=" and labels.get(key) == value)
                    or (op == "present" and key not in labels)
                    or (op == "absent" and key in labels)):
                return False
        return True

    return selected


def _merged(target: Any, patch: Any) -> Any:
    """RFC 7386: `target` with the JSON merge patch `patch` applied (as kmock applies it)."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merged(result.get(key), value)
    return result


def _declare_placement(emulator: Emulator, apis: Iterable[PlacementApi]) -> None:
    """Serve the placement kinds `apis` (discovery lists them; their objects are checked)."""
    verbs = {"get", "list", "watch", "create", "update", "patch", "delete"}
    for api in apis:
        emulator.resources[api.resource] = kmock.ResourceInfo(
            kind=api.kind, singular=api.kind.lower(), namespaced=api.namespaced, verbs=verbs,
            subresources={"status"} if api.status else set())
        emulator.placement[api.resource] = api


def _declare_resources(emulator: Emulator) -> None:
    info = kmock.ResourceInfo
    verbs = {"get", "list", "watch", "create", "update", "patch", "delete"}
    emulator.resources[JOBS] = info(kind="TrainingJob", singular="trainingjob",
                                    namespaced=True, verbs=verbs, shortnames={"tj"},
                                    subresources={"status", "scale"})
    for plural, kind, namespaced in [("pods", "Pod", True), ("services", "Service", True),
                                     ("configmaps", "ConfigMap", True),
                                     ("secrets", "Secret", True),
                                     ("events", "Event", True), ("nodes", "Node", False),
                                     ("namespaces", "Namespace", False)]:
        emulator.resources[f"v1/{plural}"] = info(kind=kind, singular=kind.lower(),
                                                  namespaced=namespaced, verbs=verbs,
                                                  subresources={"status"}
                                                  if kind in ("Pod", "Node") else set())
    emulator.resources["coordination.k8s.io/v1/leases"] = info(
        kind="Lease", singular="lease", namespaced=True, verbs=verbs)
    # The operator's status Service routes to the acting replica through one of these.
    emulator.resources["discovery.k8s.io/v1/endpointslices"] = info(
        kind="EndpointSlice", singular="endpointslice", namespaced=True, verbs=verbs)


class EmulatedCluster:
    """The emulator on a loopback port, in its own thread and event loop.

    `placement` names the placement APIs it serves besides the core ones
    (tests/cluster/scheduling_apis.py): none by default, as a cluster without Volcano,
    scheduler-plugins, Kueue or the Workload API's feature gates.
    """

    def __init__(self, directory: Path, placement: Iterable[PlacementApi] = ()) -> None:
        self.kubeconfig = directory / "kubeconfig"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.emulator = Emulator()
        _declare_resources(self.emulator)
        _declare_placement(self.emulator, placement)
        self.server = kmock.Server(self.emulator)
        self._more_servers: list[kmock.Server] = []

    def __enter__(self) -> EmulatedCluster:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)
        write_kubeconfig(self.kubeconfig, f"http://127.0.0.1:{self.server.port}")
        return self

    def serve_on(self, address: str) -> str:
        """Serve the same API on `address` too (e.g. a pod network's gateway); its URL."""
        server = kmock.Server(self.emulator, host=address)
        asyncio.run_coroutine_threadsafe(server.__aenter__(), self.loop).result(timeout=30)
        self._more_servers.append(server)
        return f"http://{address}:{server.port}"

    async def _start(self) -> None:
        await self.emulator.__aenter__()
        await self.server.__aenter__()

    async def _stop(self) -> None:
        for server in [*self._more_servers, self.server]:
            await server.__aexit__(None, None, None)
        await self.emulator.__aexit__(None, None, None)

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def api_client(self) -> client.ApiClient:
        configuration = client.Configuration()
        kube_config.load_kube_config(str(self.kubeconfig), client_configuration=configuration)
        return client.ApiClient(configuration)

    def operator_calls(self) -> set[tuple[str, str]]:
        """(verb, resource) of every request the operator (kopf or its client) made: the
        resource as an RBAC rule names it, prefixed with its API group outside the core
        group (`pods`, `kubetrain.io/trainingjobs/status`, `scheduling.volcano.sh/podgroups`),
        since kinds of several groups share plurals."""
        calls = set()
        for request in self.emulator.requests():
            agent = request.headers.get("User-Agent", "")
            if request.resource is None or not request.resource.plural:
                continue  # discovery: allowed to every authenticated user
            if not agent.startswith(("kopf", USER_AGENT)):
                continue
            resource = request.resource.plural or ""
            if request.subresource:
                resource += "/" + request.subresource
            if request.resource.group:
                resource = f"{request.resource.group}/{resource}"
            calls.add((_rbac_verb(request), resource))
        return calls

    def operator_requests(self, resource: str, action: kmock.action, identity: str = "") -> int:
        """How many `action` requests on `resource` the operator (of `identity`, if given) made."""
        agent = f"{USER_AGENT}/{identity}"
        return sum(1 for request in self.emulator.requests()
                   if request.resource is not None and request.resource.plural == resource
                   and request.action == action
                   and request.headers.get("User-Agent", "").startswith(agent))


def write_kubeconfig(path: Path, url: str) -> Path:
    """A kubeconfig for the emulator at `url` (any token is accepted)."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "tests", "user": {"token": "emulator"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tests"}}],
    }))
    return path


def _rbac_verb(request: kmock.Request) -> str:
    if request.action == kmock.action.WATCH:
        return "watch"
    if request.action == kmock.action.LIST:
        return "list"
    if request.action == kmock.action.FETCH:
        return "get"
    if request.action == kmock.action.CREATE:
        return "create"
    if request.action == kmock.action.DELETE:
        return "delete"
    return "update" if request.method == kmock.method.PUT else "patch"


