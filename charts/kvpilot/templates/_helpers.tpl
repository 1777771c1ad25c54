{{- define "kvpilot.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvpilot.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The selector labels as a label selector string (k=v,...), for API calls. */}}
{{- define "kvpilot.selector" -}}
{{- $pairs := list -}}
{{- range $key, $value := include "kvpilot.selectorLabels" . | fromYaml -}}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{- define "kvpilot.serviceAccountName" -}}
{{- default (include "kvpilot.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "kvpilot.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* What the operator may do with InferenceServices and their children, in one namespace or all. */}}
{{- define "kvpilot.operatorRules" -}}
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch, update]
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices/status]
  verbs: [get, patch, update]
# Owner references with blockOwnerDeletion need update on the owner's finalizers subresource.
- apiGroups: [kvpilot.dev]
  resources: [inferenceservices/finalizers]
  verbs: [update]
# Deployments, Services, PodDisruptionBudgets and pods are watched (list, watch; label-selected to the
# operator's own) so that a change is reconciled at once; the rest waits for the slow resync.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, patch]
# The per-InferenceService router token (<name>-router-token): read and created by name, its labels and
# owner reference patched; never listed or watched, so the operator cannot enumerate Secrets.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, create, patch]
# Granting the router's EndpointSlice watch requires holding it (RBAC escalation prevention).
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}

{{/* What values.schema.json cannot say, since JSON Schema does not compare two fields. */}}
{{- define "kvpilot.validateValues" -}}
{{- $lease := .Values.leaderElection -}}
{{- if not (and (lt (float64 $lease.retryPeriodSeconds) (float64 $lease.renewDeadlineSeconds)) (lt (float64 $lease.renewDeadlineSeconds) (float64 $lease.leaseDurationSeconds))) -}}
{{- fail (printf "leaderElection: needs retryPeriodSeconds < renewDeadlineSeconds < leaseDurationSeconds, got %v, %v and %v (a leader must retry before its renew deadline, and give up before its Lease can pass to another)" $lease.retryPeriodSeconds $lease.renewDeadlineSeconds $lease.leaseDurationSeconds) -}}
{{- end -}}
{{- if and .Values.metrics.enabled (eq (int .Values.metrics.port) (int .Values.operator.healthPort)) -}}
{{- fail (printf "metrics.port %v is operator.healthPort, the liveness endpoint's: the operator cannot listen on both; pick another port for one of them" .Values.metrics.port) -}}
{{- end -}}
{{- end -}}
