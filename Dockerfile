# Images of disagg. Three targets:
#   docker build --target control-plane -t disagg/control-plane:0.1.0 .   # operator, planner, router
#   docker build --target worker -t disagg/worker:0.1.0 .                 # GPU: vLLM's image + NIXL + the worker entrypoint
#   docker build --target worker-cpu -t disagg/worker-cpu:0.1.0 .         # CPU: vLLM's CPU build + NIXL (laptop/kind, no GPU)
# Linted by tests/test_dockerfile.py (hadolint). Without a Docker daemon, e2e/images (`python -m
# disagg.e2e.images`) builds control-plane and worker-cpu with BuildKit straight into the local node's
# containerd, a Debian base made there standing in for PYTHON_IMAGE (tests/test_images.py runs them); the
# GPU worker is built on kind by e2e/kind/e2e.sh. No `# syntax=` line: BuildKit's built-in Dockerfile
# frontend is used, so nothing is pulled to parse this file.

# Global: an ARG used by FROM must come before the first FROM.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# The package as a wheel, without the test harness: disagg.e2e (the suites, the local cluster and this
# image builder) is neither copied nor packaged, so no image can import it.
FROM ${PYTHON_IMAGE} AS wheel
# Made outside /src: `python -m` puts the working directory on sys.path, and the source tree has a
# folder named like the standard library's `operator`.
RUN python3 -m venv /opt/build
WORKDIR /src
COPY pyproject.toml ./
COPY disagg disagg
COPY operator operator
COPY perf perf
COPY planner planner
COPY simulator simulator
COPY router router
COPY workers workers
COPY configurator configurator
# pyproject.toml maps disagg.e2e* to e2e/, absent here: drop those entries. A leftover one (a format this
# edit does not know) fails the build rather than packaging the harness.
RUN sed -E -i -e 's/"disagg\.e2e[a-z.]*"( = "e2e")?, ?//g' -e '/^"disagg\.e2e/d' pyproject.toml \
    && if grep -n 'disagg\.e2e' pyproject.toml; then echo "pyproject.toml still names disagg.e2e" >&2; exit 1; fi
RUN --mount=type=cache,target=/root/.cache/pip /opt/build/bin/pip wheel --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS control-plane
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin disagg
# The dependencies first, from pyproject.toml alone, so a source change reinstalls only the package.
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=bind,source=pyproject.toml,target=/tmp/pyproject.toml \
    python3 -m venv /opt/venv \
    && python3 -c 'import tomllib; print("\n".join(tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]["dependencies"]))' \
       > /tmp/requirements.txt \
    && /opt/venv/bin/pip install -r /tmp/requirements.txt \
    && /opt/venv/bin/pip install --no-deps --force-reinstall "$(grep '^opentelemetry-proto==' /tmp/requirements.txt)" \
    && /opt/venv/bin/python -c 'from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter' \
    && rm /tmp/requirements.txt
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    /opt/venv/bin/pip install --no-cache-dir --no-deps /wheels/disagg-*.whl && /opt/venv/bin/pip check
# The user has no home directory: HOME (so every cache: Hugging Face's tokenizer download, matplotlib's)
# is /tmp, the one writable place in the operator's pod too (an emptyDir under a read-only root filesystem).
# Set after the installs, whose pip cache is mounted under root's home.
ENV HOME=/tmp HF_HOME=/tmp/huggingface PATH=/opt/venv/bin:$PATH
USER 10001
ENTRYPOINT ["python", "-m"]
CMD ["disagg.operator"]

FROM ${VLLM_IMAGE} AS worker
# No home directory here either: model downloads (Hugging Face cache) and vLLM's, torch's and Triton's
# caches (under HOME) go to /tmp. The operator runs worker pods as this uid with a read-only root
# filesystem and an emptyDir on /tmp (operator/render.py, disagg/api/contract.py SCRATCH_ENV).
ENV HOME=/tmp HF_HOME=/tmp/huggingface
# The Run:ai streamer reads s3:// model sources (workers/__main__.py adds --load-format runai_streamer).
# NIXL at the CPU worker's pinned version (workers/env/versions.env).
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    --mount=type=bind,source=workers/env/versions.env,target=/tmp/versions.env \
    . /tmp/versions.env \
    && pip install --no-cache-dir /wheels/disagg-*.whl "nixl==${NIXL_VERSION}" runai-model-streamer==0.17.0 \
       runai-model-streamer-s3==0.17.1 \
    && useradd --uid 10001 --no-create-home disagg
USER 10001
ENTRYPOINT ["python", "-m", "disagg.workers"]

FROM ${PYTHON_IMAGE} AS worker-cpu
# vLLM's CPU kernels link libnuma.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1=2.0.16-1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin disagg
# The worker environment by the tests' own recipe, workers/env/build.sh with its pins (versions.env,
# requirements.txt, constraints.txt): torch, vLLM's CPU build, NIXL, checked by importing them. It lands
# in /opt/disagg/worker-env/<key>; /opt/venv points at it.
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=bind,source=workers/env,target=/tmp/worker-env \
    env_dir="$(DISAGG_CACHE=/opt/disagg PYTHON=python3 bash /tmp/worker-env/build.sh)" \
    && ln -s "$env_dir" /opt/venv
# The package alone: the worker entrypoint needs only pydantic, already in the environment at its pin.
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    /opt/venv/bin/pip install --no-deps /wheels/disagg-*.whl
# As in the GPU worker: the caches (Hugging Face, vLLM's under HOME) go to /tmp. After the installs, so
# the pip cache mounted under root's home is the one they use.
ENV HOME=/tmp HF_HOME=/tmp/huggingface PATH=/opt/venv/bin:$PATH
# This image is vLLM's CPU build: the worker runs it as such (float32, eager, OpenMP binding, UCX over
# TCP; workers/command.py), whatever the DisaggDeployment says, as the GPU image runs CUDA.
ENV DISAGG_CPU=true
USER 10001
ENTRYPOINT ["python", "-m", "disagg.workers"]
