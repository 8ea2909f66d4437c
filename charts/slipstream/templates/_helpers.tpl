{{/* Names and labels shared by every template. */}}
{{- define "slipstream.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "slipstream.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "slipstream.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "slipstream.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "slipstream.labels" -}}
app.kubernetes.io/name: {{ include "slipstream.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "slipstream.selectorLabels" -}}
app.kubernetes.io/name: {{ include "slipstream.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The pods the operator creates for every InferenceService (reconcile_service.py). */}}
{{- define "slipstream.inferenceSelector" -}}
app.kubernetes.io/managed-by: slipstream-operator
{{- end -}}

{{- define "slipstream.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "slipstream.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "slipstream.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The sidecar image the operator gives InferenceServices that name none (sidecar.image,
falling back to the operator's repository and tag). */}}
{{- define "slipstream.sidecarImage" -}}
{{- $repository := default .Values.image.repository .Values.sidecar.image.repository -}}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.sidecar.image.tag -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}

{{/* Render a prometheus-operator object only if its API exists or it is forced. */}}
{{- define "slipstream.hasMonitoringAPI" -}}
{{- if or .force (.root.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") -}}true{{- end -}}
{{- end -}}

{{/*
SLO rule groups (the body of a PrometheusRule, and of the rules file `slipstream demo` and the
e2e tests load into a plain Prometheus).

The sidecars export TTFT and TBT as histograms; the share of online requests (token gaps for
TBT) slower than the threshold is (count - bucket{le=threshold}) / count over a window. The
threshold must be one of the histogram's bucket bounds, written as the `le` label
(values.schema.json lists them). A window without traffic gives 0/0 = NaN, which never
alerts. Alerts follow the multi-window, multi-burn-rate recipe of the Google SRE workbook
(ch. 5): page at 14.4x the error budget over 1h and 5m, warn at 6x over 6h and 30m.
*/}}
{{- define "slipstream.sloRuleGroups" -}}
{{- $pr := .Values.metrics.prometheusRule -}}
{{- $by := "namespace, slipstream_dev_service" -}}
{{- $metrics := list (list "ttft" "slipstream_ttft_seconds" $pr.ttftThreshold) (list "tbt" "slipstream_tbt_seconds" $pr.tbtThreshold) -}}
groups:
  - name: slipstream-slo.rules
    rules:
      {{- range $w := list "5m" "30m" "1h" "6h" }}
      {{- range $m := $metrics }}
      - record: slipstream:slo_violation_ratio:rate{{ $w }}
        expr: |
          (
            sum by ({{ $by }}) (rate({{ index $m 1 }}_count{class="online"}[{{ $w }}]))
            - sum by ({{ $by }}) (rate({{ index $m 1 }}_bucket{class="online",le="{{ index $m 2 }}"}[{{ $w }}]))
          )
          / sum by ({{ $by }}) (rate({{ index $m 1 }}_count{class="online"}[{{ $w }}]))
        labels:
          metric: {{ index $m 0 }}
          threshold: {{ index $m 2 | quote }}
      {{- end }}
      {{- end }}
      - record: slipstream:offline_output_tokens:rate1m
        expr: sum by ({{ $by }}) (rate(slipstream_output_tokens_total{class="offline"}[1m]))
  - name: slipstream-slo.alerts
    rules:
      - alert: SlipstreamSLOFastBurn
        expr: |
          slipstream:slo_violation_ratio:rate1h > (14.4 * {{ $pr.errorBudget }})
          and
          slipstream:slo_violation_ratio:rate5m > (14.4 * {{ $pr.errorBudget }})
        for: 2m
        labels: {severity: critical}
        annotations:
          summary: "{{ "{{ $labels.slipstream_dev_service }}" }}: online {{ "{{ $labels.metric }}" }} is burning its error budget 14x too fast"
          description: "{{ "{{ $value | humanizePercentage }}" }} of online {{ "{{ $labels.metric }}" }} samples of {{ "{{ $labels.namespace }}" }}/{{ "{{ $labels.slipstream_dev_service }}" }} exceeded {{ "{{ $labels.threshold }}" }}s over the last hour. Offline work on these pods is throttled by the budget; check the InferenceService's SLOMet and BudgetReady conditions and the online load."
      - alert: SlipstreamSLOSlowBurn
        expr: |
          slipstream:slo_violation_ratio:rate6h > (6 * {{ $pr.errorBudget }})
          and
          slipstream:slo_violation_ratio:rate30m > (6 * {{ $pr.errorBudget }})
        for: 15m
        labels: {severity: warning}
        annotations:
          summary: "{{ "{{ $labels.slipstream_dev_service }}" }}: online {{ "{{ $labels.metric }}" }} is burning its error budget 6x too fast"
          description: "{{ "{{ $value | humanizePercentage }}" }} of online {{ "{{ $labels.metric }}" }} samples of {{ "{{ $labels.namespace }}" }}/{{ "{{ $labels.slipstream_dev_service }}" }} exceeded {{ "{{ $labels.threshold }}" }}s over the last 6 hours."
      - alert: SlipstreamEngineNotReady
        expr: slipstream_engine_ready == 0
        for: 5m
        labels: {severity: warning}
        annotations:
          summary: "{{ "{{ $labels.pod }}" }}: the engine behind the sidecar is not ready"
          description: "The sidecar of {{ "{{ $labels.namespace }}" }}/{{ "{{ $labels.pod }}" }} has had no healthy vLLM engine for 5 minutes; its online traffic fails and its offline shards will move."
  # From the operator's own /metrics (scraped with honorLabels: namespace is the object's).
  - name: slipstream-operator.alerts
    rules:
      - alert: SlipstreamOfflineJobFailed
        expr: slipstream_offlinejob_phase{phase="Failed"} == 1
        for: 1m
        labels: {severity: warning}
        annotations:
          summary: "OfflineJob {{ "{{ $labels.namespace }}" }}/{{ "{{ $labels.name }}" }} failed"
          description: "The job's phase is Failed; `kubectl describe offlinejob -n {{ "{{ $labels.namespace }}" }} {{ "{{ $labels.name }}" }}` shows the condition that says why."
      - alert: SlipstreamReplicasNotReady
        expr: slipstream_inferenceservice_ready_replicas < slipstream_inferenceservice_spec_replicas
        for: 15m
        labels: {severity: warning}
        annotations:
          summary: "InferenceService {{ "{{ $labels.namespace }}" }}/{{ "{{ $labels.name }}" }} has fewer ready pods than asked for"
          description: "{{ "{{ $value }}" }} ready pods for 15 minutes, fewer than spec.replicas: online capacity and the offline work on these pods are short."
{{- end -}}
