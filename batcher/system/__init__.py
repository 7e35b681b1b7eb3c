"""Facts about the host and the process: `cpuinfo` (the CPU's name and flags), `threads` (how
many CPUs this process may use), `gc_freeze` (taking the start-up heap out of the garbage
collector's sight before serving)."""
