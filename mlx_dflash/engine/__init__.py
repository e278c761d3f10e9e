"""The decode engine: per-request state, the steps (prefill, draft, verify, accept, rollback, emit), the loop that drives a set of sequences, its config, stats and cost measurement."""
