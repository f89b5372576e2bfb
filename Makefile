# The two commands of the README: `make serve` (the main job) and `make test` (also CI's: .ci/run).
# Both do all set-up on a fresh machine: a virtualenv with the pinned dependencies.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

.PHONY: setup browser test test-fast serve demo proto clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

# Headless Chromium for the web page's test (tests/test_page.py): Debian's packages, installed where
# we may (CI runs as root); elsewhere that test is skipped and says why.
browser:
	@command -v chromedriver >/dev/null || [ "$$(id -u)" != 0 ] || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; }

# The whole suite; the slowest tests are listed at the end, so that a slow one shows in CI's log.
test: setup browser
	$(PY) -m pytest -q --durations=15

# The loop while editing: what does not train models, start servers or fuzz at volume (not marked slow).
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# Serve every model under models/ over gRPC (50051) and HTTP/JSON (8080), with metrics on 9090. Shipped checkpoints are
# exported to ONNX and verified on first start (cached in ~/.cache/gret-serve); ARGS adds flags,
# e.g. make serve ARGS="--port 50052 --batching request".
serve: setup
	$(PY) -m server $(ARGS)

# proto/*_pb2*.py from proto/gret_serve.proto (tests/test_proto.py checks they are current).
proto: setup
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/gret_serve.proto

# Translate a few Multi30K test sentences with the shipped de->en model
# (trained here first if models/ does not have it).
demo: setup
	$(PY) -m training.demo

clean:
	rm -rf $(VENV) runs

# Container image with podman (deploy/README.md): the wheelhouse is filled from the package index on
# the host, the Debian base is made with debootstrap, then the build runs offline and exports and
# verifies the shipped models against the evaluation data (SHARED_DATA).
IMAGE ?= gret-serve:dev
BASE_IMAGE ?= localhost/gret-serve-base:bookworm
SHARED_DATA ?= ../shared/data
.PHONY: image
image:
	PYTHON=$(PYTHON) deploy/wheelhouse.sh
	BASE_IMAGE=$(BASE_IMAGE) deploy/build-local-base.sh
	podman build --isolation=chroot --format docker --build-arg BASE_IMAGE=$(BASE_IMAGE) \
		--build-context data=$(abspath $(SHARED_DATA)) -t $(IMAGE) .
	podman image ls $(IMAGE)
