"""Reasoning text: what a thinking model (Qwen3, DeepSeek-R1, ...) writes
between its think markers, split from the answer so each API can report it as
its own kind (chat `reasoning_content`, Anthropic `thinking` blocks, Responses
`reasoning` items). The markers are mlx-lm's for the tokenizer
(TokenizerWrapper.think_start / think_end); a template that opens the block in
the generation prompt starts the output inside it."""

from __future__ import annotations

from typing import Tuple

from .tools import partial_marker

TAIL_TOKENS = 8  # how far back from the prompt's end the opening marker is looked for


def opens_thinking(tok, ids, prefix: str = "") -> bool:
    """Whether the prompt ends inside a reasoning block (the template wrote the
    start marker after the generation prompt, and nothing forced after it)."""
    start = getattr(tok, "think_start", None)
    if not start or prefix or not getattr(tok, "has_thinking", False):
        return False
    return tok.decode(list(ids[-TAIL_TOKENS:])).rstrip().endswith(start)


class ThinkStream:
    """Feed text pieces; get back (reasoning, answer) text. A piece that may be
    the start of a marker is held back until it is known not to be one."""

    def __init__(self, tok, inside: bool = False):
        self.start, self.end = tok.think_start, tok.think_end
        self.inside = inside
        self.buf = ""
        self.lead = inside  # strip the whitespace that follows a marker (a template's line break)
        self.tokens = 0  # pieces that were reasoning (one per generated token)

    def feed(self, text: str) -> Tuple[str, str]:
        if self.inside:
            self.tokens += 1
        self.buf += text
        reasoning, answer = [], []
        while True:
            marker = self.end if self.inside else self.start
            i = self.buf.find(marker)
            if i < 0:
                keep = partial_marker(self.buf, marker)
                self._emit(self.buf[: len(self.buf) - keep], reasoning, answer)
                self.buf = self.buf[len(self.buf) - keep:]
                break
            self._emit(self.buf[:i], reasoning, answer)
            self.buf, self.inside, self.lead = self.buf[i + len(marker):], not self.inside, True
        return "".join(reasoning), "".join(answer)

    def finish(self) -> Tuple[str, str]:
        """The end of generation: what is held back (reasoning if a block is still open)."""
        reasoning, answer = [], []
        self._emit(self.buf, reasoning, answer)
        self.buf = ""
        return "".join(reasoning), "".join(answer)

    def _emit(self, s: str, reasoning: list, answer: list) -> None:
        if self.lead:
            s = s.lstrip()
            self.lead = not s
        if s:
            (reasoning if self.inside else answer).append(s)
