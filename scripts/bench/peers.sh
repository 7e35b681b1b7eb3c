#!/usr/bin/env bash
# Peers: `batcher serve` against llama.cpp's llama-server on the same GGUF file, alternating.
#
# chat64 (all requests at t=0) against llama.cpp's llama-server and `batcher serve` on the SAME
# bundled GGUF file, alternating, in one run; prints both rows and the ratio and appends them to
# BENCHMARKS.md.
#
#   python -m scripts.bench peers [--build-only] [--rounds N] [--workload FILE] [--single N]
#       [--batch N]                                      (or scripts/bench/peers.sh directly)
#
# --batch N: N synthetic requests all at once (256-token prompts, lognormal spread 0.5; 64 greedy
# tokens each), the 48-request batch workload at N=48, beside chat64's mixed lengths.
#
# --single N: one stream instead (a closed loop of one user, N requests of a 100-token prompt and
# 128 greedy tokens each), the issue of a laptop user; the verdict is then output tok/s against
# a target of 0.75x llama-server's.
#
# llama-server is built from the llama.cpp tree vendored in the llama-cpp-python sdist (about
# 4 minutes on 2 cores) and cached under .cache/peers/. Environment: PYTHON (default .venv/bin/python),
# PEER_PORT (18290), BATCHER_PORT (18291), BATCHER_ARGS (extra `batcher serve` flags; default
# for the batch runs `--slo-ttft-ms 0 --embedding-model none --log-level warning`: llama-server
# admits everything, so batcher's SLO admission, which refuses most of 64 requests arriving at
# once, is off for a like-for-like throughput comparison; default for --single none at all: one
# stream is what a user gets from `batcher serve` as it starts, embedding model and logs
# included, and the row says so), QUIET
# (seconds each run may wait for an idle machine first, default 300), PEER_ARGS (extra
# llama-server flags: `--no-repack` where its AMX matmul crashes at load, as seen on a
# 2-core Xeon with AMX in a VM; its rows then run llama.cpp's AVX-512 kernels). Each row records the CPU
# other processes used during it; contended rounds are left out of the ratio when clean ones exist.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
ROOT="$BATCHER_ROOT"
cd "$ROOT"
batcher_python
CACHE="$ROOT/.cache/peers"
BIN="$CACHE/llama-server"
PEER_PORT="${PEER_PORT:-18290}"
BATCHER_PORT="${BATCHER_PORT:-18291}"
QUIET="${QUIET:-300}"
ARGS="$*"
ROUNDS=1
BUILD_ONLY=0
WORKLOAD="$ROOT/workloads/chat64.json"
SINGLE=0
BATCH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build-only) BUILD_ONLY=1 ;;
    --rounds) ROUNDS="$2"; shift ;;
    --workload) WORKLOAD="$2"; shift ;;
    --single) SINGLE="$2"; shift ;;
    --batch) BATCH="$2"; shift ;;
    -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

build_llama_server() {
  if [ -x "$BIN" ]; then return; fi
  mkdir -p "$CACHE/src"
  local sdist
  sdist="$(ls "$CACHE"/src/llama_cpp_python-*.tar.gz 2>/dev/null | tail -n 1 || true)"
  if [ -z "$sdist" ]; then
    "$PY" -m pip download --no-deps --no-binary :all: llama-cpp-python -d "$CACHE/src"
    sdist="$(ls "$CACHE"/src/llama_cpp_python-*.tar.gz | tail -n 1)"
  fi
  local tree="$CACHE/src/$(basename "$sdist" .tar.gz)"
  [ -d "$tree" ] || tar xzf "$sdist" -C "$CACHE/src"
  # The prebuilt-UI default downloads a web UI at configure time, which fails offline; OpenSSL
  # and curl are only for fetching models over HTTPS, which this comparison never does.
  cmake -S "$tree/vendor/llama.cpp" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON >"$CACHE/cmake.log" 2>&1 \
    || { tail -n 30 "$CACHE/cmake.log"; exit 1; }
  cmake --build "$CACHE/build" --target llama-server -j "$(nproc)" >"$CACHE/build.log" 2>&1 \
    || { tail -n 30 "$CACHE/build.log"; exit 1; }
  cp "$CACHE/build/bin/llama-server" "$BIN"
}

echo "== llama-server binary"
build_llama_server
"$BIN" --version 2>&1 | head -n 2 || true
[ "$BUILD_ONLY" = 1 ] && exit 0

GGUF="$("$PY" -c "from batcher.bundled import smollm2_gguf_path; print(smollm2_gguf_path())")"
OUT="$ROOT/bench_out/peers"
if [ "$SINGLE" -gt 0 ]; then
  LOAD=(--synthetic --input-median 100 --input-spread 0 --output-median 128 --output-spread 0
        --arrivals closed --concurrency 1 --num-requests "$SINGLE" --seed 0)
  NP=1
elif [ "$BATCH" -gt 0 ]; then
  LOAD=(--synthetic --input-median 256 --output-median 64 --output-spread 0 --arrivals all
        --num-requests "$BATCH" --seed 0)
  NP=16
else
  LOAD=(--workload "$WORKLOAD")
  NP=16
fi
if [ -z "${BATCHER_ARGS+set}" ]; then
  if [ "$SINGLE" -gt 0 ]; then BATCHER_ARGS=""
  else BATCHER_ARGS="--slo-ttft-ms 0 --embedding-model none --log-level warning"; fi
fi
mkdir -p "$OUT"
stop_all() { stop_pids 30; }
on_exit stop_all  # the servers are stopped on ^C or kill too

# One server at a time: both would fight over the same 2 cores otherwise.
run_llama() {  # round
  # shellcheck disable=SC2086
  "$BIN" -m "$GGUF" --host 127.0.0.1 --port "$PEER_PORT" -np "$NP" -cb -c 16384 -t 2 -tb 2 \
    --no-cache-prompt ${PEER_ARGS:-} >"$OUT/llama-server.log" 2>&1 &
  PIDS+=($!)
  wait_ready "http://127.0.0.1:$PEER_PORT/health" "${PIDS[-1]}" 120
  "$PY" -m batcher.bench.cli --base-url "http://127.0.0.1:$PEER_PORT" \
    "${LOAD[@]}" --warmup 1 --no-metrics --label "llama-server -np $NP${PEER_ARGS:+ $PEER_ARGS} (round $1)" \
    --server-pid "${PIDS[-1]}" --wait-quiet "$QUIET" --out "$OUT/llama-$1"
  stop_all
}

run_batcher() {  # round
  # shellcheck disable=SC2086
  "$PY" -m batcher.app.cli serve --host 127.0.0.1 --port "$BATCHER_PORT" \
    ${BATCHER_ARGS:-} >"$OUT/batcher.log" 2>&1 &
  PIDS+=($!)
  wait_ready "http://127.0.0.1:$BATCHER_PORT/ready" "${PIDS[-1]}" 300
  "$PY" -m batcher.bench.cli --base-url "http://127.0.0.1:$BATCHER_PORT" \
    "${LOAD[@]}" --warmup 1 --label "batcher serve ${BATCHER_ARGS:-(defaults)} (round $1)" \
    --server-pid "${PIDS[-1]}" --wait-quiet "$QUIET" --out "$OUT/batcher-$1"
  stop_all
}

for round in $(seq 1 "$ROUNDS"); do
  echo "== round $round: llama-server"
  run_llama "$round"
  echo "== round $round: batcher"
  run_batcher "$round"
done

MODE=()
[ "$SINGLE" -gt 0 ] && MODE=(--single)
[ "$BATCH" -gt 0 ] && MODE=(--title "Peers: $BATCH requests at t=0 (256-token prompts, 64 greedy \
tokens each), batcher serve vs llama.cpp llama-server (same GGUF)")
"$PY" -m batcher.bench.peers "$OUT" --rounds "$ROUNDS" "${MODE[@]}" \
  --command "${PEER_ARGS:+PEER_ARGS=\"$PEER_ARGS\" }BATCHER_ARGS=\"$BATCHER_ARGS\" python -m scripts.bench peers $ARGS"
