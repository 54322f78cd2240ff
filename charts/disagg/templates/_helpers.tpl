{{/* The chart's name, shortened to the 63-character limit. */}}
{{- define "disagg.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The full name: the release name, with the chart's name appended unless it already holds it. */}}
{{- define "disagg.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "disagg.operatorName" -}}
{{- printf "%s-operator" (include "disagg.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "disagg.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "disagg.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: disagg
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "disagg.operatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "disagg.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "disagg.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "disagg.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "disagg.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Whether the Prometheus Operator's API is served (ServiceMonitor, PodMonitor, PrometheusRule). */}}
{{- define "disagg.promOperator" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}true{{ end }}
{{- end }}

{{/* A PromQL matcher for one histogram bucket boundary, in either spelling (1 and 1.0). */}}
{{- define "disagg.le" -}}
le=~"{{ . }}|{{ . }}.0"
{{- end }}

{{/* The planner: its own Deployment and ServiceAccount, with only the planner's role. */}}
{{- define "disagg.plannerName" -}}
{{- printf "%s-planner" (include "disagg.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "disagg.plannerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "disagg.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: planner
{{- end }}

{{- define "disagg.plannerServiceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "disagg.plannerName" .) .Values.serviceAccount.plannerName }}
{{- else }}
{{- required "serviceAccount.plannerName is required when serviceAccount.create is false" .Values.serviceAccount.plannerName }}
{{- end }}
{{- end }}

{{/* The planner's allowlist file (planner/endpoints.py reads it): planner.prometheusEndpoints with each
caSecret as the file the pod mounts it at. */}}
{{- define "disagg.prometheusEndpointsFile" -}}
{{- $names := list }}
{{- range .Values.planner.prometheusEndpoints }}{{ $names = append $names .name }}{{ end }}
{{- if and .Values.planner.defaultPrometheus (not (has .Values.planner.defaultPrometheus $names)) }}
{{- fail (printf "planner.defaultPrometheus %q is not a name in planner.prometheusEndpoints" .Values.planner.defaultPrometheus) }}
{{- end }}
{{- if ne (len $names) (len (uniq $names)) }}
{{- fail "planner.prometheusEndpoints: names must be unique" }}
{{- end }}
default: {{ .Values.planner.defaultPrometheus | quote }}
endpoints:
{{- range .Values.planner.prometheusEndpoints }}
  - name: {{ .name | quote }}
    url: {{ .url | quote }}
    {{- if .caSecret }}
    caFile: /etc/disagg/prometheus-ca/{{ .name }}/ca.crt
    {{- end }}
    insecureSkipVerify: {{ .insecureSkipVerify | default false }}
{{- else }} []
{{- end }}
{{- end }}
