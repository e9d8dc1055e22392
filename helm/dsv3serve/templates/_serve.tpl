{{/*
The app args: a router.config.ServingConfig built from values. Each role's engine is the shared
engine plus its tp_size (tpSize), its layout fields and its own engine overrides. Each rank asks
for one GPU and one unit of "<role>_node", a Ray resource only that role's pods advertise, so a
role's ranks land on its own pods; a group larger than a pod spans pods (the replica's PACK
placement group fills one pod's GPUs, then the next).
*/}}
{{- define "dsv3serve.servingArgs" -}}
{{- $v := .Values -}}
{{- $engine := merge (dict "model" $v.model.path) (deepCopy $v.engine) -}}
{{- $router := merge (dict "metrics_host" "0.0.0.0" "metrics_port" (int $v.metrics.routerPort)) (deepCopy $v.router) -}}
{{- $args := dict "mode" $v.mode "engine" $engine "router" $router -}}
{{- if eq $v.mode "pd" -}}
{{- $_ := set $args "kv_connector" $v.kvTransfer.connector -}}
{{- $_ = set $args "kv_connector_options" ($v.kvTransfer.options | default dict) -}}
{{- if hasKey $v.kvTransfer "leaseS" -}}
{{- $_ = set $args "kv_lease_s" $v.kvTransfer.leaseS -}}
{{- end -}}
{{- end -}}
{{- range $role := include "dsv3serve.roles" . | splitList " " -}}
{{- $g := index $v $role -}}
{{- $group := dict "num_replicas" (int $g.numReplicas) "num_cpus" (int $g.cpusPerRank) -}}
{{- $_ := set $group "num_gpus" 1 -}}
{{- $_ = set $group "resources" (dict (include "dsv3serve.nodeResource" $role) 1) -}}
{{- $layout := merge (dict "tp_size" (int $g.tpSize)) (deepCopy ($g.layout | default dict)) -}}
{{- $_ = set $group "engine" (merge (deepCopy ($g.engine | default dict)) $layout) -}}
{{- if hasKey $g "minReplicas" -}}
{{- $_ = set $group "min_replicas" (int $g.minReplicas) -}}
{{- end -}}
{{- if hasKey $g "maxReplicas" -}}
{{- $_ = set $group "max_replicas" (int $g.maxReplicas) -}}
{{- end -}}
{{- $_ = set $args $role $group -}}
{{- end -}}
{{- with $v.slo -}}
{{- $slo := dict "ttft_p99_s" .ttftP99S "itl_p99_s" .itlP99S -}}
{{- if hasKey . "cooldownS" -}}
{{- $_ := set $slo "cooldown_s" .cooldownS -}}
{{- end -}}
{{- if hasKey . "drainTimeoutS" -}}
{{- $_ := set $slo "drain_timeout_s" .drainTimeoutS -}}
{{- end -}}
{{- $_ := set $args "slo" $slo -}}
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
    {{- with .Values.slo }}
    # Serve's application-level autoscaling policy (router/autoscale/app.py writes the same)
    autoscaling_policy:
      policy_function: router.autoscale.serve:PDAutoscaler
      policy_kwargs:
        ttft_p99_s: {{ .ttftP99S }}
        itl_p99_s: {{ .itlP99S }}
        bounds:
          {{- range $role := list "prefill" "decode" }}
          {{- $g := index $.Values $role }}
          {{ $role }}: [{{ int (default $g.numReplicas $g.minReplicas) }}, {{ int (default $g.numReplicas $g.maxReplicas) }}]
          {{- end }}
        cooldown_s: {{ default 10.0 .cooldownS }}
        leave_delay_s: 3.0  # metrics_interval_s (2.0) + 1 s, as router/autoscale/app.py writes it
        drain_timeout_s: {{ default 120.0 .drainTimeoutS }}
    {{- end }}
    args:
      {{- include "dsv3serve.servingArgs" . | nindent 6 }}
{{- end -}}
