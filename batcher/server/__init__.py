"""The HTTP gateway (aiohttp): OpenAI-compatible routes, auth, admission, SSE."""
