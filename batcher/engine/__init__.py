"""The engine: continuous batching over the paged KV cache. `engine.AsyncEngine` runs the step
loop, `factory.build_engine` builds one from an `EngineConfig` (`config`), `warmup` runs the warm
start, `metrics` holds a replica's Prometheus series; `events`, `snapshot` (`EngineSnapshot`),
`live_request`, `detokenizer`, `model_thread` and `fake_runner` are its parts."""
