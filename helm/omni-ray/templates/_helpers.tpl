{{/* Names and labels. */}}
{{- define "omni-ray.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "omni-ray.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "omni-ray.labels" -}}
{{ include "omni-ray.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The Serve config (serveConfigV2): the application of values.serve, as in deployments/*.yaml. A checkpoint
     model's path points into the mounted model volume. */}}
{{- define "omni-ray.serveConfig" -}}
{{- $app := .Values.serve.application | default (.Files.Get "files/default-application.yaml" | fromYaml) -}}
{{- $args := deepCopy $app.args -}}
{{- if eq .Values.model.source "checkpoint" -}}
{{- $path := .Values.model.mountPath -}}
{{- if .Values.model.subPath -}}{{- $path = printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.subPath -}}{{- end -}}
{{- $_ := set $args.pipeline.model "path" $path -}}
{{- end -}}
{{- $application := dict "name" $app.name "route_prefix" $app.routePrefix "import_path" "omni_ray.serve.app:build_app" "args" $args "deployments" $app.deployments -}}
{{- $config := dict "proxy_location" .Values.serve.proxyLocation "http_options" (dict "host" "0.0.0.0" "port" .Values.serve.port) "applications" (list $application) -}}
{{- toYaml $config -}}
{{- end -}}

{{/* Whether workers (`worker` true) get a compile cache volume: a hostPath or a shared claim, not both. */}}
{{- define "omni-ray.compileCache" -}}
{{- $values := .root.Values.compileCache -}}
{{- if and $values.hostPath $values.persistentVolumeClaim -}}
{{- fail "compileCache: set hostPath or persistentVolumeClaim, not both" -}}
{{- end -}}
{{- if and .worker (or $values.hostPath $values.persistentVolumeClaim) }}true{{ end -}}
{{- end -}}

{{/* The model volume and its mount, on every Ray pod (nothing for the tiny model); on workers (`worker` true) also
the compile cache's volume (a hostPath or a shared claim), its mount, and the environment that points torch.compile
at it. */}}
{{- define "omni-ray.volumes" -}}
{{- $model := and (eq .root.Values.model.source "checkpoint") .root.Values.model.volume -}}
{{- $cache := include "omni-ray.compileCache" . -}}
{{- if or $model $cache }}
volumes:
{{- if $model }}
  - name: model
{{ toYaml .root.Values.model.volume | indent 4 }}
{{- end }}
{{- if $cache }}
  - name: compile-cache
{{- if .root.Values.compileCache.hostPath }}
    hostPath: {path: {{ .root.Values.compileCache.hostPath | quote }}, type: DirectoryOrCreate}
{{- else }}
    persistentVolumeClaim: {claimName: {{ .root.Values.compileCache.persistentVolumeClaim | quote }}}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "omni-ray.mounts" -}}
{{- $model := and (eq .root.Values.model.source "checkpoint") .root.Values.model.volume -}}
{{- $cache := include "omni-ray.compileCache" . -}}
{{- $relaySecret := .root.Values.relaySecret.name -}}
{{- $haproxy := .root.Values.serve.haproxy -}}
{{- if or $cache $relaySecret $haproxy }}
env:
{{- if $haproxy }}
  - {name: RAY_SERVE_ENABLE_HA_PROXY, value: "1"}
{{- end }}
{{- if $relaySecret }}
  - name: OMNI_RAY_RELAY_SECRET
    valueFrom: {secretKeyRef: {name: {{ $relaySecret | quote }}, key: {{ .root.Values.relaySecret.key | quote }}}}
{{- end }}
{{- if $cache }}
  - {name: TORCHINDUCTOR_CACHE_DIR, value: {{ printf "%s/inductor" .root.Values.compileCache.mountPath | quote }}}
  - {name: TRITON_CACHE_DIR, value: {{ printf "%s/triton" .root.Values.compileCache.mountPath | quote }}}
{{- end }}
{{- end }}
{{- if or $model $cache }}
volumeMounts:
{{- if $model }}
  - name: model
    mountPath: {{ .root.Values.model.mountPath }}
    readOnly: true
{{- end }}
{{- if $cache }}
  - name: compile-cache
    mountPath: {{ .root.Values.compileCache.mountPath }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "omni-ray.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}
