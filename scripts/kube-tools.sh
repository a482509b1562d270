#!/usr/bin/env bash
# Builds the Kubernetes-level judges from the Go module proxy into $FERRY_TOOLS (default
# ~/.cache/ferry-tools/bin), each once per version (a stamp file remembers the version):
#   etcd v3.6.14, kube-apiserver, kube-controller-manager, kube-scheduler and kubelet v1.36.3, csi-provisioner v6.3.0, helm v4 and helm v3.
# Modules whose go.mod carries `replace` directives cannot be `go install`ed; they are built from a
# throwaway wrapper module under $FERRY_TOOLS/../src that copies the upstream module→module replaces
# and turns kubernetes' local ./staging replaces into the published k8s.io/X v0.N.M modules.
# Nothing is written into the repository. Called by scripts/setup.sh.
set -euo pipefail

FERRY_TOOLS=${FERRY_TOOLS:-$HOME/.cache/ferry-tools/bin}
FERRY_SRC=${FERRY_SRC:-$(dirname "$FERRY_TOOLS")/src}
ETCD_VERSION=v3.6.14
KUBE_VERSION=v1.36.3
PROVISIONER_VERSION=v6.3.0
HELM4_VERSION=v4.2.4
HELM3_VERSION=v3.21.4
mkdir -p "$FERRY_TOOLS" "$FERRY_SRC"
export GOFLAGS=-buildvcs=false CGO_ENABLED=0

log() { printf '\033[1m[kube-tools]\033[0m %s\n' "$*" >&2; }

fresh() { # fresh NAME VERSION: true when $FERRY_TOOLS/NAME is already that version
  [ -x "$FERRY_TOOLS/$1" ] && [ "$(cat "$FERRY_TOOLS/.$1.version" 2>/dev/null)" = "$2" ]
}
stamp() { echo "$2" >"$FERRY_TOOLS/.$1.version"; }

upstream_gomod() { # path of the go.mod the proxy serves for MODULE@VERSION
  go mod download -json "$1@$2" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p'
}

# wrapped NAME MODULE VERSION PACKAGE [STAGING_VERSION] [LDFLAGS]: builds PACKAGE (inside MODULE@VERSION)
# as $FERRY_TOOLS/NAME from a wrapper module.
wrapped() {
  local name=$1 module=$2 version=$3 package=$4 staging=${5:-} ldflags=${6:-}
  fresh "$name" "$version" && return
  log "building $name $version from the Go module proxy (wrapper module)"
  local dir="$FERRY_SRC/${module//\//_}-$version" gomod
  gomod=$(upstream_gomod "$module" "$version")
  [ -f "$dir/.ready" ] || rm -rf "$dir"
  mkdir -p "$dir"
  (
    cd "$dir"
    if [ ! -f .ready ]; then # one wrapper per MODULE@VERSION, shared by its commands
      go mod init "ferry.tools/wrapper" >/dev/null 2>&1
      # the Go version, godebug and module→module replaces of upstream
      local gover
      gover=$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$gomod" | head -1)
      go mod edit -go="$gover"
      { grep -E '^godebug ' "$gomod" || true; } >>go.mod
      # module→module replaces, single-line and inside replace ( ... ) blocks
      awk '/^replace \(/{b=1;next} b&&/^\)/{b=0;next} b{print;next} /^replace /{sub(/^replace /,"");print}' "$gomod" |
        while read -r from arrow to ver rest; do
          [ "$arrow" = "=>" ] || continue
          case "$to" in
            ./staging/*) [ -n "$staging" ] && go mod edit -replace="$from=$from@$staging" ;;
            ./* | ../*) ;; # local paths cannot come from the proxy: the require of MODULE pins them
            *) if [ -n "${ver:-}" ]; then go mod edit -replace="$from=$to@$ver"; else go mod edit -replace="$from=$to"; fi ;;
          esac
        done
    fi
    go get -tool "$package@$version"
    touch .ready
    go build -trimpath -ldflags "$ldflags" -o "$FERRY_TOOLS/$name" "$package"
  )
  stamp "$name" "$version"
}

installed() { # installed NAME MODULE_PACKAGE VERSION: plain go install
  fresh "$1" "$3" && return
  log "go install $2@$3"
  local tmp
  tmp=$(mktemp -d)
  GOBIN="$tmp" go install "$2@$3"
  mv "$tmp/$(basename "$2")" "$FERRY_TOOLS/$1"
  rmdir "$tmp"
  stamp "$1" "$3"
}

kube_minor=${KUBE_VERSION#v1.}
kube_minor=${kube_minor%%.*}
kube_ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$KUBE_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$kube_minor"

wrapped etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION" go.etcd.io/etcd/server/v3 "" "-s -w"
wrapped kube-apiserver k8s.io/kubernetes "$KUBE_VERSION" k8s.io/kubernetes/cmd/kube-apiserver \
  "v0.${KUBE_VERSION#v1.}" "$kube_ldflags"
wrapped kube-controller-manager k8s.io/kubernetes "$KUBE_VERSION" k8s.io/kubernetes/cmd/kube-controller-manager \
  "v0.${KUBE_VERSION#v1.}" "$kube_ldflags"
wrapped kube-scheduler k8s.io/kubernetes "$KUBE_VERSION" k8s.io/kubernetes/cmd/kube-scheduler \
  "v0.${KUBE_VERSION#v1.}" "$kube_ldflags"
wrapped kubelet k8s.io/kubernetes "$KUBE_VERSION" k8s.io/kubernetes/cmd/kubelet \
  "v0.${KUBE_VERSION#v1.}" "$kube_ldflags"
wrapped csi-provisioner github.com/kubernetes-csi/external-provisioner/v6 "$PROVISIONER_VERSION" \
  github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner "" "-s -w -X main.version=$PROVISIONER_VERSION"
installed helm helm.sh/helm/v4/cmd/helm "$HELM4_VERSION"
installed helm3 helm.sh/helm/v3/cmd/helm "$HELM3_VERSION"
log "kube tools ready in $FERRY_TOOLS"
