#!/usr/bin/env bash
# Checks the Helm chart in charts/ferry with both Helm majors, failing on the first error:
#   1. helm lint --strict, with the default values and with charts/ferry/ci/all-features-values.yaml,
#      under helm v4 and helm v3;
#   2. helm template with the defaults, with every optional feature on (the ci/ values file), and
#      with the optional parts off (metrics, cache, tokens), under both; the rendered manifests go to
#      $CHART_OUT (default: a temporary directory) for a later apply against a real API server;
#   3. the values schema refuses an unknown key, a node without a memory limit and a malformed
#      allowed endpoint, an existingPrefix other than deny/allow, and the chart a deletePolicy:
#      delete StorageClass whose prefix template volumes could share; existingPrefix reaches only
#      the StorageClass that sets it (the opt-in is per class); the allowed endpoints
#      (s3.allowedEndpoints and the StorageClasses' own) reach both binaries;
#   4. helm v4 and v3 render the same objects, and the default manifests hold what the driver
#      relies on (CSIDriver fields, provisioner flags, privileged node with Bidirectional kubelet
#      dir and /dev/fuse, the memory limit wired to the budget, the handover and fd holder wiring,
#      the built-in kubelet registration and /healthz, ...), and no token-creating RBAC; the
#      optional sidecars, hostNetwork and the API server override render where asked for only.
# Applying the manifests to an API server is the Kubernetes e2e's job, not this script's.
# Needs `helm` (v4) and `helm3` (v3) on PATH or in $FERRY_TOOLS (default ~/.cache/ferry-tools/bin),
# where scripts/kube-tools.sh builds them. Needs no cluster.
set -euo pipefail
cd "$(dirname "$0")/.."

FERRY_TOOLS=${FERRY_TOOLS:-$HOME/.cache/ferry-tools/bin}
export PATH="$FERRY_TOOLS:$PATH"
CHART=charts/ferry
ALL=$CHART/ci/all-features-values.yaml
# The API version the manifests are rendered for (Capabilities.KubeVersion); helm v3 otherwise
# assumes an old default.
KUBE_VERSION=${KUBE_VERSION:-1.36.0}
RELEASE=ferry
NAMESPACE=ferry-system

step() { printf '\n\033[1m==> %s\033[0m\n' "$*" >&2; }
fail() { echo "chart-check: $*" >&2; exit 1; }

for h in helm helm3; do
  command -v "$h" >/dev/null || fail "$h not found on PATH or in $FERRY_TOOLS (scripts/kube-tools.sh builds it)"
done
helm version --short | grep '^v4\.' >/dev/null || fail "helm is not helm v4: $(helm version --short)"
helm3 version --short | grep '^v3\.' >/dev/null || fail "helm3 is not helm v3: $(helm3 version --short)"

if [ -n "${CHART_OUT:-}" ]; then
  OUT=$CHART_OUT
  mkdir -p "$OUT"
else
  OUT=$(mktemp -d)
  trap 'rm -rf "$OUT"' EXIT
fi

# Values that turn every optional part off, beside the defaults (which have most of them on).
MINIMAL=(--set metrics.enabled=false --set node.cache.enabled=false --set 'csiDriver.tokenRequests=null'
  --set node.fdHolder.enabled=false
  --set controller.priorityClassName= --set node.priorityClassName= --set controller.replicas=1)

for h in helm helm3; do
  step "$h lint --strict (defaults, all features)"
  "$h" lint --strict --kube-version "$KUBE_VERSION" "$CHART"
  "$h" lint --strict --kube-version "$KUBE_VERSION" "$CHART" -f "$ALL"

  step "$h template (defaults, all features, minimal) -> $OUT/$h-*.yaml"
  "$h" template "$RELEASE" "$CHART" --namespace "$NAMESPACE" --kube-version "$KUBE_VERSION" \
    >"$OUT/$h-defaults.yaml"
  "$h" template "$RELEASE" "$CHART" --namespace "$NAMESPACE" --kube-version "$KUBE_VERSION" \
    -f "$ALL" >"$OUT/$h-all-features.yaml"
  "$h" template "$RELEASE" "$CHART" --namespace "$NAMESPACE" --kube-version "$KUBE_VERSION" \
    "${MINIMAL[@]}" >"$OUT/$h-minimal.yaml"

  step "$h: the schema refuses bad values"
  if "$h" template "$RELEASE" "$CHART" --set node.cache.maxsize=1GiB >/dev/null 2>&1; then
    fail "$h accepted an unknown key (node.cache.maxsize): values.schema.json is not strict"
  fi
  if "$h" template "$RELEASE" "$CHART" --set node.resources.limits=null >/dev/null 2>&1; then
    fail "$h accepted a node without a memory limit"
  fi
  if "$h" template "$RELEASE" "$CHART" --set-json \
    'storageClasses=[{"name":"x","bucketName":"bkt","prefixTemplate":"${pvc.name}","deletePolicy":"delete"}]' \
    >/dev/null 2>&1; then
    fail "$h accepted deletePolicy delete with a prefix template that volumes can share"
  fi
  if "$h" template "$RELEASE" "$CHART" --set-json \
    'storageClasses=[{"name":"x","bucketName":"bkt","existingPrefix":"yes"}]' >/dev/null 2>&1; then
    fail "$h accepted existingPrefix yes (the driver takes deny or allow)"
  fi
  if "$h" template "$RELEASE" "$CHART" --set-json \
    'storageClasses=[{"name":"x","bucketName":"bkt","parameters":{"deletePolicy":"delete"}}]' >/dev/null 2>&1; then
    fail "$h accepted a StorageClass parameter under parameters that the entry has a field for (deletePolicy)"
  fi
  if "$h" template "$RELEASE" "$CHART" --set-json 's3.allowedEndpoints=["ftp://x"]' >/dev/null 2>&1; then
    fail "$h accepted an allowed endpoint pattern the driver refuses (ftp://x)"
  fi
  if "$h" template "$RELEASE" "$CHART" --set node.updateStrategy.rollingUpdate.maxSurge=0 >/dev/null 2>&1; then
    fail "$h accepted maxSurge 0 with maxUnavailable 0 (the API server refuses it)"
  fi
  if "$h" template "$RELEASE" "$CHART" --set metrics.enabled=false --set metrics.serviceMonitor.enabled=true >/dev/null 2>&1; then
    fail "$h accepted a ServiceMonitor without metrics (it would silently create none)"
  fi
  "$h" template "$RELEASE" "$CHART" --kube-version "$KUBE_VERSION" --set node.updateStrategy.type=OnDelete >"$OUT/$h-ondelete.yaml"
  ! awk '/^kind: DaemonSet/{d=1} /^---/{d=0} d' "$OUT/$h-ondelete.yaml" | grep 'maxSurge:' >/dev/null || fail "$h: node.updateStrategy.type OnDelete kept a rollingUpdate (the API server refuses it)"
  if "$h" template "$RELEASE" "$CHART" --set node.terminationGracePeriodSeconds=30 >/dev/null 2>&1; then
    fail "$h accepted a grace period that does not exceed the handover wait (30s)"
  fi
  if "$h" template "$RELEASE" "$CHART" --set node.hostNetwork=true --set controller.hostNetwork=true \
    --set controller.healthPort=9808 --set controller.metricsPort=9811 >/dev/null 2>&1; then
    fail "$h accepted the same health port for node and controller pods both on the host network"
  fi
  if "$h" template "$RELEASE" "$CHART" --set node.hostNetwork=true --set controller.hostNetwork=true \
    >/dev/null 2>&1; then
    fail "$h accepted the same metrics port for node and controller pods both on the host network"
  fi

  step "$h: the allowed endpoints reach both binaries, with the StorageClasses' own"
  # Only a StorageClass's endpoint: the default (aws) plus it, path and mount-option form alike.
  "$h" template "$RELEASE" "$CHART" --namespace "$NAMESPACE" --kube-version "$KUBE_VERSION" --set-json \
    'storageClasses=[{"name":"x","bucketName":"bkt","endpointUrl":"https://minio.lan:9000/base"},{"name":"y","bucketName":"bkt","mountOptions":["endpoint-url http://rgw.lan:7480"]}]' \
    >"$OUT/$h-sc-endpoint.yaml"
  [ "$(grep -c 'value: "aws,https://minio.lan:9000,http://rgw.lan:7480"' "$OUT/$h-sc-endpoint.yaml")" = 2 ] ||
    fail "$h: a StorageClass's endpoint is not added to FERRY_ALLOWED_ENDPOINTS of both binaries"
  [ "$(grep -c 'value: "aws,https://\*.example.com:9000,https://minio.example.com"' "$OUT/$h-all-features.yaml")" = 2 ] ||
    fail "$h: s3.allowedEndpoints and the StorageClasses' endpoints do not reach both binaries"
  ! grep -q FERRY_ALLOWED_ENDPOINTS "$OUT/$h-defaults.yaml" || fail "$h: the defaults must leave the driver's default list"
done

step "helm v4 and v3 render the same manifests (blank lines aside)"
for v in defaults all-features minimal; do
  diff -u <(grep -v '^[[:space:]]*$' "$OUT/helm-$v.yaml") <(grep -v '^[[:space:]]*$' "$OUT/helm3-$v.yaml") ||
    fail "helm and helm3 differ on $v"
done

step "what the driver relies on is in the default manifests"
# Each line: a fixed string that must appear in the defaults (what kubelet, csi-provisioner and
# the binaries need; see the issue's list and doc/ARCHITECTURE.md).
# Comments are left out: they may name a setting without setting it.
grep -v '^[[:space:]]*#' "$OUT/helm-defaults.yaml" >"$OUT/defaults-no-comments.yaml"
while IFS= read -r want; do
  grep -qF -- "$want" "$OUT/defaults-no-comments.yaml" || fail "the default manifests lack: $want"
done <<'WANT'
name: s3.csi.ferry.dev
attachRequired: false
podInfoOnMount: true
requiresRepublish: true
serviceAccountTokenInSecrets: true
- audience: sts.amazonaws.com
- audience: pods.eks.amazonaws.com
- --extra-create-metadata
- --leader-election
replicas: 2
mountPropagation: Bidirectional
privileged: true
priorityClassName: system-node-critical
path: /dev/fuse
resource: limits.memory
name: FERRY_MEMORY_BUDGET
name: FERRY_CACHE_DIR
- --kubelet-registration-path=/var/lib/kubelet/plugins/s3.csi.ferry.dev/csi.sock
- --registration-dir=/registration
path: /var/lib/kubelet/plugins_registry
- --health-addr=:9808
- --health-addr=:9807
- --node-id=$(NODE_ID)
fieldPath: spec.nodeName
fieldPath: metadata.uid
maxSurge: 1
maxUnavailable: 0
name: FERRY_HANDOVER_WAIT
- --holder-socket=/holder/holder.sock
command: ["ferry-fd-holder"]
- --socket=/holder/holder.sock
mountPath: /holder
readOnlyRootFilesystem: true
runAsNonRoot: true
WANT
if grep -qE '^[[:space:]]*resources:.*serviceaccounts/token' "$OUT/helm-defaults.yaml" "$OUT/helm-all-features.yaml"; then
  fail "the node plugin must not be allowed to create tokens (kubelet passes them)"
fi

! grep -q 'holder' <(grep -v '^[[:space:]]*#' "$OUT/helm-minimal.yaml") || fail "node.fdHolder.enabled=false still wires a holder"
grep -q 'FERRY_NO_CACHE_PASSTHROUGH' "$OUT/helm-all-features.yaml" || fail "node.cache.passthrough=false does not reach the node plugin"
! grep -q 'FERRY_NO_CACHE_PASSTHROUGH' "$OUT/helm-defaults.yaml" || fail "passthrough must be on by default"

step "built-in registration and health by default; sidecars, hostNetwork, API override on request"
D=$OUT/defaults-no-comments.yaml
A=$OUT/all-features-no-comments.yaml
grep -v '^[[:space:]]*#' "$OUT/helm-all-features.yaml" >"$A"
! grep -qE 'csi-node-driver-registrar|sig-storage/livenessprobe' "$D" || fail "the defaults must not run the registrar or livenessprobe sidecars"
! grep -qE 'hostNetwork|KUBERNETES_SERVICE_HOST' "$D" || fail "the defaults must stay off the host network and use the kubernetes Service"
[ "$(grep -c 'path: /healthz' "$D")" = 3 ] && [ "$(grep -c 'readinessProbe:' "$D")" = 1 ] ||
  fail "both pods need a liveness probe on /healthz, and the node plugin a readiness probe (an update waits for the handover)"
! grep -q 'readinessProbe:' "$A" || fail "on the host network or with the livenessprobe sidecar a readiness probe would ask the old pod"
grep -qF -- '- --http-endpoint=:9809' "$A" || fail "sidecars.nodeDriverRegistrar.enabled does not run the registrar"
grep -qF -- '- --health-port=9808' "$A" || fail "sidecars.livenessProbe.enabled does not run livenessprobe"
! grep -qE -- '--registration-dir|--health-addr' "$A" ||
  fail "with the sidecars on, the built-in registration and /healthz must be off (they would fight over the socket and port)"
[ "$(grep -c 'hostNetwork: true' "$A")" = 2 ] || fail "node.hostNetwork/controller.hostNetwork do not reach both pods"
[ "$(grep -c 'dnsPolicy: ClusterFirstWithHostNet' "$A")" = 2 ] || fail "hostNetwork pods need dnsPolicy ClusterFirstWithHostNet"
# ferry-controller, csi-provisioner and ferry-node.
[ "$(grep -c 'name: KUBERNETES_SERVICE_HOST' "$A")" = 3 ] || fail "kubernetesApi.host does not reach every API client"
grep -qF 'value: "6443"' "$A" || fail "kubernetesApi.port does not reach the API clients"
# On the host network no pod declares a port: it would be a hostPort that keeps the new pod of an
# update from being scheduled beside the old one. The controller's old pod stops first.
! grep -q 'containerPort' "$A" || fail "a pod on the host network must not declare containerPorts"
# Not `grep -q` after a pipe: under pipefail, a grep that quits at its first match leaves awk
# writing to a closed pipe (SIGPIPE, status 141), and the check fails when it holds.
awk '/^kind: Deployment/{d=1} /^---/{d=0} d' "$A" | grep 'maxSurge: 0' >/dev/null ||
  fail "a controller on the host network must stop an old pod before its replacement starts"
grep -qF -- '- --health-port=9807' "$A" || fail "the controller's livenessprobe sidecar must serve controller.healthPort"
# The existing-prefix opt-in is per class: only ferry-shared-datasets sets it.
[ "$(grep -c 'existingPrefix: "allow"' "$A")" = 1 ] && [ "$(grep -c existingPrefix "$A")" = 1 ] ||
  fail "storageClasses[].existingPrefix must reach the StorageClass that sets it, and no other"

# StorageClass parameters beyond the entry's fields, and csi-provisioner's Secret access with them.
for want in 'authenticationSource: "pod"' 'stsRegion: "eu-west-1"' 'cache: "none"' 'prefetchOnMount: "train/"' \
  'csi.storage.k8s.io/provisioner-secret-name: "minio-keys"' 'csi.storage.k8s.io/node-publish-secret-namespace: "${pvc.namespace}"'; do
  grep -qF -- "$want" "$A" || fail "storageClasses[] does not render $want"
done
grep -qF 'resources: ["secrets"]' "$A" ||
  fail "a chart StorageClass naming a provisioner Secret must let csi-provisioner get Secrets"
! grep -qF 'resources: ["secrets"]' "$D" || fail "csi-provisioner must not read Secrets by default"

step "the rendered objects"
for v in defaults all-features minimal; do
  printf '%-13s %s\n' "$v:" "$(grep -E '^kind: ' "$OUT/helm-$v.yaml" | sort | uniq -c | awk '{printf "%s%s %s", (NR > 1 ? ", " : ""), $1, $3}')" >&2
done
echo "chart-check: ok${CHART_OUT:+ (rendered manifests in $CHART_OUT)}" >&2
