#!/usr/bin/env bash
# Fill deploy/wheelhouse/$VARIANT/ with a wheel for every pinned dependency of the image (pyproject.toml
# + deploy/requirements-server.txt, and everything they pull in) for linux x86_64, CPython 3.11.
# Runs on the host: the image build itself is offline (pip --no-index --find-links).
#
#   VARIANT=cpu  (default) torch must be the +cpu build: on this host it lies in pip's find-links;
#                elsewhere set TORCH_INDEX_URL to PyTorch's CPU wheel index.
#   VARIANT=cuda the plain PyPI torch (a CUDA build that pulls the nvidia-* runtime wheels, several GB);
#                or set TORCH_INDEX_URL to one of PyTorch's cuXYZ indexes for another CUDA version.
# Re-running is cheap: files already in the wheelhouse are kept.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VARIANT="${VARIANT:-cpu}"
PYTHON="${PYTHON:-python3}"
WHEELHOUSE="${WHEELHOUSE:-$ROOT/deploy/wheelhouse/$VARIANT}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-}"
# The base image is Debian bookworm (glibc 2.36): accept every manylinux wheel up to that.
GLIBC_MINOR_MAX=36

case "$VARIANT" in cpu|cuda) ;; *) echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 2 ;; esac

pip_cmd=("$PYTHON" -m pip)
if [[ "$VARIANT" == cuda ]]; then
    # Ignore this host's pip configuration: its find-links hold the +cpu torch, which would win.
    pip_cmd+=(--isolated)
fi
index_args=()
[[ -n "$TORCH_INDEX_URL" ]] && index_args+=(--extra-index-url "$TORCH_INDEX_URL")

mkdir -p "$WHEELHOUSE"
"$PYTHON" "$ROOT/deploy/requirements.py" > "$WHEELHOUSE/requirements.txt"
echo "wheelhouse: $WHEELHOUSE ($VARIANT), $(wc -l < "$WHEELHOUSE/requirements.txt") pinned requirements"

# 1. Packages published only as source (e.g. rouge-score, jieba) cannot be fetched as target wheels:
#    resolve once for the host, then build a wheel from each sdist found. They must be pure Python
#    (py3-none-any), or the wheel would only fit the host.
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
"${pip_cmd[@]}" download --quiet --dest "$scratch/resolved" "${index_args[@]}" -r "$WHEELHOUSE/requirements.txt"
shopt -s nullglob
for sdist in "$scratch"/resolved/*.tar.gz "$scratch"/resolved/*.zip; do
    "${pip_cmd[@]}" wheel --quiet --no-deps --wheel-dir "$scratch/built" "$sdist"
done
for wheel in "$scratch"/built/*.whl; do
    if [[ "$wheel" != *-none-any.whl ]]; then
        echo "wheelhouse: $(basename "$wheel") is not pure Python; build it for the target instead" >&2
        exit 1
    fi
    cp -n "$wheel" "$WHEELHOUSE/"
done

# 2. Every dependency as a wheel for the target platform; --find-links lets the resolver take the
#    wheels built in step 1, --only-binary proves nothing needs compiling inside the image build.
platform_args=()
for ((minor = GLIBC_MINOR_MAX; minor >= 17; minor--)); do
    platform_args+=(--platform "manylinux_2_${minor}_x86_64")
done
platform_args+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
"${pip_cmd[@]}" download --quiet --dest "$WHEELHOUSE" --find-links "$WHEELHOUSE" "${index_args[@]}" \
    --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 "${platform_args[@]}" \
    -r "$WHEELHOUSE/requirements.txt"

# The one mistake that costs gigabytes: the wrong torch build for the variant.
torch_wheels=("$WHEELHOUSE"/torch-*.whl)
if [[ ${#torch_wheels[@]} -ne 1 ]]; then
    echo "wheelhouse: expected exactly one torch wheel, found: ${torch_wheels[*]:-none}" >&2
    exit 1
fi
case "$VARIANT:$(basename "${torch_wheels[0]}")" in
    cpu:*+cpu-*) ;;
    cuda:*+cpu-*) echo "wheelhouse: VARIANT=cuda but torch is the CPU build" >&2; exit 1 ;;
    cpu:*) echo "wheelhouse: VARIANT=cpu but torch is not the +cpu build (set TORCH_INDEX_URL)" >&2; exit 1 ;;
esac

# The Dockerfile copies this list (the wheelhouse itself is only bind-mounted): it keys the build
# cache to the wheels' contents and lets the build check them.
(cd "$WHEELHOUSE" && sha256sum -- *.whl > SHA256SUMS)

echo "wheelhouse: $(find "$WHEELHOUSE" -name '*.whl' | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)"
