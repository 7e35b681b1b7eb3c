"""The global balancer over cells (a cell is a router and its replicas): `policy` (pure choice of a
cell), `app` (the router's machinery with cells as its upstreams), `cli` (`batcher balancer`)."""
