"""Command-line flags shared by the commands that start replicas: `types` (argparse value
parsers) and `serve` (every `batcher serve` flag, with defaults read from `EngineConfig`)."""
