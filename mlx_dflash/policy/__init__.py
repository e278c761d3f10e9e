"""Speculation policies: the interface the engine asks each cycle, the guard, the adaptive width, the batch guard, the registry from verify mode to policy, and the cost data they decide from."""
