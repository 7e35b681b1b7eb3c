"""Admission: whether a request may enter the queue now. Per-tenant token budgets
(`tenants`, `token_bucket`), the time-to-first-token forecast (`ttft_predictor`, `feed`) and the SLO
controller (`slo_limit`) behind `admission.Admission`. Refusals are decided here, before any engine
work is paid for."""
