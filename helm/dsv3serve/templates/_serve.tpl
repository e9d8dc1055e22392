{{/*
The app args: a router.config.ServingConfig built from values. Each role's ranks ask for one
GPU and one unit of "<role>_node", a Ray resource only that role's pods advertise, so prefill
ranks land on prefill pods and decode ranks on decode pods.
*/}}
{{- define "dsv3serve.servingArgs" -}}
{{- $v := .Values -}}
{{- $engine := merge (dict "model" $v.model.path) (deepCopy $v.engine) -}}
{{- $router := merge (dict "metrics_host" "0.0.0.0" "metrics_port" (int $v.metrics.routerPort)) (deepCopy $v.router) -}}
{{- $args := dict "mode" "pd" "engine" $engine "router" $router -}}
{{- $_ := set $args "kv_connector" $v.kvTransfer.connector -}}
{{- $_ = set $args "kv_connector_options" ($v.kvTransfer.options | default dict) -}}
{{- if hasKey $v.kvTransfer "leaseS" -}}
{{- $_ = set $args "kv_lease_s" $v.kvTransfer.leaseS -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- $g := index $v $role -}}
{{- $group := dict "num_replicas" (int $g.numReplicas) "group_size" (int $g.groupSize) -}}
{{- $_ = set $group "num_cpus" (int $g.cpusPerRank) -}}
{{- $_ = set $group "num_gpus" 1 -}}
{{- $_ = set $group "resources" (dict (include "dsv3serve.nodeResource" $role) 1) -}}
{{- $_ = set $group "engine" ($g.engine | default dict) -}}
{{- $_ = set $args $role $group -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/* serveConfigV2: Ray's ServeDeploySchema, one application. Proxies run on the head only. */}}
{{- define "dsv3serve.serveConfig" -}}
proxy_location: HeadOnly
http_options:
  host: 0.0.0.0
  port: 8000
grpc_options:
  port: 9000
  grpc_servicer_functions: {{ .Values.serve.grpcServicerFunctions | default list | toJson }}
applications:
  - name: dsv3serve
    route_prefix: /
    import_path: router.app:build_app
    deployments:
      # The router runs on the head pod: it holds the API key and the metrics port.
      - name: router
        ray_actor_options:
          resources: {"node:__internal_head__": 0.001}
    args:
      {{- include "dsv3serve.servingArgs" . | nindent 6 }}
{{- end -}}
