{{/* The labels every object carries; `component` names the part (node-setup, device-plugin, dra-driver). */}}
{{- define "gpuhook.labels" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: gpuhook
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end }}

{{- define "gpuhook.selector" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end }}

{{/* repository:tag, the tag defaulting to the chart's appVersion. */}}
{{- define "gpuhook.image" -}}
{{ .image.repository }}:{{ .image.tag | default .root.Chart.AppVersion }}
{{- end }}

{{/* The scheduling fields shared by every DaemonSet. */}}
{{- define "gpuhook.placement" -}}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets: {{ toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector: {{ toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity: {{ toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations: {{ toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Named configs picked per node by its label: config.map given, or an existing ConfigMap (config.name). */}}
{{- define "gpuhook.namedConfigs" -}}
{{- if or .Values.config.map .Values.config.name -}}true{{- end -}}
{{- end }}

{{- define "gpuhook.configMapName" -}}
{{ .Values.config.name | default (printf "%s-device-plugin-configs" .Release.Name) }}
{{- end }}

{{- define "gpuhook.draNamespace" -}}
{{ .Values.draDriver.namespace | default .Release.Namespace }}
{{- end }}
