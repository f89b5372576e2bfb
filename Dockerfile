# gret-serve: the gRPC translation/summarisation server with its shipped models.
# The build never reaches a package index: fill deploy/wheelhouse/ on the host first (`make image`
# does every step; deploy/README.md explains them and the GPU variant).
#
#   podman build --isolation=chroot --format docker --build-context data=../shared/data -t gret-serve:dev .
#
# `--format docker` keeps HEALTHCHECK (the OCI image format has no field for it).

# Any image whose `python3` is CPython 3.11 with the venv module: by default the Debian bookworm
# base made by deploy/build-local-base.sh. The same base must serve both stages (the venv links to it).
ARG BASE_IMAGE=localhost/gret-serve-base:bookworm

# The evaluation data that the model preparation step checks each ONNX build against. Empty unless
# the build names it: `--build-context data=../shared/data` (podman >= 4.3, docker buildx).
FROM scratch AS data

FROM ${BASE_IMAGE} AS builder
# cpu | cuda: picks deploy/wheelhouse/$VARIANT, i.e. the torch build (and, for cuda, the nvidia-*
# runtime wheels that torch pulls in, which onnxruntime-gpu's CUDA provider uses as well).
ARG VARIANT=cpu
# 1: copy models/ into the image; 0: an empty /app/models to mount a volume on.
ARG BAKE_MODELS=1
# 1: export the shipped checkpoints to ONNX now and verify each export against its recorded
# validation score (needs the data build context), so that a container serves as soon as it starts.
ARG PREPARE_MODELS=1
ENV GRET_SERVE_CACHE=/var/cache/gret-serve \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Only COPY brings files into a layer here: buildah (podman) does not count the contents of a
# RUN --mount=type=bind in its layer cache key, so a bind-mounted input that changed would silently
# reuse a stale layer. The wheelhouse itself (~0.8 GB) is bind-mounted, so it never becomes a layer;
# its checksum list is copied instead, which both keys the cache and checks the wheels.
COPY pyproject.toml /build/
COPY deploy/requirements.py /build/deploy/
COPY deploy/wheelhouse/${VARIANT}/SHA256SUMS /build/wheelhouse.sha256

# Dependencies first (the slow layer). --no-index makes a wheel missing from the wheelhouse an error
# instead of a download. Then drop what nothing loads at run time (~0.6 GB): static libraries (*.a)
# in every variant; in the cpu variant also ONNX Runtime's CUDA/TensorRT providers (the backend
# asks for them only when torch sees CUDA, which the +cpu torch never does) and Triton's CUDA
# compiler binaries and profiler libraries (on CPU Triton only ever runs in its interpreter, in the
# tests, which the image does not hold).
RUN --mount=type=bind,source=deploy/wheelhouse,target=/wheelhouse \
    sed "s|  |  /wheelhouse/${VARIANT}/|" /build/wheelhouse.sha256 | sha256sum --quiet --strict --check - \
 && python3 -m venv /opt/venv \
 && python3 /build/deploy/requirements.py > /build/requirements.txt \
 && /opt/venv/bin/pip install --no-index --find-links "/wheelhouse/${VARIANT}" -r /build/requirements.txt \
 && /opt/venv/bin/pip check \
 && find /opt/venv -name '*.a' -delete \
 && if [[ "$VARIANT" == cpu ]]; then \
        site=/opt/venv/lib/python3.11/site-packages; \
        rm -r "$site"/onnxruntime/capi/libonnxruntime_providers_{cuda,tensorrt}.so \
              "$site"/triton/backends/nvidia/bin "$site"/triton/backends/nvidia/lib/cupti*; \
    fi

# The application tree. The code runs from /app (not installed as a package) because it finds
# models/ relative to its own location; models/ goes into /app only when baked in.
COPY pyproject.toml /app/
COPY training/ /app/training/
COPY export/ /app/export/
COPY kernels/ /app/kernels/
COPY proto/ /app/proto/
COPY server/ /app/server/
COPY models/ /build/models/
RUN mkdir -p /app/models "$GRET_SERVE_CACHE" \
 && if [[ "$BAKE_MODELS" == 1 ]]; then cp -a /build/models/. /app/models/; fi

WORKDIR /app
# Fail the build, not the first request, when an import is broken; then byte-compile the app so a
# read-only root filesystem costs nothing at start-up.
RUN /opt/venv/bin/python -c "import torch, onnxruntime, ctranslate2, grpc, training.seq2seq.model, export, kernels, server" \
 && /opt/venv/bin/python -m compileall -q /app
# Preparing the models decodes (each build is checked), which compiles the beam search: into /tmp,
# which the final stage does not copy (the server keeps its own cache there at run time; one left
# in /app would ship unused).
RUN --mount=type=bind,from=data,target=/shared-data \
    if [[ "$PREPARE_MODELS" == 1 ]]; then \
        NUMBA_CACHE_DIR=/tmp/numba-cache SHARED_DATA=/shared-data \
            /opt/venv/bin/python -m server --prepare-only --models-dir /app/models; \
    fi

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="gret-serve" \
      org.opencontainers.image.description="gRPC translation and summarisation server for global-representation encoder-decoder models" \
      org.opencontainers.image.source="Dockerfile in the gret-serve repository"
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONPATH=/app \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    GRET_SERVE_CACHE=/var/cache/gret-serve \
    NUMBA_CACHE_DIR=/tmp/numba-cache
# Numba's compiled beam search needs a writable cache directory even to start (a function cached
# nowhere fails at import), and the root filesystem may be read-only (deploy/k8s): /tmp is writable
# wherever the image runs. Each engine process decodes a made-up text before it reports ready
# (server.engine.engine.warm_up): in a new container that compiles the search (seconds, before the
# readiness probe passes, never in a client's call); later processes load it from there.

# A fixed numeric id, so that Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
RUN groupadd --gid 10001 gret \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/gret --shell /usr/sbin/nologin gret

COPY --from=builder /opt/venv /opt/venv
# Code and models stay root-owned (read-only to the server); only the repository cache is its own,
# for models mounted at run time that were not prepared at build time.
COPY --from=builder /app /app
COPY --from=builder --chown=10001:10001 /var/cache/gret-serve /var/cache/gret-serve

WORKDIR /app
USER 10001:10001
# gRPC (with grpc.health.v1 and reflection), HTTP/JSON (API, web page, /health/*), Prometheus metrics
EXPOSE 50051 8080 9090
# The server drains on SIGTERM (--grace-seconds, 30 by default): stop with a longer timeout than that.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "server.client", "--address", "localhost:50051", "--timeout", "4", "health"]
ENTRYPOINT ["python", "-m", "server"]
CMD ["--models-dir", "/app/models", "--port", "50051", "--http-port", "8080", "--metrics-port", "9090"]
