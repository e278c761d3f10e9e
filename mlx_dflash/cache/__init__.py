"""Prompt caching: what a call keeps for the next one (PromptCache) and the store of entries a server reuses across requests."""
