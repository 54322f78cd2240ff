# Images of disagg. Two targets:
#   docker build --target control-plane -t disagg/control-plane:0.1.0 .   # operator, planner, router
#   docker build --target worker -t disagg/worker:0.1.0 .                 # vLLM + NIXL + the worker entrypoint
# Linted by tests/test_dockerfile.py (hadolint); built and run on kind by e2e/kind/e2e.sh (CI has no Docker
# engine).

# Global: an ARG used by FROM must come before the first FROM.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# The package source, once; both targets install it.
FROM scratch AS source
COPY pyproject.toml README.md /src/
COPY disagg /src/disagg
COPY operator /src/operator
COPY planner /src/planner
COPY router /src/router
COPY workers /src/workers
COPY e2e /src/e2e
COPY configurator /src/configurator

FROM python:3.11-slim AS control-plane
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin disagg
# The user has no home directory: the router's tokenizer download (Hugging Face cache) goes to /tmp,
# the one writable place in the operator's pod too (an emptyDir under a read-only root filesystem).
ENV HF_HOME=/tmp/huggingface
WORKDIR /app
COPY --from=source /src/ ./
RUN pip install --no-cache-dir . && rm -rf /root/.cache
USER 10001
ENTRYPOINT ["python", "-m"]
CMD ["disagg.operator"]

FROM ${VLLM_IMAGE} AS worker
# No home directory here either: model downloads (Hugging Face cache) go to /tmp.
ENV HF_HOME=/tmp/huggingface
WORKDIR /app
COPY --from=source /src/ ./
# The Run:ai streamer reads s3:// model sources (workers/__main__.py adds --load-format runai_streamer).
RUN pip install --no-cache-dir . nixl==1.5.1 runai-model-streamer==0.17.0 runai-model-streamer-s3==0.17.1 \
    && useradd --uid 10001 --no-create-home disagg
USER 10001
ENTRYPOINT ["python", "-m", "disagg.workers"]
