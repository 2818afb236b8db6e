{{/* Chart name, cut to the 63 characters Kubernetes names allow. */}}
{{- define "clrbpf.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart unless the release already names the chart. */}}
{{- define "clrbpf.fullname" -}}
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

{{- define "clrbpf.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "clrbpf.selectorLabels" -}}
app.kubernetes.io/name: {{ include "clrbpf.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "clrbpf.labels" -}}
helm.sh/chart: {{ include "clrbpf.chart" . }}
{{ include "clrbpf.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "clrbpf.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "clrbpf.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "clrbpf.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The Kubernetes version manifests are written for. */}}
{{- define "clrbpf.kubeVersion" -}}
{{- default .Capabilities.KubeVersion.Version .Values.kubeVersionOverride }}
{{- end }}

{{/* Whether securityContext.appArmorProfile exists (Kubernetes 1.30+). */}}
{{- define "clrbpf.appArmorField" -}}
{{- if semverCompare ">=1.30-0" (include "clrbpf.kubeVersion" .) }}true{{ end }}
{{- end }}

{{/* The Secret holding the pull endpoint's bearer token. */}}
{{- define "clrbpf.pullTokenSecret" -}}
{{- default (printf "%s-pull-token" (include "clrbpf.fullname" .)) .Values.pull.existingSecret }}
{{- end }}
