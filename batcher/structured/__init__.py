"""Structured outputs: `grammars` turns `response_format` (and vLLM's `guided_*` fields)
into one grammar the runtime's token masks enforce; `json_limits` bounds the JSON a client sends.
Imports no torch."""
