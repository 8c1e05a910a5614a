# The data plane: one process per tensor-parallel rank on its own GPU, attached to a control plane
# over ZeroMQ (--control). Model, KV cache, Triton kernels, sampler.
#
#   docker build -f docker/dataplane.Dockerfile -t nanoplane-dataplane .
#   docker run --gpus all --shm-size 16g -v /srv/models:/models:ro -v /srv/plane-keys:/keys:ro \
#       nanoplane-dataplane dataplane --model /models/Qwen3-0.6B --control tcp://controlplane-host:5555 \
#       --plane-keys /keys --device cuda
#
# The CUDA "base" image only: torch's wheel brings its own CUDA libraries (cuBLAS, cuDNN, NCCL), so
# a "runtime" image would ship them twice. The base image still sets what the NVIDIA container
# toolkit reads (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES) and NVIDIA_REQUIRE_CUDA, so an
# old host driver is refused at start with a clear message. CUDA 13.0 needs driver >= 580.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04
FROM ${CUDA_IMAGE}

# PyPI's Linux x86-64 torch wheel is the CUDA build: 2.11.0 is built for CUDA 13.0 and pins
# triton 3.6.0, a pair the GPU tests and kernels run on.
ARG TORCH_VERSION=2.11.0

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    NANOPLANE_MODEL_WAIT=-1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Triton compiles a small C launcher for each kernel signature when it first runs: it needs a C
# compiler and Python's headers at run time, not only at build time. Ubuntu's versions unpinned: the
# base image tag fixes the release, and its security updates should come in.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv

# torch (and the triton it pins) in a layer of its own: gigabytes that change only with TORCH_VERSION.
RUN pip install "torch==${TORCH_VERSION}"

# Then the project's other dependencies, read from pyproject.toml so there is no second list to keep
# in step; the installed torch already satisfies its requirement and is never replaced.
WORKDIR /opt/nanoplane
# The versions the tests ran with: docker/constraints.txt (docker/pin_versions.py; torch's own are TORCH_VERSION's).
COPY pyproject.toml README.md ./
COPY docker/constraints.txt /tmp/constraints.txt
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['gpu']))" > /tmp/requirements.txt \
    && pip install -c /tmp/constraints.txt -r /tmp/requirements.txt

COPY nanoplane ./nanoplane
COPY proto ./proto
COPY controlplane ./controlplane
COPY clients ./clients
COPY dataplane ./dataplane
COPY models ./models
COPY kernels ./kernels
RUN pip install --no-deps . && rm -rf build ./*.egg-info \
    && nanoplane dataplane --help >/dev/null \
    && python -c "import torch, triton, nanoplane.dataplane.model_runner"

# Not root. The Triton kernel cache lives in the home folder (docker-compose.yml keeps it in a volume
# so a restarted data plane does not compile its kernels again); created here so a fresh volume
# takes this owner.
RUN useradd --system --uid 10001 --create-home --shell /usr/sbin/nologin nanoplane \
    && mkdir -p /home/nanoplane/.triton \
    && chown nanoplane: /home/nanoplane/.triton
USER 10001

ENTRYPOINT ["nanoplane"]
CMD ["dataplane"]
