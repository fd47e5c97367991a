{{/*
Chart name (app.kubernetes.io/name).
*/}}
{{- define "overworld.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Prefix of every object name. It is the release name (not <release>-<chart>) so that the
objects are the ones the docs name: deployment/<release>-rollout-worker,
<release>-rollout-manager:50051. Truncated so that "<prefix>-rollout-manager" fits 63.
*/}}
{{- define "overworld.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "overworld.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Labels on every object.
*/}}
{{- define "overworld.labels" -}}
helm.sh/chart: {{ include "overworld.chart" . }}
app.kubernetes.io/name: {{ include "overworld.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: overworld
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "overworld.selectorLabels" -}}
app.kubernetes.io/name: {{ include "overworld.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/*
Labels of one component. Usage: include "overworld.componentLabels" (dict "context" $ "component" "gae")
*/}}
{{- define "overworld.componentLabels" -}}
{{ include "overworld.labels" .context }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "overworld.componentSelectorLabels" -}}
{{ include "overworld.selectorLabels" .context }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
Common annotations (metadata.annotations), rendered only when there are any.
Usage: include "overworld.annotations" (dict "context" $ "extra" $someMap)
*/}}
{{- define "overworld.annotations" -}}
{{- $all := merge (deepCopy (default (dict) .extra)) (deepCopy .context.Values.commonAnnotations) -}}
{{- if $all }}
annotations:
  {{- toYaml $all | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
A full image reference. Usage: include "overworld.image" (dict "image" .Values.image "context" $)
The tag defaults to the chart's appVersion; a digest wins over the tag.
*/}}
{{- define "overworld.image" -}}
{{- $registry := default .image.registry .context.Values.global.imageRegistry -}}
{{- $repository := .image.repository -}}
{{- $name := ternary $repository (printf "%s/%s" $registry $repository) (empty $registry) -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $name .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $name (default .context.Chart.AppVersion .image.tag | toString) -}}
{{- end -}}
{{- end -}}

{{- define "overworld.imagePullSecrets" -}}
{{- with .Values.global.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "overworld.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "overworld.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
host:port of an Overworld service inside the namespace. Usage:
include "overworld.address" (dict "context" $ "component" "rollout-manager" "port" 50051)
*/}}
{{- define "overworld.address" -}}
{{- printf "%s-%s:%v" (include "overworld.fullname" .context) .component .port -}}
{{- end -}}

{{- define "overworld.redisName" -}}
{{- printf "%s-redis" (include "overworld.fullname" .) -}}
{{- end -}}

{{- define "overworld.objectStoreName" -}}
{{- printf "%s-seaweedfs" (include "overworld.fullname" .) -}}
{{- end -}}

{{- define "overworld.configMapName" -}}
{{- printf "%s-run-config" (include "overworld.fullname" .) -}}
{{- end -}}

{{- define "overworld.trainingRunName" -}}
{{- default (include "overworld.fullname" .) .Values.trainingRun.name -}}
{{- end -}}

{{/*
Secret holding the S3 credentials, and its keys.
*/}}
{{- define "overworld.s3SecretName" -}}
{{- if .Values.seaweedfs.enabled -}}
{{- default (printf "%s-s3" (include "overworld.fullname" .)) .Values.seaweedfs.auth.existingSecret -}}
{{- else -}}
{{- .Values.externalS3.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "overworld.s3AccessKeyKey" -}}
{{- ternary "access-key" .Values.externalS3.accessKeyKey .Values.seaweedfs.enabled -}}
{{- end -}}

{{- define "overworld.s3SecretKeyKey" -}}
{{- ternary "secret-key" .Values.externalS3.secretKeyKey .Values.seaweedfs.enabled -}}
{{- end -}}

{{- define "overworld.s3Endpoint" -}}
{{- if .Values.seaweedfs.enabled -}}
{{- printf "http://%s:8333" (include "overworld.objectStoreName" .) -}}
{{- else -}}
{{- .Values.externalS3.endpoint -}}
{{- end -}}
{{- end -}}

{{/*
The environment of the containers, as data: each "overworld.env.*" renders a list of EnvVar objects
(toYaml), which the templates read back with fromYamlArray, join with concat and write with toYaml.
*/}}
{{- define "overworld.envFromSecret" -}}
{{- toYaml (dict "name" .name "valueFrom" (dict "secretKeyRef" (dict "name" .secret "key" .key))) -}}
{{- end -}}

{{/*
Environment of the services that keep their data in the object store (--blobs), and the S3
endpoint and credentials alone for the trainer (its save_path is s3://, it takes no --blobs).
*/}}
{{- define "overworld.env.objectStore" -}}
{{- $blobs := dict "name" "OVERWORLD_BLOBS" "value" (printf "s3://%s/%s" .Values.objectStore.bucket .Values.objectStore.prefix) -}}
{{- toYaml (prepend (fromYamlArray (include "overworld.env.s3" .)) $blobs) -}}
{{- end -}}

{{- define "overworld.env.s3" -}}
{{- $secret := include "overworld.s3SecretName" . -}}
{{- toYaml (list
  (dict "name" "OVERWORLD_S3_ENDPOINT" "value" (include "overworld.s3Endpoint" .))
  (fromYaml (include "overworld.envFromSecret" (dict "name" "OVERWORLD_S3_ACCESS_KEY" "secret" $secret "key" (include "overworld.s3AccessKeyKey" .))))
  (fromYaml (include "overworld.envFromSecret" (dict "name" "OVERWORLD_S3_SECRET_KEY" "secret" $secret "key" (include "overworld.s3SecretKeyKey" .))))) -}}
{{- end -}}

{{/*
OVERWORLD_INDEX: the bundled Redis, an external URL, or an external URL from a Secret.
*/}}
{{- define "overworld.env.index" -}}
{{- if .Values.redis.enabled -}}
{{- toYaml (list
  (dict "name" "OVERWORLD_INDEX" "value" (printf "redis://%s:6379/0" (include "overworld.redisName" .)))
  (fromYaml (include "overworld.envFromSecret" (dict "name" "OVERWORLD_REDIS_PASSWORD" "secret" (include "overworld.redisSecretName" .) "key" .Values.redis.auth.passwordKey)))) -}}
{{- else if .Values.externalRedis.existingSecret -}}
{{- toYaml (list (fromYaml (include "overworld.envFromSecret" (dict "name" "OVERWORLD_INDEX" "secret" .Values.externalRedis.existingSecret "key" .Values.externalRedis.urlKey)))) -}}
{{- else -}}
{{- toYaml (list (dict "name" "OVERWORLD_INDEX" "value" (toString .Values.externalRedis.url))) -}}
{{- end -}}
{{- end -}}

{{/*
Environment every Overworld service gets: its ports.
Usage: include "overworld.env.ports" (dict "context" $ "port" 50051)
*/}}
{{- define "overworld.env.ports" -}}
{{- toYaml (list
  (dict "name" "OVERWORLD_HOST" "value" "0.0.0.0")
  (dict "name" "OVERWORLD_PORT" "value" (toString .port))
  (dict "name" "OVERWORLD_METRICS_PORT" "value" (toString (ternary .context.Values.metrics.port 0 .context.Values.metrics.enabled)))) -}}
{{- end -}}

{{/*
Addresses of the services, by the flag names of docs/architecture.md.
*/}}
{{- define "overworld.env.rolloutManager" -}}
{{- toYaml (list (dict "name" "OVERWORLD_ROLLOUT_MANAGER" "value" (include "overworld.address" (dict "context" . "component" "rollout-manager" "port" .Values.rolloutManager.port)))) -}}
{{- end -}}

{{/*
The replicated fronts are reached through their headless Services: DNS gives the client every
ready pod and the client balances its calls over them (gRPC round_robin); a ClusterIP would pin
each long-lived connection to one pod.
*/}}
{{- define "overworld.env.replayBuffer" -}}
{{- toYaml (list (dict "name" "OVERWORLD_REPLAY_BUFFER" "value" (include "overworld.address" (dict "context" . "component" "replay-buffer-headless" "port" .Values.replayBuffer.port)))) -}}
{{- end -}}

{{- define "overworld.env.gae" -}}
{{- toYaml (list (dict "name" "OVERWORLD_GAE" "value" (include "overworld.address" (dict "context" . "component" "gae-headless" "port" .Values.gae.port)))) -}}
{{- end -}}

{{- define "overworld.env.modelRegistry" -}}
{{- toYaml (list (dict "name" "OVERWORLD_MODEL_REGISTRY" "value" (include "overworld.address" (dict "context" . "component" "model-registry" "port" .Values.modelRegistry.port)))) -}}
{{- end -}}

{{/*
The environment of the trainer (in the RayJob's head and worker pods).
*/}}
{{- define "overworld.env.trainer" -}}
{{- toYaml (concat
  (fromYamlArray (include "overworld.env.ports" (dict "context" . "port" .Values.trainer.port)))
  (fromYamlArray (include "overworld.env.rolloutManager" .))
  (fromYamlArray (include "overworld.env.replayBuffer" .))
  (fromYamlArray (include "overworld.env.gae" .))
  (fromYamlArray (include "overworld.env.modelRegistry" .))
  (fromYamlArray (include "overworld.env.s3" .))
  (list
    (dict "name" "OVERWORLD_SAVE_PATH" "value" (printf "s3://%s/%s" .Values.objectStore.bucket .Values.objectStore.prefix))
    (dict "name" "OVERWORLD_WORKDIR" "value" "/tmp/overworld"))
  (.Values.trainer.extraEnv | default list)) -}}
{{- end -}}

{{/*
Pod-level scheduling block: nodeSelector, tolerations, affinity, topologySpreadConstraints,
priorityClassName, runtimeClassName. Usage: include "overworld.scheduling" .Values.gae
*/}}
{{- define "overworld.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . | quote }}
{{- end }}
{{- with .runtimeClassName }}
runtimeClassName: {{ . | quote }}
{{- end }}
{{- end -}}

{{/*
Checks of the values that the JSON schema cannot express.
*/}}
{{- define "overworld.validateValues" -}}
{{- if and (not .Values.seaweedfs.enabled) (not .Values.externalS3.endpoint) -}}
{{- fail "seaweedfs.enabled=false needs externalS3.endpoint (an S3 endpoint such as https://s3.amazonaws.com)" -}}
{{- end -}}
{{- if and (not .Values.seaweedfs.enabled) (not .Values.externalS3.existingSecret) -}}
{{- fail "seaweedfs.enabled=false needs externalS3.existingSecret (a Secret with the access and secret keys)" -}}
{{- end -}}
{{- if and (not .Values.redis.enabled) (not .Values.externalRedis.url) (not .Values.externalRedis.existingSecret) -}}
{{- fail "redis.enabled=false needs externalRedis.url or externalRedis.existingSecret" -}}
{{- end -}}
{{- end -}}

{{/*
Security of one Overworld process: its identity's certificate (tls.yaml) at /etc/overworld/tls, or
plaintext said out loud; and the plaintext health-only port the probes use (kubelet sends no
client certificate). Usage: include "overworld.env.security" (dict "context" $ "identity" "gae")
*/}}
{{- define "overworld.env.security" -}}
{{- $tls := ternary (dict "name" "OVERWORLD_TLS_DIR" "value" "/etc/overworld/tls") (dict "name" "OVERWORLD_INSECURE" "value" "true") .context.Values.tls.enabled -}}
{{- toYaml (list (dict "name" "OVERWORLD_HEALTH_PORT" "value" (toString .context.Values.tls.healthPort)) $tls) -}}
{{- end -}}

{{- define "overworld.tls.secretName" -}}
{{- printf "%s-tls-%s" (include "overworld.fullname" .context) .identity -}}
{{- end -}}

{{- define "overworld.tls.volumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/overworld/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/*
Usage: include "overworld.tls.volume" (dict "context" $ "identity" "gae")
*/}}
{{- define "overworld.tls.volume" -}}
{{- if .context.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "overworld.tls.secretName" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/*
The bundled Redis' password Secret (generated once, kept across upgrades) or the user's.
*/}}
{{- define "overworld.redisSecretName" -}}
{{- default (include "overworld.redisName" .) .Values.redis.auth.existingSecret -}}
{{- end -}}
