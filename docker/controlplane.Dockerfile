# The control plane: public gRPC API, tokenizer, scheduler, engine loop. CPU only and without torch,
# so the image stays a few hundred MB (the data plane's is ~10 GB) and runs on any node.
#
#   docker build -f docker/controlplane.Dockerfile -t nanoplane-controlplane .
#   docker run -v /srv/models:/models:ro -v /srv/plane-keys:/keys:ro -p 50051:50051 -p 5555:5555 \
#       -e NANOPLANE_MODEL=/models/Qwen3-0.6B -e NANOPLANE_PLANE_KEYS=/keys \
#       -e NANOPLANE_HOST=0.0.0.0 -e NANOPLANE_BIND=tcp://0.0.0.0:5555 nanoplane-controlplane
#
# Both ports default to loopback: a container binds all its interfaces explicitly, as above. The keys
# (`nanoplane keys /srv/plane-keys`, docs/operations.md "Securing the plane link") guard the ZeroMQ port.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
FROM ${PYTHON_IMAGE}

# TRANSFORMERS_NO_ADVISORY_WARNINGS: transformers says "PyTorch was not found" at import; here that is
# the design (the tokenizer is all it is used for), not news. NANOPLANE_MODEL_WAIT=-1: a model not yet
# mounted is reported once and waited for, rather than exiting into `restart:`'s loop.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_NO_ADVISORY_WARNINGS=1 \
    NANOPLANE_MODEL_WAIT=-1

# Third-party packages first, in their own layer: they change far less often than our code.
# Every version pinned by docker/constraints.txt (docker/pin_versions.py): the ones the tests ran with.
COPY docker/requirements-controlplane.txt docker/constraints.txt /tmp/
RUN pip install -c /tmp/constraints.txt -r /tmp/requirements-controlplane.txt

# Every folder, since the distribution installs them all under `nanoplane`; the control plane's commands
# never load models/, kernels/ or dataplane/'s torch modules (the check below fails the build if one does).
WORKDIR /opt/nanoplane
COPY pyproject.toml README.md ./
COPY nanoplane ./nanoplane
COPY proto ./proto
COPY controlplane ./controlplane
COPY clients ./clients
COPY dataplane ./dataplane
COPY models ./models
COPY kernels ./kernels
# --no-deps: pyproject.toml lists torch (for the data plane), which this image must never download.
RUN pip install --no-deps . && rm -rf build ./*.egg-info

# Fail the build, not the first start, when a control-plane command needs a package this image lacks
# (torch above all: it is not installed, so any import of it fails here).
RUN nanoplane controlplane --help >/dev/null \
    && nanoplane health --help >/dev/null \
    && python -I -c "import nanoplane.controlplane.service, nanoplane.controlplane.grpc_server, \
nanoplane.controlplane.dataplane_client, nanoplane.clients.client"

RUN useradd --system --uid 10001 --create-home --shell /usr/sbin/nologin nanoplane
USER 10001

# 50051: the gRPC API. 5555: the ZeroMQ endpoint the data-plane ranks connect to (--bind).
EXPOSE 50051 5555

# SERVING only while a data plane is attached, so a long start period: the data plane loads the
# model and captures CUDA graphs before it says READY. The shell form: it asks the port NANOPLANE_PORT
# configures (the gRPC API's default, 50051, when unset).
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD nanoplane health --server "127.0.0.1:${NANOPLANE_PORT:-50051}"

ENTRYPOINT ["nanoplane"]
CMD ["controlplane"]
