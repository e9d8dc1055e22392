{{/* Pieces shared by the head and worker pod templates. */}}

{{/* Ray token auth on every Ray container; KubeRay copies the env into its init containers. */}}
{{- define "dsv3serve.rayAuthEnv" -}}
{{- if .Values.rayAuth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "dsv3serve.rayAuthSecret" . }}
      key: {{ include "dsv3serve.rayAuthKey" . }}
{{- end }}
{{- end -}}

{{/* NAME: value pairs from a values map, sorted by name. */}}
{{- define "dsv3serve.envList" -}}
{{- range $name, $value := . }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end -}}

{{/* The router's API key is the head's alone, and so is Serve's HTTP proxy (HeadOnly): its
middleware (router/api/proxy_middleware.py) ends a stream cut by a router replica's death with an
error event, and refuses past the admission budget at the door (router/api/proxy_admission.py:
router.num_replicas x max_in_flight + max_queued_requests). */}}
{{- define "dsv3serve.headEnv" -}}
{{- include "dsv3serve.rayAuthEnv" . }}
- name: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
  value: router.api.proxy_middleware:proxy_middlewares
{{- $queued := int (dig "max_queued_requests" 1024 .Values.router) }}
{{- if ge $queued 0 }}
{{- $routers := int (include "dsv3serve.routerReplicas" .) }}
- name: DSV3SERVE_PROXY_ADMISSION_LIMIT
  value: {{ add (mul $routers (int (dig "max_in_flight" 256 .Values.router))) $queued | quote }}
{{- end }}
{{- if .Values.apiKey.enabled }}
- name: DSV3SERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "dsv3serve.apiKeySecret" . }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- include "dsv3serve.envList" .Values.head.env }}
{{- end -}}

{{/* Args: (list ctx workers). */}}
{{- define "dsv3serve.workerEnv" -}}
{{- $ctx := index . 0 -}}
{{- include "dsv3serve.rayAuthEnv" $ctx }}
{{- include "dsv3serve.envList" $ctx.Values.gpuEnv }}
{{- if $ctx.Values.cache.volume }}
- name: DSV3SERVE_CACHE
  value: {{ $ctx.Values.cache.mountPath | quote }}
{{- end }}
{{- include "dsv3serve.envList" (index . 1).env }}
{{- end -}}

{{/* The cache volume (compile caches, tuned tables): worker pods only, read-write. */}}
{{- define "dsv3serve.cacheMount" -}}
{{- if .Values.cache.volume }}
- name: cache
  mountPath: {{ .Values.cache.mountPath }}
{{- end }}
{{- end -}}

{{- define "dsv3serve.cacheVolume" -}}
{{- if .Values.cache.volume }}
- name: cache
  {{- toYaml .Values.cache.volume | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "dsv3serve.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* Args: (list ctx shmSize). */}}
{{- define "dsv3serve.volumes" -}}
{{- $ctx := index . 0 -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ index . 1 | quote }}
{{- if $ctx.Values.model.volume }}
- name: model
  {{- toYaml $ctx.Values.model.volume | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The pods' grace period: the router's graceful bound (router.graceful_shutdown_timeout_s,
also the router deployment's Serve graceful_shutdown_timeout_s) plus 10 s for Serve and Ray to
stop, so Kubernetes does not kill a pod while its requests may still finish. */}}
{{- define "dsv3serve.terminationGrace" -}}
{{- add (.Values.router.graceful_shutdown_timeout_s | ceil | int) 10 -}}
{{- end -}}

{{/* Scheduling and pod-level fields. Args: (list ctx group), group has nodeSelector etc. */}}
{{- define "dsv3serve.podSpecCommon" -}}
{{- $ctx := index . 0 -}}
{{- $g := index . 1 -}}
{{- /* Ray pods never call the Kubernetes API, except the autoscaler sidecar. */}}
automountServiceAccountToken: {{ $ctx.Values.enableInTreeAutoscaling }}
terminationGracePeriodSeconds: {{ include "dsv3serve.terminationGrace" $ctx }}
{{- with $ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $g.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $g.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $g.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A worker group. Args: (list ctx role). */}}
{{- define "dsv3serve.workerGroup" -}}
{{- $ctx := index . 0 -}}
{{- $role := index . 1 -}}
{{- $g := index $ctx.Values $role -}}
{{- $w := $g.workers -}}
{{- $resource := include "dsv3serve.nodeResource" $role -}}
- groupName: {{ $role }}
  replicas: {{ int $w.replicas }}
  minReplicas: {{ int (default $w.replicas $w.minReplicas) }}
  maxReplicas: {{ int (default $w.replicas $w.maxReplicas) }}
  rayStartParams:
    {{- /* Exactly the CPUs its ranks take, so the router (1 CPU) is placed on the head. */}}
    num-cpus: {{ mul $w.gpus $g.cpusPerRank | toString | quote }}
    resources: {{ printf "\"{\\\"%s\\\": %d}\"" $resource (int $w.gpus) | quote }}
    metrics-export-port: {{ $ctx.Values.metrics.rayPort | toString | quote }}
  template:
    metadata:
      labels:
        {{- include "dsv3serve.selectorLabels" $ctx | nindent 8 }}
        dsv3serve.io/role: {{ $role }}
    spec:
      {{- include "dsv3serve.podSpecCommon" (list $ctx $w) | trim | nindent 6 }}
      containers:
        - name: ray-worker
          image: {{ include "dsv3serve.image" $ctx }}
          imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
          ports:
            - {name: metrics, containerPort: {{ $ctx.Values.metrics.rayPort }}, protocol: TCP}
          {{- with include "dsv3serve.workerEnv" (list $ctx $w) | trim }}
          env:
            {{- . | nindent 12 }}
          {{- end }}
          resources:
            requests: {cpu: {{ $w.cpu | quote }}, memory: {{ $w.memory | quote }}, nvidia.com/gpu: {{ int $w.gpus }}}
            limits: {cpu: {{ $w.cpu | quote }}, memory: {{ $w.memory | quote }}, nvidia.com/gpu: {{ int $w.gpus }}}
          {{- with $w.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            {{- include "dsv3serve.volumeMounts" $ctx | trim | nindent 12 }}
            {{- with include "dsv3serve.cacheMount" $ctx | trim }}
            {{- . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "dsv3serve.volumes" (list $ctx $w.shmSize) | trim | nindent 8 }}
        {{- with include "dsv3serve.cacheVolume" $ctx | trim }}
        {{- . | nindent 8 }}
        {{- end }}
{{- end -}}
