"""Draft sources: the DFlash / DFlash 2 drafter (its config, conv kernel, path selector, batched proposals) and prompt lookup (an n-gram proposer)."""
