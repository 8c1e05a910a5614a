# The Shepherd Model Gateway (PyPI `smg`, a Rust binary in a wheel) in front of nanoplane's control
# planes: OpenAI-compatible HTTP (chat, completions, responses), cache-aware routing across replicas,
# retries and its own metrics; it routes to each control plane over vLLM's engine gRPC protocol.
#
#   docker build -f docker/smg.Dockerfile -t nanoplane-smg .
#   docker run -v /srv/models:/models:ro -p 8000:8000 nanoplane-smg launch --backend vllm \
#       --worker-urls grpc://controlplane-host:50051 --model-path /models/Qwen3-0.6B \
#       --tokenizer-path /models/Qwen3-0.6B --host 0.0.0.0 --port 8000
#
# It reads the model folder's tokenizer and chat template itself (mount it read-only, as the planes do).
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The version pyproject.toml's dev extra pins (the gateway tests ran with it), its dependencies pinned too.
COPY docker/constraints.txt /tmp/constraints.txt
RUN pip install -c /tmp/constraints.txt smg \
    && smg launch --help >/dev/null

RUN useradd --system --uid 10001 --create-home --shell /usr/sbin/nologin smg
USER 10001

# 8000: OpenAI HTTP. 29000: its Prometheus /metrics.
EXPOSE 8000 29000

ENTRYPOINT ["smg"]
CMD ["launch", "--help"]
