"""Speculation without a drafter: prompt lookup (n-gram drafting).

Code edits, quoting and repeated structure make the next tokens a copy of
something already in the context. `NgramIndex` keeps, for every n-gram
(n = min_n..max_n) of the prompt and the text so far, where it last ended;
the drafts are what followed the longest n-gram that ends the context. Each new
token costs O(max_n) dict updates and a proposal O(max_n + width): nothing
grows with the context length but the index itself.

The drafts are deterministic (a one-hot proposal), so the loop's usual
acceptance rules keep the output exactly the target's (DFLASH2.md section 5)."""

from __future__ import annotations

from typing import Iterable, List, Tuple

MAX_N = 4  # longest n-gram matched
MIN_N = 2  # a 1-gram match is mostly chance: its failed verifies cost more than its hits give


class NgramIndex:
    def __init__(self, tokens: Iterable[int] = (), max_n: int = MAX_N, min_n: int = MIN_N):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: List[int] = []
        self.last = {n: {} for n in range(min_n, max_n + 1)}  # n -> n-gram -> index of what followed it
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        t, L = self.tokens, len(self.tokens)
        # the n-grams that end at L - 1 now have a continuation (this token): index
        # them; the context's own suffix is never indexed, so it cannot match itself
        for n in range(self.min_n, min(self.max_n, L) + 1):
            self.last[n][tuple(t[L - n:])] = L
        t.append(token)

    def extend(self, tokens: Iterable[int]) -> None:
        for x in tokens:
            self.append(x)

    def match(self) -> Tuple[int, int]:
        """(n, start): the longest indexed n-gram that ends the context, and where
        its last continuation starts; (0, -1) when none does."""
        t = self.tokens
        for n in range(min(self.max_n, len(t)), self.min_n - 1, -1):
            pos = self.last[n].get(tuple(t[len(t) - n:]))
            if pos is not None:
                return n, pos
        return 0, -1

    def propose(self, k: int) -> List[int]:
        """Up to k draft tokens after the context (empty when nothing matches)."""
        n, pos = self.match()
        if n == 0 or k <= 0:
            return []
        return self.tokens[pos:pos + k]
