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

{{/* The model volume and its mount, on every Ray pod (nothing for the tiny model). */}}
{{- define "omni-ray.modelVolumes" -}}
{{- if and (eq .Values.model.source "checkpoint") .Values.model.volume }}
volumes:
  - name: model
{{ toYaml .Values.model.volume | indent 4 }}
{{- end }}
{{- end -}}

{{- define "omni-ray.modelMounts" -}}
{{- if and (eq .Values.model.source "checkpoint") .Values.model.volume }}
volumeMounts:
  - name: model
    mountPath: {{ .Values.model.mountPath }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "omni-ray.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}
