#!/usr/bin/env bash
# Two cells on one machine: three network namespaces are three hosts. Hosts A and B each run a
# cell (a fake replica on the host's loopback and a router in front of it); the third runs the
# global balancer over the two cells' routers. Traffic goes through the balancer while cell B's
# link is cut (`ip link set eth0 down`) and restored. It shows, and checks:
#   - nothing is lost: every (non-streamed) request succeeds, those caught in cell B moving to A;
#   - cell B is evicted by the balancer's health checks and re-admitted after the link returns;
#   - both cells take traffic while both are up, and B again after its return.
# Needs root (ip netns) and iproute2; no network access. Prints a summary and a final line
# `RESULT {json}`; exits 0 when every check passed. Everything it creates (namespaces, links,
# processes, a temporary folder) is removed on exit, however it ends.
#   sudo scripts/multihost_demo.sh cells   (env: PYTHON, MULTIHOST_ID, MULTIHOST_KEEP=1 keeps logs)
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/lib.sh
batcher_python
need_tool ip multihost_cells_demo iproute2

# Three hosts as namespaces; everything is removed on exit (scripts/netns_hosts.sh).
source scripts/netns_hosts.sh
three_hosts multihost_cells_demo bmc

cell() {  # NS ADDRESS NAME: a fake replica on the host's loopback, its router on the link
    ip netns exec "$1" "$PY" -m batcher.app.cli serve --model fake --embedding-model none \
        --host 127.0.0.1 --port 8100 --num-blocks 128 --fake-decode-step-ms 10 \
        --shutdown-timeout 2 --log-level warning >"$WORK/$3-replica.log" 2>&1 &
    PIDS+=($!)
    BATCHER_ADMIN_KEY=demo ip netns exec "$1" "$PY" -m batcher.app.cli router --host "$2" \
        --port 8000 --replica http://127.0.0.1:8100 --shutdown-timeout 2 \
        --log-level warning >"$WORK/$3-router.log" 2>&1 &
    PIDS+=($!)
}
cell "$NS_A" 10.200.1.2 cell-a
cell "$NS_B" 10.200.2.2 cell-b

# The balancer. With two cells, one cell's in-flight work is half of everything: the retry budget
# must cover it, far above the share sized for many cells.
ip netns exec "$NS_R" "$PY" -m batcher.app.cli balancer --host 0.0.0.0 --port 8000 \
    --cell http://10.200.1.2:8000 --cell http://10.200.2.2:8000 --admin-port 8001 \
    --admin-key demo --cell-key demo --retry-ratio 1.0 --shutdown-timeout 2 --log-level warning \
    >"$WORK/balancer.log" 2>&1 &
PIDS+=($!)

echo "multihost_cells_demo: cells on $NS_A (10.200.1.2) and $NS_B (10.200.2.2), balancer in $NS_R"

# The driver runs on the balancer's host; it cuts and restores B's link itself, so each step
# waits for the previous one's effect instead of guessing durations.
drive cells "$WORK/balancer.log"
