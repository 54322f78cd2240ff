{{/* The rules of operator/rbac.yaml, one template per role (tests/test_chart.py keeps them equal). */}}

{{/* disagg-operator-cluster: what cannot be namespaced. */}}
{{- define "disagg.operatorClusterRules" -}}
# Free GPUs per node for the capacity messages of a waiting gang: every node. The pods bound to them are
# listed in the namespaces it serves (disagg-operator below); the chart's operator.capacity.countAllNamespaces
# adds pods here, for an operator with watchNamespaces to count every tenant's (fleet.py).
- apiGroups: [""]
  resources: [nodes]
  verbs: [list]
{{- if and .Values.operator.watchNamespaces .Values.operator.capacity.countAllNamespaces }}
# operator.capacity.countAllNamespaces: every namespace's bound pods (every tenant's pod specs, readable)
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
{{- end }}
{{- end }}

{{/* disagg-operator: what the operator does in the namespaces it serves. */}}
{{- define "disagg.operatorRules" -}}
# The API it owns (patch: kopf's finalizer and its handler progress annotations).
- apiGroups: [serving.disagg.dev]
  resources: [disaggdeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.disagg.dev]
  resources: [disaggdeployments/status]
  verbs: [patch]
# Children it creates and owns, by server-side apply: a patch, which also needs create while the
# object does not exist yet.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services, serviceaccounts]
  verbs: [get, create, patch]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, create, patch]
# The workers' NetworkPolicy: watched to revert hand edits at once, deleted when the chart's
# networkPolicy.enabled is turned off.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
# The InferencePool of a deployment in picker mode (spec.router.mode): server-side apply, deleted when it
# goes back to proxy mode. An optional API: where its CRD is missing the deployment says so in a condition.
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch, delete]
# What the router Role grants must be held by whoever creates it (RBAC's escalation check).
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list]
# Gang objects: the Workload/PodGroup API (default backend).
- apiGroups: [scheduling.k8s.io]
  resources: [workloads, podgroups, compositepodgroups]
  verbs: [get, list, create, patch, delete]
{{- if .Values.gangBackends.coscheduling }}
# Gang backend: scheduler-plugins' coscheduling (gangBackends.coscheduling).
- apiGroups: [scheduling.x-k8s.io]
  resources: [podgroups]
  verbs: [get, list, create, patch, delete]
{{- end }}
{{- if .Values.gangBackends.volcano }}
# Gang backend: Volcano (gangBackends.volcano).
- apiGroups: [scheduling.volcano.sh]
  resources: [podgroups]
  verbs: [get, list, create, patch, delete]
{{- end }}
# Its children's pods: placement and faults in status (watch), which gang they belong to (list); the pods
# of replicas that span several pods it runs itself (create, delete: operator/groups.py), which the
# chart's operator-writes admission policy holds to what it renders; a flex pod's serving-role label and
# the operator's record of it (patch: operator/flex.py), which that policy allows and nothing else.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, delete, patch]
# Events for every decision.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}

{{/* disagg-planner: the planner's own ServiceAccount. */}}
{{- define "disagg.plannerRules" -}}
# The deployments to size (list), their replica counts (server-side apply under its own field manager).
- apiGroups: [serving.disagg.dev]
  resources: [disaggdeployments]
  verbs: [list, patch]
# status.planner, status.latency, PlannerActive and SLOMet.
- apiGroups: [serving.disagg.dev]
  resources: [disaggdeployments/status]
  verbs: [patch]
# spec.planner.profileRef: a measured performance profile.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get]
# An event when the size changes or the planner holds.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# A flex pool (spec.flex): its pods (list: each one's serving role and readiness), and a switch or a
# removal written on one (patch: its serving-role label, the time it took the role, its deletion cost),
# which the chart's planner-writes admission policy allows on flex pods' metadata and nothing else.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, patch]
{{- end }}
