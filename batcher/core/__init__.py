"""Pure-Python scheduling core: blocks, prefix cache, scheduler. Never imports torch."""
