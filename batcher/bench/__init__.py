"""`batcher bench`: a serving benchmark for any OpenAI-compatible server.

Open-loop (all at once, Poisson, bursts) and closed-loop arrivals, streaming TTFT / TPOT / ITL / E2E,
goodput under latency SLOs, server-side metrics scraped during the run, plots, rate sweeps.
"""

from __future__ import annotations
