"""Developer scripts of a checkout (not installed). `python -m scripts.bench` runs the benchmark
scenarios; the rest are run as files (`scripts/gpu_check.sh`, `scripts/soak.py`, ...)."""
