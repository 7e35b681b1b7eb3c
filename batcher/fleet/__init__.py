"""The fleet: many `batcher serve` replicas behind one router that speaks the replica's API.

Pure policy (`registry`, `router`, the state machines of `health` and `rollout`) has no I/O so
the simulator can drive it on a simulated clock; `proxy`, `forward`, `heartbeat` and `launcher`
do the HTTP and process work. Nothing here imports `batcher.runtime` or `batcher.models`."""
