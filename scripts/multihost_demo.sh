#!/usr/bin/env bash
# A multi-host run on one machine: three network namespaces are three hosts. Two run a fake
# replica each (host A with a small KV cache, host B with twice as much), the third runs the
# router, which finds them by a discovery file. Traffic goes through the router while host B's
# link is cut (`ip link set eth0 down`) and restored. It shows, and checks:
#   - nothing is lost: every (non-streamed) request succeeds, the cut one's moving to host A;
#   - host B is evicted by the router's health checks and re-admitted after the link returns;
#   - KV is a fit constraint, not a score, while both hosts have room: both take work.
# Needs root (ip netns) and iproute2; no network access. Prints a summary and a final line
# `RESULT {json}`; exits 0 when every check passed. Everything it creates (namespaces, links,
# processes, a temporary folder) is removed on exit, however it ends.
#   sudo scripts/multihost_demo.sh        (env: PYTHON, MULTIHOST_ID, MULTIHOST_KEEP=1 keeps logs)
#   sudo scripts/multihost_demo.sh cells  (the same with two cells: scripts/multihost_cells_demo.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
# `multihost_demo.sh cells`: two cells behind the global balancer, one cell cut mid-run.
if [ "${1:-}" = cells ]; then
    exec bash scripts/multihost_cells_demo.sh
fi

source scripts/lib.sh
batcher_python
need_tool ip multihost_demo iproute2

# Three hosts as namespaces; everything is removed on exit (scripts/netns_hosts.sh).
source scripts/netns_hosts.sh
three_hosts multihost_demo bmh

# Replicas: the fake engine (real scheduler and KV block pool, simulated model step).
replica() {  # NS ADDRESS BLOCKS NAME
    ip netns exec "$1" "$PY" -m batcher.app.cli serve --model fake --embedding-model none \
        --host "$2" --port 8000 --num-blocks "$3" --fake-decode-step-ms 10 \
        --shutdown-timeout 2 --log-level warning >"$WORK/$4.log" 2>&1 &
    PIDS+=($!)
}
replica "$NS_A" 10.200.1.2 64 host-a
replica "$NS_B" 10.200.2.2 128 host-b
printf 'http://10.200.1.2:8000\nhttp://10.200.2.2:8000\n' >"$WORK/replicas.txt"

# The router. Unique prompts share no prefix, so affinity is off and only free KV decides. The
# retry budget must cover the largest share of traffic one failure can strand: with two hosts,
# one host's in-flight work is most of it, far above the 10% default sized for larger fleets.
ip netns exec "$NS_R" "$PY" -m batcher.app.cli router --host 0.0.0.0 --port 8000 \
    --admin-port 8001 --admin-key demo --discover "file:$WORK/replicas.txt" \
    --affinity-chars 0 --retry-ratio 1.0 --shutdown-timeout 2 --log-level warning \
    >"$WORK/router.log" 2>&1 &
PIDS+=($!)

echo "multihost_demo: hosts $NS_A (10.200.1.2, 64 KV blocks), $NS_B (10.200.2.2, 128 KV" \
     "blocks), router in $NS_R"

# The driver runs on the router's host; it cuts and restores B's link itself, so each step
# waits for the previous one's effect instead of guessing durations.
drive hosts "$WORK/router.log"
