{{/*
Names, labels and shared fragments of the kubetrain chart.
*/}}

{{/* The release's full name: the release name, prefixed with the chart name unless it holds it. */}}
{{- define "kubetrain.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels every object of the release carries. */}}
{{- define "kubetrain.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kubetrain
{{- end -}}

{{/* The labels that select the operator's pods. */}}
{{- define "kubetrain.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kubetrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kubetrain.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* An image reference: repository@digest when a digest is set, else repository:tag (tag defaults to appVersion). */}}
{{- define "kubetrain.image" -}}
{{- $image := index . 0 -}}
{{- $chart := index . 1 -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default $chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The namespaces the operator watches, as a list; empty in cluster mode. */}}
{{- define "kubetrain.watchedNamespaces" -}}
{{- if eq .Values.rbac.mode "namespaced" -}}
{{- toYaml .Values.rbac.namespaces -}}
{{- else -}}
[]
{{- end -}}
{{- end -}}

{{/* The namespaces where TrainingJob worker pods run and get the workers' NetworkPolicy. */}}
{{- define "kubetrain.workerNamespaces" -}}
{{- if eq .Values.rbac.mode "namespaced" -}}
{{- toYaml .Values.rbac.namespaces -}}
{{- else if .Values.networkPolicy.workerNamespaces -}}
{{- toYaml .Values.networkPolicy.workerNamespaces -}}
{{- else -}}
{{- list .Release.Namespace | toYaml -}}
{{- end -}}
{{- end -}}

{{/*
The operator's permissions: exactly the (verb, resource) calls its integration
tests record (tests/operator/harness.py); tests/chart/test_rbac.py checks that
these grant each of them and nothing more.

kubetrain.operatorNamespacedRules: on resources in the watched namespaces (a Role
per namespace in namespaced mode, part of the ClusterRole in cluster mode). The
operator writes only the status of a TrainingJob; it deletes a finished one after
ttlSecondsAfterFinished. It patches the ConfigMap when the job's spec changes.
*/}}
{{- define "kubetrain.operatorNamespacedRules" -}}
- apiGroups: ["kubetrain.io"]
  resources: ["trainingjobs"]
  verbs: ["list", "watch", "delete"]
- apiGroups: ["kubetrain.io"]
  resources: ["trainingjobs/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["list", "watch", "create"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
{{- include "kubetrain.placementRules" . }}
{{- include "kubetrain.statusEndpointRules" . }}
{{- end -}}

{{/*
kubetrain.placementRules: the objects that place a job's workers (docs/scheduling.md), each
owned by its job: the Workload API's Workload and PodGroup (immutable: created and deleted,
never patched), Volcano's and scheduler-plugins' PodGroups (patched when the group's size
changes), and Kueue's Workload (its status patched when the job finishes, or to give back
the quota of an evicted job). Rules on API groups a cluster does not serve grant nothing
there; the operator uses only what discovery finds.
*/}}
{{- define "kubetrain.placementRules" }}
- apiGroups: ["scheduling.k8s.io"]
  resources: ["workloads", "podgroups"]
  verbs: ["list", "watch", "create", "delete"]
- apiGroups: ["scheduling.volcano.sh", "scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list", "watch", "create", "delete"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
{{- end -}}

{{/*
kubetrain.statusEndpointRules: the status endpoint's CA and key live in the Secret
`kubetrain-status-endpoint` (ENDPOINT_SECRET in operator/kubetrain/operator/status_reporting.py)
of the status namespace (kubetrain.statusNamespace), read at start and created on the
first (`create secrets` above); the acting replica creates the selector-less status Service
there and points its EndpointSlice at its own pod. Objects not created yet have no name to
restrict `create` to.
*/}}
{{- define "kubetrain.statusEndpointRules" }}
- apiGroups: [""]
  resources: ["secrets"]
  resourceNames: ["kubetrain-status-endpoint"]
  verbs: ["get"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["create"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  resourceNames: [{{ printf "%s-status" (include "kubetrain.fullname" .) | quote }}]
  verbs: ["patch"]
{{- end -}}

{{/* Where the status endpoint keeps its key Secret and Service: the release namespace, or in
namespaced mode the first watched one (the operator may write only there). */}}
{{- define "kubetrain.statusNamespace" -}}
{{- if eq .Values.rbac.mode "namespaced" -}}
{{- first .Values.rbac.namespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/*
kubetrain.operatorClusterRules: on cluster-scoped resources, in both modes. Nodes
are watched to notice pods on lost nodes; Kueue's ResourceFlavors to give an admitted
job's pods their flavor's node labels and tolerations.
*/}}
{{- define "kubetrain.operatorClusterRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["resourceflavors"]
  verbs: ["list", "watch"]
{{- end -}}

{{/*
kubetrain.leaderElectionRules: with several replicas, on the Lease they elect a
leader with: `kubetrain-operator` (LEASE_NAME in operator/kubetrain/operator/leader.py)
in the release namespace (--lease-namespace). A Lease not created yet has no name
to restrict `create` to; reads and renewals are restricted to that one Lease.
*/}}
{{- define "kubetrain.leaderElectionRules" -}}
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["create"]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  resourceNames: ["kubetrain-operator"]
  verbs: ["get", "patch"]
{{- end -}}

{{/* True (non-empty) when the operator runs several replicas and so elects a leader. */}}
{{- define "kubetrain.leaderElection" -}}
{{- if gt (int .Values.replicas) 1 -}}true{{- end -}}
{{- end -}}
