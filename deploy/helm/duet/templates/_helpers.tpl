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

{{/* Where the TLS Secrets are mounted (read-only), and the files the flags name. */}}
{{- define "duet.routerTlsDir" -}}/etc/duet/tls/router{{- end -}}
{{- define "duet.routerClientCaDir" -}}/etc/duet/tls/router-client-ca{{- end -}}
{{- define "duet.internalTlsDir" -}}/etc/duet/tls/internal{{- end -}}

{{/* The name every worker's certificate carries (a DNS SAN), which the router checks instead of
     the pod IPs discovery yields (--internal-tls-server-name). */}}
{{- define "duet.internalTlsServerName" -}}
{{- .Values.tls.internal.serverName | default (printf "%s-workers.%s.svc" (include "duet.fullname" .) .Release.Namespace) -}}
{{- end -}}

{{/* Refuses TLS settings that cannot work, with the value to set. Included by router.yaml. */}}
{{- define "duet.validateTls" -}}
{{- $rt := .Values.tls.router -}}
{{- $it := .Values.tls.internal -}}
{{- if and $rt.enabled (not $rt.existingSecret) -}}
{{- fail "tls.router.enabled needs tls.router.existingSecret: a kubernetes.io/tls Secret with tls.crt and tls.key (and ca.crt for tls.router.clientCertRequired), e.g. from cert-manager" -}}
{{- end -}}
{{- if and $rt.clientCertRequired (not $rt.enabled) -}}
{{- fail "tls.router.clientCertRequired needs tls.router.enabled (client certificates are checked by the router's own TLS)" -}}
{{- end -}}
{{- if and $rt.clientCaSecret (not $rt.clientCertRequired) -}}
{{- fail "tls.router.clientCaSecret is only used with tls.router.clientCertRequired: set both or neither" -}}
{{- end -}}
{{- if and $it.enabled (not $it.existingSecret) -}}
{{- fail "tls.internal.enabled needs tls.internal.existingSecret: a Secret with tls.crt, tls.key and ca.crt (the certificate every worker serves and the router presents, and the CA that signed it)" -}}
{{- end -}}
{{- end -}}

{{/* Volumes every Duet pod has: the model, the internal token, the internal TLS certificate. */}}
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
{{- /* 0444: Secret files belong to root and the image runs as uid 10001 with no fsGroup, so
       0400 would be unreadable; the volume is this pod's alone and mounted read-only. */}}
- name: internal-token
  secret:
    secretName: {{ include "duet.internalTokenSecret" . }}
    defaultMode: 0444
{{- end }}
{{- if .Values.tls.internal.enabled }}
{{- /* Every key listed: a Secret without one of them keeps the pod from starting, with an event
       that names the key. 0444 as the token's. */}}
- name: internal-tls
  secret:
    secretName: {{ .Values.tls.internal.existingSecret }}
    defaultMode: 0444
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
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
{{- if .Values.tls.internal.enabled }}
- name: internal-tls
  mountPath: {{ include "duet.internalTlsDir" . }}
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

{{/* Mutual TLS between the router and its workers, the same files on both sides: a worker
     serves tls.crt and requires a client certificate ca.crt signed; the router verifies the
     workers against ca.crt (for the name duet.internalTlsServerName) and presents tls.crt. */}}
{{- define "duet.internalTlsArgs" -}}
{{- if .Values.tls.internal.enabled }}
{{- $dir := include "duet.internalTlsDir" . }}
- --internal-tls-certfile={{ $dir }}/tls.crt
- --internal-tls-keyfile={{ $dir }}/tls.key
- --internal-tls-ca-certs={{ $dir }}/ca.crt
{{- end }}
{{- end -}}

{{/* A probe of the router, fitted to its own TLS (tls.router):
     - httpGet gets scheme HTTPS (the kubelet does not verify the certificate);
     - with clientCertRequired an httpGet probe becomes a tcpSocket probe of the same port: the
       kubelet cannot present a client certificate, so the handshake would fail every time;
     - a grpc probe becomes tcpSocket too: the kubelet's gRPC probes speak plaintext only.
     Without router TLS the probe is as given. (dict "root" $ "probe" <probe>) */}}
{{- define "duet.routerProbe" -}}
{{- $probe := deepCopy .probe -}}
{{- $rt := .root.Values.tls.router -}}
{{- if $rt.enabled -}}
{{- if and (hasKey $probe "httpGet") $rt.clientCertRequired -}}
{{- $_ := set $probe "tcpSocket" (dict "port" $probe.httpGet.port) -}}
{{- $_ := unset $probe "httpGet" -}}
{{- else if hasKey $probe "httpGet" -}}
{{- $_ := set $probe.httpGet "scheme" "HTTPS" -}}
{{- end -}}
{{- if hasKey $probe "grpc" -}}
{{- $_ := set $probe "tcpSocket" (dict "port" $probe.grpc.port) -}}
{{- $_ := unset $probe "grpc" -}}
{{- end -}}
{{- end -}}
{{- toYaml $probe -}}
{{- end -}}

{{/* A flag with a value, left out when the value is 0 or empty (Duet's default then). */}}
{{- define "duet.optionalFlag" -}}
{{- if .value }}
- --{{ .flag }}={{ .value }}
{{- end }}
{{- end -}}
