#!/usr/bin/env bash
# The GPU check in one command (scripts/gpu_check.py): on a bare GPU machine carrying .gpu/
# (scripts/gpu_pack.sh), within 8 minutes, one PASS or FAIL line per check with its figure,
# also written to $OUT when set. `--dry-run` lists the checks and their targets anywhere.
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
