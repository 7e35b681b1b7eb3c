# Sourced by the multi-host demos after scripts/lib.sh: three network namespaces as three hosts,
# A and B each linked to R by a veth pair (a star; nothing is created in the root namespace;
# 10.200.0.0/16 exists only inside these namespaces), and a cleanup on exit that stops every
# process the demo started (PIDS, lib.sh's stop_pids), kills what is left inside the namespaces
# and deletes them.
#   three_hosts NAME DEFAULT_ID_PREFIX  -> sets ID, NS_A, NS_B, NS_R, WORK, MADE
#   drive MODE LOG                      -> the demo's traffic and checks (scripts/multihost_driver.py
#                                          MODE) on host R; exits with its status
# Host A is 10.200.1.2, host B 10.200.2.2; R is 10.200.1.1 and 10.200.2.1.

three_hosts() {
    DEMO_NAME="$1"
    ID="${MULTIHOST_ID:-$2$$}"  # unique per run, so parallel runs never share a name
    NS_A="${ID}a" NS_B="${ID}b" NS_R="${ID}r"
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/$DEMO_NAME.XXXXXX")"
    MADE=()
    on_exit netns_cleanup
    local ns pair
    for ns in "$NS_A" "$NS_B" "$NS_R"; do
        ip netns add "$ns"
        MADE+=("$ns")
        ip -n "$ns" link set lo up
    done
    ip -n "$NS_R" link add ra type veth peer name eth0 netns "$NS_A"
    ip -n "$NS_R" link add rb type veth peer name eth0 netns "$NS_B"
    ip -n "$NS_R" addr add 10.200.1.1/24 dev ra
    ip -n "$NS_R" addr add 10.200.2.1/24 dev rb
    ip -n "$NS_A" addr add 10.200.1.2/24 dev eth0
    ip -n "$NS_B" addr add 10.200.2.2/24 dev eth0
    for pair in "$NS_R ra" "$NS_R rb" "$NS_A eth0" "$NS_B eth0"; do
        set -- $pair
        ip -n "$1" link set "$2" up
    done
}

drive() {
    local rc
    CUT="ip -n $NS_B link set eth0 down" RESTORE="ip -n $NS_B link set eth0 up" \
        ip netns exec "$NS_R" "$PY" scripts/multihost_driver.py "$1" &
    PIDS+=($!)
    set +e
    wait "${PIDS[-1]}"
    rc=$?
    set -e
    if [ "$rc" != 0 ]; then
        echo "$DEMO_NAME: FAILED (exit $rc); $(basename "$2" .log) log tail:" >&2
        tail -n 20 "$2" >&2 || true
    fi
    exit "$rc"
}

netns_cleanup() {
    local rc=$? pid ns
    set +eu
    stop_pids 5
    for ns in "${MADE[@]}"; do
        # Anything still inside a namespace this run made was started by this run.
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
        ip netns del "$ns" 2>/dev/null  # takes its end of every veth pair with it
    done
    if [ "${MULTIHOST_KEEP:-}" = 1 ]; then
        echo "$DEMO_NAME: logs kept in $WORK" >&2
    else
        rm -rf "$WORK"
    fi
    exit "$rc"
}
