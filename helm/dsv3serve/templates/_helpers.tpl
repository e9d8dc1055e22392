{{/* Names and labels. */}}
{{- define "dsv3serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* At most 40 characters: KubeRay derives longer names (<name>-raycluster-xxxxx-head-svc). */}}
{{- define "dsv3serve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "dsv3serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dsv3serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dsv3serve.labels" -}}
{{ include "dsv3serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "dsv3serve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Secret names and keys. */}}
{{- define "dsv3serve.rayAuthSecret" -}}
{{- default (printf "%s-ray-auth" (include "dsv3serve.fullname" .)) .Values.rayAuth.existingSecret -}}
{{- end -}}

{{- define "dsv3serve.apiKeySecret" -}}
{{- default (printf "%s-api-key" (include "dsv3serve.fullname" .)) .Values.apiKey.existingSecret -}}
{{- end -}}

{{/* KubeRay's key for the Ray auth token in a Secret. */}}
{{- define "dsv3serve.rayAuthKey" -}}auth_token{{- end -}}

{{/*
A secret value: the given one, else the one already stored in the release's Secret (so
upgrades keep it), else a new random one. Args: (list ctx secretName key given).
*/}}
{{- define "dsv3serve.secretValue" -}}
{{- $ctx := index . 0 -}}
{{- $name := index . 1 -}}
{{- $key := index . 2 -}}
{{- $given := index . 3 -}}
{{- $stored := (lookup "v1" "Secret" $ctx.Release.Namespace $name).data | default dict -}}
{{- if $given -}}
{{- $given -}}
{{- else if hasKey $stored $key -}}
{{- index $stored $key | b64dec -}}
{{- else -}}
{{- randAlphaNum 48 -}}
{{- end -}}
{{- end -}}

{{/* The Ray custom resource that pins a role's ranks to its worker pods. */}}
{{/* Router replicas (router.num_replicas, RouterSettings' default 2), all on the head pod. */}}
{{- define "dsv3serve.routerReplicas" -}}{{ int (dig "num_replicas" 2 .Values.router) }}{{- end -}}

{{/* The router metrics ports as "name=port" words: router replica k binds
metrics.routerPort + k (router/metrics_server.py). */}}
{{- define "dsv3serve.routerMetricsPorts" -}}
{{- $ports := list -}}
{{- range $k := until (int (include "dsv3serve.routerReplicas" .)) -}}
{{- $ports = append $ports (printf "rtr-metrics-%d=%d" $k (add (int $.Values.metrics.routerPort) $k)) -}}
{{- end -}}
{{- join " " $ports -}}
{{- end -}}

{{- define "dsv3serve.nodeResource" -}}{{ . }}_node{{- end -}}

{{/* The worker roles of the mode, space-separated: "prefill decode" or "colocated". */}}
{{- define "dsv3serve.roles" -}}
{{- if eq .Values.mode "colocated" -}}colocated{{- else -}}prefill decode{{- end -}}
{{- end -}}

{{/*
A role's engine.speculative_algorithm ("" when off): its own engine override, else the
shared engine's. Args: (list ctx role).
*/}}
{{- define "dsv3serve.specAlgorithm" -}}
{{- $ctx := index . 0 -}}
{{- $own := (index $ctx.Values (index . 1)).engine | default dict -}}
{{- if hasKey $own "speculative_algorithm" -}}
{{- $own.speculative_algorithm | default "" -}}
{{- else -}}
{{- $ctx.Values.engine.speculative_algorithm | default "" -}}
{{- end -}}
{{- end -}}

{{/*
Fail early, with the field names, on layouts Ray could never place or the engine refuses.
A replica's tpSize ranks may span pods (its PACK placement group fills one pod, then the
next), so only the role's GPUs in total bound them. Args: (list ctx role).
*/}}
{{- define "dsv3serve.checkRole" -}}
{{- $ctx := index . 0 -}}
{{- $role := index . 1 -}}
{{- $g := index $ctx.Values $role -}}
{{- $w := $g.workers -}}
{{- if and (eq $role "prefill") ($g.layout | default dict).enable_dp_attention -}}
{{- fail "prefill.layout.enable_dp_attention: found true, expected false: a prefill group publishes KV from rank 0's pool, so it runs TP; DP attention is for decode and colocated groups" -}}
{{- end -}}
{{- $need := mul $g.numReplicas $g.tpSize -}}
{{- $have := mul $w.replicas $w.gpus -}}
{{- if gt (int $need) (int $have) -}}
{{- fail (printf "%s.numReplicas: %d replicas x tpSize %d need %d GPUs, but %s.workers has %d pods x %d GPUs = %d" $role (int $g.numReplicas) (int $g.tpSize) (int $need) $role (int $w.replicas) (int $w.gpus) (int $have)) -}}
{{- end -}}
{{- end -}}

{{- define "dsv3serve.checkValues" -}}
{{- range $role := include "dsv3serve.roles" . | splitList " " -}}
{{- include "dsv3serve.checkRole" (list $ $role) -}}
{{- end -}}
{{- if eq .Values.mode "pd" -}}
{{- $pSpec := include "dsv3serve.specAlgorithm" (list . "prefill") -}}
{{- $dSpec := include "dsv3serve.specAlgorithm" (list . "decode") -}}
{{- if ne (empty $pSpec) (empty $dSpec) -}}
{{- fail (printf "prefill and decode engine.speculative_algorithm: found %q and %q, expected both set or both unset (decode drafts from the prefill side's draft state)" $pSpec $dSpec) -}}
{{- end -}}
{{- end -}}
{{- if eq (int .Values.metrics.routerPort) (int .Values.metrics.rayPort) -}}
{{- fail (printf "metrics.routerPort: found %d, the same as metrics.rayPort" (int .Values.metrics.routerPort)) -}}
{{- end -}}
{{- $lastRouterPort := add (int .Values.metrics.routerPort) (int (include "dsv3serve.routerReplicas" .)) -1 -}}
{{- if and (gt (int .Values.metrics.rayPort) (int .Values.metrics.routerPort)) (le (int .Values.metrics.rayPort) (int $lastRouterPort)) -}}
{{- fail (printf "metrics.rayPort: found %d, one of the router metrics ports %d..%d (metrics.routerPort + the router replica's rank, router.num_replicas replicas)" (int .Values.metrics.rayPort) (int .Values.metrics.routerPort) (int $lastRouterPort)) -}}
{{- end -}}
{{- if and .Values.rayAuth.enabled (not (semverCompare ">=2.52.0-0" .Values.rayVersion)) -}}
{{- fail (printf "rayVersion: found %s, expected >= 2.52.0 for rayAuth.enabled (Ray token authentication)" .Values.rayVersion) -}}
{{- end -}}
{{- end -}}
