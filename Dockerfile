# gpuflat's GPU benchmark: gpuflat beside CuPy, PyTorch and JAX on CUDA.
#   docker build -t gpuflat-bench .
#   docker run --rm --gpus all -v "$PWD/bench/results:/results" gpuflat-bench
# The results (<gpu-name>.json, .png) land in the mounted /results folder;
# arguments after the image name replace the defaults, e.g. `--quick`.
# CUDA 13 (CuPy 14, CUDA 13's NVRTC, JAX's CUDA 13 plugin):
#   docker build --build-arg CUDA_VERSION=13.0.0 -t gpuflat-bench:cuda13 .
ARG CUDA_VERSION=12.6.3
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04
ARG CUDA_VERSION

# The runtime image carries NVRTC, which CuPy needs to build the kernels.
# Python comes from the base image's release (noble); its point releases are
# security updates, so the version is left to the distribution.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

# Ubuntu 24.04 marks its Python as externally managed: install into a venv.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
RUN python3 -m venv "$VIRTUAL_ENV"

WORKDIR /src
COPY . .
# "." is this repository; the versions are constraints.txt's, so the NVRTC
# the image loads is one whose build of the kernels the tests gate. The CUDA
# extra (cuda12 or cuda13) follows the image's CUDA major. The peers extra
# brings JAX's CPU build only: jax[cudaXY] adds its CUDA plugin, so the JAX
# peer runs on the GPU instead of being left out.
# hadolint ignore=DL3013
RUN major="${CUDA_VERSION%%.*}" \
    && pip install --no-cache-dir -c constraints.txt ".[cuda${major},bench,peers]" "jax[cuda${major}]"

# JAX would otherwise take most of the GPU's memory at import, starving CuPy.
ENV XLA_PYTHON_CLIENT_PREALLOCATE=false

VOLUME ["/results"]
ENTRYPOINT ["python", "-m", "bench", "--device", "cuda", "--out", "/results"]
