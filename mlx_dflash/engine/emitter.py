"""Token bookkeeping every decode path shares: EOS, stop strings, max tokens and
the streamed text."""

from __future__ import annotations

import weakref
from typing import Callable, List, Optional, Sequence, Tuple

REPLACEMENT = "\ufffd"  # the text of an id the tokenizer has none for (Unicode's replacement character)
_TEXTLESS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def textless(tokenizer) -> Callable[[int], bool]:
    """Whether an id has no text in `tokenizer`: past its vocabulary (a model's vocabulary
    is often padded past its tokenizer's) or a hole in it. mlx-lm's detokenizers fail on
    such an id (TypeError, IndexError) or write "!" for it. Computed once per tokenizer."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return _TEXTLESS[hf]
    except (KeyError, TypeError):
        pass
    ids = set(hf.get_vocab().values())
    n = max(ids, default=-1) + 1
    holes = frozenset(range(n)) - ids

    def no_text(token: int) -> bool:
        return token >= n or token < 0 or token in holes

    try:
        _TEXTLESS[hf] = no_text
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return no_text


class Emitter:
    """Token bookkeeping shared by every mode: EOS, stop strings (also across a
    block), max tokens, and text held back while it may begin a stop string.
    Only the unsent tail of the text is kept: per-token work does not grow
    with the length of the answer. `push` returns (text to send, finish reason)."""

    def __init__(self, tokenizer, stop: Optional[Sequence[str]], max_tokens: int):
        # without a tokenizer (calibration, token-id sessions): no text and no EOS
        self.eos = set(tokenizer.eos_token_ids) if tokenizer is not None else set()
        self.detok = tokenizer.detokenizer if tokenizer is not None else None
        if self.detok is not None:
            self.detok.reset()
            self.no_text = textless(tokenizer)
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.max_tokens = max_tokens
        self.tokens: List[int] = []
        self.buf = ""  # text not yet sent (at most `hold` chars between tokens)
        self.done = False

    @property
    def left(self) -> int:
        return self.max_tokens - len(self.tokens)

    def push(self, token: int) -> Tuple[str, Optional[str]]:
        """Account one token; sets self.done when generation must end."""
        if token in self.eos:
            return self._final("stop")
        self.tokens.append(token)
        if self.detok is not None:
            if self.no_text(token):  # counted, and shown as what it is: a token with no text
                self.detok.finalize()  # (the text before it first, whole)
                self.buf += self.detok.last_segment + REPLACEMENT
            else:
                self.detok.add_token(token)
                self.buf += self.detok.last_segment
        if self.stop:
            # a stop string ending in the new text starts within the held-back tail
            hits = [i for i in (self.buf.find(s) for s in self.stop) if i >= 0]
            if hits:
                self.buf = self.buf[: min(hits)]
                return self._final("stop", flush=False)
        if len(self.tokens) >= self.max_tokens:
            return self._final("length")
        cut = max(0, len(self.buf) - self.hold) if self.stop else len(self.buf)
        text, self.buf = self.buf[:cut], self.buf[cut:]
        return text, None

    def _final(self, reason, flush=True):
        self.done = True
        if flush and self.detok is not None:
            self.detok.finalize()
            self.buf += self.detok.last_segment
        text, self.buf = self.buf, ""
        return text, reason
