"""The fleet: many `batcher serve` replicas behind one router that speaks the replica's API.

Pure parts have no I/O, so the simulator can drive them on a simulated clock: `policy` (which
replica), `registry` (what the router knows of each), `stream_ledger` (what a relayed stream has
shown its client), `ratelimit`, `scope`, and the state machines of `health` and `rollout`.
The router's three listeners: `proxy` (public, with `forward` relaying one request), `internal`
(heartbeats, fleet key) and `admin` (operators, admin key). `heartbeat` is the replica's side of
membership, `discovery` finds replicas, `launcher` runs processes. Nothing here imports
`batcher.server`, `batcher.runtime` or `batcher.models`; the HTTP toolkit (`batcher.http`) is
shared with the replica."""
