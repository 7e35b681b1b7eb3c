"""Capacity planning and a discrete-event fleet simulator that drives the real `core/` scheduler
and block pool on a simulated clock (`batcher plan`, `batcher sim`)."""
