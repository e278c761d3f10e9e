"""Prompt caching: what a call keeps for the next one (PromptCache), the store of
entries reused across requests (memory, then disk: prompt_store, disk), and the
server's memory budget (memory)."""
