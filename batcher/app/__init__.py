"""The command line and the wiring that turns flags into running processes: `cli` (the `batcher`
command), `serve` (one replica: engine, admission, HTTP app), `batch_run` (`batcher batch run`, the
offline batch job), `diagnose` and `review`. Nothing below imports this package."""
