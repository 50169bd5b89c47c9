"""The kubetrain operator: TrainingJobs become elastic torchrun pod groups.

`reconcile` decides (pure), over a `reconcile_pass.ReconcilePass` whose steps live in
`observation`, `lifecycle`, `nodes` and `recovery`; `children` builds manifests (pure,
from `worker_env` and `own_code_container`); `facts` reads pods and metrics into what a
pass decides on (pure); `handlers` wires them to kopf and the Kubernetes API, with
`pass_scheduler` (when passes run), `applier` (the writes) and `lifeline_watch` (each
trainer's lifeline); `trainer_status_*` serve own code's progress reports; `metrics` is the
operator's own Prometheus registry and `command` is the `kubetrain operator` CLI.
Importing this package loads neither kopf nor the client.
"""
