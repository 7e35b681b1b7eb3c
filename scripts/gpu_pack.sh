#!/usr/bin/env bash
# Prepare what the GPU machine lacks, in .gpu/ (git-ignored): the gguf wheel and the bundled model
# file split in two halves (each device call carries at most 64 MiB; see scripts/gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup
mkdir -p .gpu/a .gpu/b .gpu/whl
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .gpu/whl gguf
gguf=$(.venv/bin/python -c "from batcher.models.bundled import smollm2_gguf_path as p; print(p())")
size=$(stat -c %s "$gguf")
head -c $((size / 2)) "$gguf" > .gpu/a/model.part
tail -c +$((size / 2 + 1)) "$gguf" > .gpu/b/model.part
cp "$(dirname "$gguf")/__init__.py" .gpu/a/init.py
echo "packed: carry .gpu/a and .gpu/whl in the first call, .gpu/b in the second"
