"""The kubetrain operator: TrainingJobs become elastic torchrun pod groups.

`reconcile` decides (pure), `children` builds manifests (pure), `observed` reads
pods and metrics (pure), `handlers` wires them to kopf and the Kubernetes API,
`metrics` is the operator's own Prometheus registry and `command` is the
`kubetrain operator` CLI. Importing this package loads neither kopf nor the client.
"""
