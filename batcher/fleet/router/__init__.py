"""The router: one public app with the replica's API over many replicas. `proxy` (the public app),
`forward` and `stream_relay` (one request across its attempts), `policy` (power of two choices
on replica load with prefix affinity), `registry` (soft state fed by heartbeats), `health`
(three-layer health), `context` (the shared state), `admin` and `internal` (its other
listeners), `discovery`, `rollout` (canary weights) and the batch and stored-response routing."""
