{{/* Names and labels shared by every object of the chart. */}}

{{- define "cedana.fullname" -}}
{{- if contains "cedana" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-cedana" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "cedana.labels" -}}
app.kubernetes.io/name: cedana
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "cedana.selector" -}}
app.kubernetes.io/name: cedana
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The label selector (a string) the helper uses to find a component's pods. */}}
{{- define "cedana.podSelector" -}}
app.kubernetes.io/name=cedana,app.kubernetes.io/instance={{ .root.Release.Name }},app.kubernetes.io/component={{ .component }}
{{- end -}}

{{- define "cedana.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .Values.image.registry -}}
{{ .Values.image.registry }}/{{ .Values.image.repository }}:{{ $tag }}
{{- else -}}
{{ .Values.image.repository }}:{{ $tag }}
{{- end -}}
{{- end -}}

{{/* Node config settings, as `--set=KEY=VALUE` arguments of `cedana node`. */}}
{{- define "cedana.settings" -}}
{{- $s := dict "store_path" .Values.store.path "compression_level" .Values.compression.level "compression_threads" .Values.compression.threads "retain" .Values.checkpoint.retain "checkpoint_timeout" .Values.checkpoint.timeout "restore_timeout" .Values.checkpoint.restoreTimeout "checkpoint_interval" .Values.checkpoint.defaultInterval -}}
{{- if .Values.store.registry -}}
{{- $_ := set $s "registry" .Values.store.registry -}}
{{- $_ := set $s "registry_ca" .Values.store.registryCA -}}
{{- $_ := set $s "registry_insecure" .Values.store.registryInsecure -}}
{{- $_ := set $s "registry_sync" .Values.store.registrySync -}}
{{- if .Values.store.registrySecret -}}
{{- $_ := set $s "registry_auth_file" "/etc/cedana/registry-auth.json" -}}
{{- end -}}
{{- end -}}
{{- if .Values.keys.secret -}}
{{- $dir := "/etc/cedana/keys/" -}}
{{- $enc := list -}}
{{- range .Values.keys.encryption -}}
{{- if contains "=" . -}}
{{- $p := splitn "=" 2 . -}}
{{- $enc = append $enc (printf "%s=jwe:%s%s" $p._0 $dir $p._1) -}}
{{- else -}}
{{- $enc = append $enc (printf "jwe:%s%s" $dir .) -}}
{{- end -}}
{{- end -}}
{{- $dec := list -}}
{{- range .Values.keys.decryption -}}
{{- $dec = append $dec (printf "%s%s" $dir .) -}}
{{- end -}}
{{- $trusted := list -}}
{{- range .Values.keys.trusted -}}
{{- $trusted = append $trusted (printf "%s%s" $dir .) -}}
{{- end -}}
{{- $_ := set $s "encryption_keys" (join "," $enc) -}}
{{- $_ := set $s "decryption_keys" (join "," $dec) -}}
{{- $_ := set $s "trusted_keys" (join "," $trusted) -}}
{{- if .Values.keys.signing -}}
{{- $_ := set $s "signing_key" (printf "%s%s" $dir .Values.keys.signing) -}}
{{- end -}}
{{- end -}}
{{- $s = merge (deepCopy .Values.shimConfig) $s -}}
{{- range $key := keys $s | sortAlpha }}
{{- $value := index $s $key }}
{{- if or (kindIs "float64" $value) (kindIs "int64" $value) (kindIs "int" $value) (kindIs "bool" $value) $value }}
- --set={{ $key }}={{ $value }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The controller's ServiceAccount as TokenReview names it: the only user the node
agents' API answers. */}}
{{- define "cedana.controllerUser" -}}
system:serviceaccount:{{ .Values.namespace }}:{{ include "cedana.fullname" . }}-controller
{{- end -}}
