# Sourced by the shell scripts (the peers benchmark, the multi-host demos): the checkout's Python,
# a tool check, waiting for a server, and stopping what a script started however it ends.
#
#   batcher_python                 PY: $PYTHON, else the checkout's .venv/bin/python, else python3
#   need_tool TOOL WHO [WHAT]      exit 2, saying so, when TOOL is not installed
#   wait_ready URL PID SECONDS     return 0 once URL answers 2xx; 1 if PID exits first or time ends
#   on_exit FUNCTION               run FUNCTION when the script exits, ^C and kill included
#   stop_pids [SECONDS]            TERM every pid in PIDS, KILL what is left after SECONDS (5)
#
# BATCHER_ROOT is the checkout's root.

BATCHER_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PIDS=()

batcher_python() {
    PY="${PYTHON:-$BATCHER_ROOT/.venv/bin/python}"
    [ -x "$PY" ] || PY="$(command -v "$PY" || command -v python3)"
}

need_tool() {
    if ! command -v "$1" >/dev/null 2>&1; then
        echo "$2: needs the $1 tool${3:+ ($3)}" >&2
        exit 2
    fi
}

wait_ready() {
    local deadline=$((SECONDS + $3))
    while [ $SECONDS -lt $deadline ]; do
        if ! kill -0 "$2" 2>/dev/null; then echo "server exited early" >&2; return 1; fi
        if curl -sf "$1" >/dev/null 2>&1; then return 0; fi
        sleep 0.5
    done
    echo "server not ready after $3 s: $1" >&2
    return 1
}

on_exit() {
    trap "$1" EXIT
    # An interrupted or killed script exits through its EXIT trap too.
    trap 'exit 130' INT
    trap 'exit 143' TERM
}

stop_pids() {
    local grace="${1:-5}" pid i alive
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for i in $(seq $((grace * 10))); do  # a graceful exit first
        alive=0
        for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for pid in "${PIDS[@]}"; do
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    PIDS=()
}
