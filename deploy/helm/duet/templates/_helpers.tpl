{{/* The release's base name for every object. */}}
{{- define "duet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "duet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "duet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "duet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one role: (dict "root" $ "role" "router|prefill|decode") */}}
{{- define "duet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "duet.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "duet.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.flavor) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{- define "duet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "duet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The headless Service of a worker role, and the router's discovery target for it. */}}
{{- define "duet.workerService" -}}
{{- printf "%s-%s" (include "duet.fullname" .root) .role -}}
{{- end -}}
{{- define "duet.discoveryTarget" -}}
{{- $port := (index .root.Values .role).port -}}
{{- printf "dns:///%s.%s.svc.%s:%v" (include "duet.workerService" .) .root.Release.Namespace .root.Values.clusterDomain $port -}}
{{- end -}}

{{- define "duet.modelDir" -}}
{{- $m := .Values.modelArtifacts -}}
{{- if $m.path -}}{{ printf "%s/%s" (trimSuffix "/" $m.mountPath) (trimPrefix "/" $m.path) }}{{- else -}}{{ $m.mountPath }}{{- end -}}
{{- end -}}

{{- define "duet.apiKeySecret" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "duet.fullname" .)) -}}
{{- end -}}
{{- define "duet.internalTokenSecret" -}}
{{- .Values.internalToken.existingSecret | default (printf "%s-internal-token" (include "duet.fullname" .)) -}}
{{- end -}}

{{/* Volumes every Duet pod has: the model, the internal token. */}}
{{- define "duet.volumes" -}}
{{- $m := .Values.modelArtifacts -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "modelArtifacts.pvc.claimName is required with modelArtifacts.source=pvc" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "modelArtifacts.hostPath.path is required with modelArtifacts.source=hostPath" $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "initContainer" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.initContainer.sizeLimit }}
{{- end }}
{{- if .Values.internalToken.enabled }}
- name: internal-token
  secret:
    secretName: {{ include "duet.internalTokenSecret" . }}
    defaultMode: 0400
{{- end }}
{{- end -}}

{{- define "duet.volumeMounts" -}}
{{- if ne .Values.modelArtifacts.source "image" }}
- name: model
  mountPath: {{ .Values.modelArtifacts.mountPath }}
  readOnly: {{ ne .Values.modelArtifacts.source "initContainer" }}
{{- end }}
{{- if .Values.internalToken.enabled }}
- name: internal-token
  mountPath: /etc/duet/internal-token
  readOnly: true
{{- end }}
{{- end -}}

{{- define "duet.initContainers" -}}
{{- $m := .Values.modelArtifacts -}}
{{- if eq $m.source "initContainer" }}
initContainers:
  - name: fetch-model
    image: {{ $m.initContainer.image }}
    {{- with $m.initContainer.command }}
    command: {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with $m.initContainer.args }}
    args: {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with $m.initContainer.env }}
    env: {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with $m.initContainer.resources }}
    resources: {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      - name: model
        mountPath: {{ $m.mountPath }}
{{- end }}
{{- end -}}

{{/* Flags every role takes. */}}
{{- define "duet.commonArgs" -}}
- --model={{ include "duet.modelDir" . }}
{{- if .Values.internalToken.enabled }}
- --internal-token-file=/etc/duet/internal-token/{{ .Values.internalToken.secretKey }}
{{- end }}
{{- end -}}

{{/* A flag with a value, left out when the value is 0 or empty (Duet's default then). */}}
{{- define "duet.optionalFlag" -}}
{{- if .value }}
- --{{ .flag }}={{ .value }}
{{- end }}
{{- end -}}
