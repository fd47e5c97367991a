{{/*
One Overworld service: a Deployment running `overworld serve <component>` (with the certificate
of identity <component>; probes on the plaintext health-only port), with .service a ClusterIP
Service for its gRPC (and metrics) port, with .headless also a headless Service.

Usage: include "overworld.component" (dict
  "context" $                 root context
  "component" "replay-buffer" the service name (also the `overworld serve` argument)
  "values" .Values.replayBuffer
  "replicas" 2                nil for a singleton (Recreate strategy)
  "env" (list ...)            the service's own environment: EnvVar objects (the "overworld.env.*" lists)
  "image" .Values.image
  "gpu" nil or .Values.rolloutWorker.gpu
  "service" true
  "headless" false            also a headless Service <name>-headless (clients balance over its pods)
  "configMount" false         mount the run config at /etc/overworld
  "shm" ""                    size of an in-memory /dev/shm, "" for none)
*/}}
{{- define "overworld.component" -}}
{{- $ := .context -}}
{{- $v := .values -}}
{{- $labels := dict "context" $ "component" .component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ printf "%s-%s" (include "overworld.fullname" $) .component }}
  namespace: {{ $.Release.Namespace }}
  labels:
    {{- include "overworld.componentLabels" $labels | nindent 4 }}
  {{- include "overworld.annotations" (dict "context" $) | indent 2 }}
spec:
  {{- if .singleton }}
  replicas: 1
  strategy:
    type: Recreate
  {{- else }}
  {{- /* null: kubectl scale or an HPA owns the size (never declared, so never reset or contested) */}}
  {{- if not (kindIs "invalid" $v.replicaCount) }}
  replicas: {{ $v.replicaCount }}
  {{- end }}
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 25%
      maxUnavailable: 25%
  {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "overworld.componentSelectorLabels" $labels | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "overworld.componentLabels" $labels | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if or .configMount $v.podAnnotations }}
      annotations:
        {{- if .configMount }}
        checksum/run-config: {{ include (print $.Template.BasePath "/configmap.yaml") $ | sha256sum }}
        {{- end }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "overworld.serviceAccountName" $ }}
      automountServiceAccountToken: {{ $.Values.serviceAccount.automountServiceAccountToken }}
      {{- include "overworld.imagePullSecrets" $ | nindent 6 }}
      securityContext:
        {{- toYaml $.Values.podSecurityContext | nindent 8 }}
      {{- with $v.terminationGracePeriodSeconds }}
      terminationGracePeriodSeconds: {{ . }}
      {{- end }}
      {{- include "overworld.scheduling" $v | nindent 6 }}
      containers:
        - name: {{ .component }}
          image: {{ include "overworld.image" (dict "image" .image "context" $) }}
          imagePullPolicy: {{ .image.pullPolicy }}
          # A service that refuses to run (exit 78: the user's generator raised) logged the traceback
          # once: the pod's status shows it.
          terminationMessagePolicy: FallbackToLogsOnError
          # No command: the image's entrypoint runs (`overworld`, or `xvfb-run -a overworld` in the
          # Minecraft worker image, which needs a display for the game).
          args:
            - serve
            - {{ .component }}
            {{- with $v.extraArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- $env := concat (fromYamlArray (include "overworld.env.ports" (dict "context" $ "port" $v.port)))
                (fromYamlArray (include "overworld.env.security" (dict "context" $ "identity" .component))) }}
          {{- if $v.weightsPort }}
          {{- $env = append $env (dict "name" "OVERWORLD_WEIGHTS_PORT" "value" (toString $v.weightsPort)) }}
          {{- end }}
          {{- if $v.publishPort }}
          {{- $env = append $env (dict "name" "OVERWORLD_PUBLISH_PORT" "value" (toString $v.publishPort)) }}
          {{- end }}
          {{- if and (eq .component "rollout-worker") $v.terminationGracePeriodSeconds }}
          {{- /* the stop fits in the grace period: the flush gets what the loop, report and deregister leave */}}
          {{- $flush := max 5 (sub (int $v.terminationGracePeriodSeconds) 20) }}
          {{- $env = append $env (dict "name" "OVERWORLD_FLUSH_TIMEOUT" "value" (toString $flush)) }}
          {{- end }}
          env:
            {{- toYaml (concat $env (.env | default list) ($v.extraEnv | default list)) | nindent 12 }}
          ports:
            - name: grpc
              containerPort: {{ $v.port }}
              protocol: TCP
            {{- if $v.weightsPort }}
            - name: weights
              containerPort: {{ $v.weightsPort }}
              protocol: TCP
            {{- end }}
            {{- if $v.publishPort }}
            - name: publish
              containerPort: {{ $v.publishPort }}
              protocol: TCP
            {{- end }}
            - name: health
              containerPort: {{ $.Values.tls.healthPort }}
              protocol: TCP
            {{- if $.Values.metrics.enabled }}
            - name: metrics
              containerPort: {{ $.Values.metrics.port }}
              protocol: TCP
            {{- end }}
          startupProbe:
            grpc:
              port: {{ $.Values.tls.healthPort }}
            periodSeconds: 5
            failureThreshold: 60
          livenessProbe:
            grpc:
              port: {{ $.Values.tls.healthPort }}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 6
          readinessProbe:
            grpc:
              port: {{ $.Values.tls.healthPort }}
            periodSeconds: 5
            timeoutSeconds: 3
            failureThreshold: 3
          resources:
            {{- $resources := deepCopy $v.resources }}
            {{- if and .gpu .gpu.enabled }}
            {{- $limits := default (dict) $resources.limits }}
            {{- $_ := set $limits .gpu.resourceName .gpu.count }}
            {{- $_ := set $resources "limits" $limits }}
            {{- end }}
            {{- toYaml $resources | nindent 12 }}
          securityContext:
            {{- toYaml $.Values.containerSecurityContext | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- include "overworld.tls.volumeMount" $ | nindent 12 }}
            {{- if .configMount }}
            - name: run-config
              mountPath: /etc/overworld
              readOnly: true
            {{- end }}
            {{- if .shm }}
            - name: dshm
              mountPath: /dev/shm
            {{- end }}
      volumes:
        - name: tmp
          emptyDir: {}
        {{- include "overworld.tls.volume" (dict "context" $ "identity" .component) | nindent 8 }}
        {{- if .configMount }}
        - name: run-config
          configMap:
            name: {{ include "overworld.configMapName" $ }}
        {{- end }}
        {{- if .shm }}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ .shm }}
        {{- end }}
{{- if .service }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ printf "%s-%s" (include "overworld.fullname" $) .component }}
  namespace: {{ $.Release.Namespace }}
  labels:
    {{- include "overworld.componentLabels" $labels | nindent 4 }}
  {{- include "overworld.annotations" (dict "context" $) | indent 2 }}
spec:
  type: ClusterIP
  selector:
    {{- include "overworld.componentSelectorLabels" $labels | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    {{- if $v.weightsPort }}
    - name: weights
      port: {{ $v.weightsPort }}
      targetPort: weights
      protocol: TCP
    {{- end }}
    {{- if $v.publishPort }}
    - name: publish
      port: {{ $v.publishPort }}
      targetPort: publish
      protocol: TCP
    {{- end }}
    {{- if $.Values.metrics.enabled }}
    - name: metrics
      port: {{ $.Values.metrics.port }}
      targetPort: metrics
      protocol: TCP
      appProtocol: http
    {{- end }}
{{- end }}
{{- if .headless }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ printf "%s-%s-headless" (include "overworld.fullname" $) .component }}
  namespace: {{ $.Release.Namespace }}
  labels:
    {{- include "overworld.componentLabels" $labels | nindent 4 }}
    overworld.dev/headless: "true"
  {{- include "overworld.annotations" (dict "context" $) | indent 2 }}
spec:
  clusterIP: None
  selector:
    {{- include "overworld.componentSelectorLabels" $labels | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
{{- end }}
{{- end -}}
