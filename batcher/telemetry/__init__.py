"""What a request leaves behind for operators: `timings` (per-phase times), `tracing`
(OpenTelemetry spans, optional) and `access_log` (one line per request)."""
