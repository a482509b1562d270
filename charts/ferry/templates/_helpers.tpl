{{/* The CSI driver name: fixed, it is part of every PV the driver provisions. */}}
{{- define "ferry.driverName" -}}s3.csi.ferry.dev{{- end -}}

{{/* Chart name, overridable with nameOverride. */}}
{{- define "ferry.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Prefix of every object name: fullnameOverride, else "<release>-<name>" (just the release name
when it already contains the chart name). Truncated so that suffixes like "-controller-metrics"
still fit in 63 characters. */}}
{{- define "ferry.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "ferry.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object. */}}
{{- define "ferry.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "ferry.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ferry
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "controller"). */}}
{{- define "ferry.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ferry.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Names of the two ServiceAccounts. */}}
{{- define "ferry.controller.serviceAccountName" -}}
{{- if .Values.controller.serviceAccount.create -}}
{{- default (printf "%s-controller" (include "ferry.fullname" .)) .Values.controller.serviceAccount.name -}}
{{- else -}}
{{- required "controller.serviceAccount.name is required when controller.serviceAccount.create is false" .Values.controller.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "ferry.node.serviceAccountName" -}}
{{- if .Values.node.serviceAccount.create -}}
{{- default (printf "%s-node" (include "ferry.fullname" .)) .Values.node.serviceAccount.name -}}
{{- else -}}
{{- required "node.serviceAccount.name is required when node.serviceAccount.create is false" .Values.node.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Ferry image reference: repository@digest, else repository:tag (tag defaults to appVersion). */}}
{{- define "ferry.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* A sidecar image reference from its values block. */}}
{{- define "ferry.sidecarImage" -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}

{{/* The S3 defaults both binaries read from the environment. FERRY_FORCE_PATH_STYLE is a flag: it is
set only when true. FERRY_ALLOWED_ENDPOINTS is s3.allowedEndpoints (empty: aws, the binaries'
default) plus every endpoint the chart's own StorageClasses name (endpointUrl or an endpoint-url
mount option, as scheme://host[:port]); it is set only when that adds to the default. */}}
{{- define "ferry.s3Env" -}}
{{- $named := list }}
{{- range .Values.storageClasses }}
{{- with .endpointUrl }}
{{- $named = append $named (regexReplaceAll "^(https?://[^/]+).*$" . "${1}") }}
{{- end }}
{{- range .mountOptions }}
{{- if regexMatch "^(--)?endpoint-url[ =]" (toString .) }}
{{- $named = append $named (regexReplaceAll "^(--)?endpoint-url[ =]+(https?://[^/ ]+).*$" (toString .) "${2}") }}
{{- end }}
{{- end }}
{{- end }}
{{- if or .Values.s3.allowedEndpoints $named }}
- name: FERRY_ALLOWED_ENDPOINTS
  value: {{ concat (.Values.s3.allowedEndpoints | default (list "aws")) $named | uniq | join "," | quote }}
{{- end }}
{{- with .Values.s3.endpointUrl }}
- name: FERRY_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with .Values.s3.region }}
- name: FERRY_REGION
  value: {{ . | quote }}
{{- end }}
{{- if .Values.s3.forcePathStyle }}
- name: FERRY_FORCE_PATH_STYLE
  value: "true"
{{- end }}
{{- end -}}

{{/* --metrics-addr of both binaries: the context is (dict "ctx" $ "port" <port>). */}}
{{- define "ferry.metricsAddr" -}}
{{- if .ctx.Values.metrics.enabled -}}
{{- printf "0.0.0.0:%d" (int .port) -}}
{{- else -}}
off
{{- end -}}
{{- end -}}

{{/* The controller's /metrics port: controller.metricsPort, else metrics.port. */}}
{{- define "ferry.controllerMetricsPort" -}}
{{- .Values.controller.metricsPort | default .Values.metrics.port | int -}}
{{- end -}}

{{/* KUBERNETES_SERVICE_HOST/PORT of every container that talks to the API server, when
kubernetesApi.host is set (a cluster whose pods reach the API server elsewhere than through the
kubernetes Service, e.g. only on the node's loopback). */}}
{{- define "ferry.kubeApiEnv" -}}
{{- with .Values.kubernetesApi.host }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ . | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ $.Values.kubernetesApi.port | default "443" | quote }}
{{- end }}
{{- end -}}

{{/* hostNetwork and its DNS policy for a pod spec: the context is the component's values. */}}
{{- define "ferry.hostNetwork" -}}
{{- if .hostNetwork }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- end -}}

{{/* The kubelet directory without a trailing slash. */}}
{{- define "ferry.kubeletDir" -}}
{{- trimSuffix "/" .Values.node.kubeletDir -}}
{{- end -}}

{{/* "true" when csi-provisioner must read Secrets: controller.readProvisionerSecrets, or a
StorageClass of the chart that names a provisioner Secret. */}}
{{- define "ferry.provisionerReadsSecrets" -}}
{{- $reads := .Values.controller.readProvisionerSecrets }}
{{- range .Values.storageClasses }}
{{- range $key, $_ := .parameters }}
{{- if hasPrefix "csi.storage.k8s.io/provisioner-secret-" $key }}
{{- $reads = true }}
{{- end }}
{{- end }}
{{- end }}
{{- if $reads }}true{{ end -}}
{{- end -}}
