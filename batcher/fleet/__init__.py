"""The fleet: many `batcher serve` replicas behind one router that speaks the replica's API.

- `router/`: the router (public, internal and admin listeners, routing policy, registry, health,
  failover, discovery, rollout). Its pure parts have no I/O, so the simulator drives them on a
  simulated clock.
- `balancer/`: the global balancer over cells, built on the router's machinery.
- `launcher`: processes (serve a router, supervise local replicas); `cli`: `batcher router` and
  `batcher fleet`; `heartbeat`: the replica's side of membership.

Nothing here imports `batcher.server`, `batcher.runtime` or `batcher.models`; the HTTP toolkit
(`batcher.http`) is shared with the replica."""
