"""The engine: continuous batching over the paged KV cache. `engine.Engine` runs the step loop,
`config.EngineConfig` holds every engine setting, `warmup` runs the warm start, `metrics` the
Prometheus series of a replica; `events`, `state`, `live_request`, `detokenizer`, `model_thread`
and `fake_runner` are its parts."""
