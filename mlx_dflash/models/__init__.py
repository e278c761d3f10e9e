"""Model management: discovery, names, the drafter registry, loading, dtype and drafter precision choices, and the checks a model's settings must pass."""
