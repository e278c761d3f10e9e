"""Structured output (`response_format` json_object / json_schema, Responses
`text.format`): a constrained decode. llguidance turns the schema into a
grammar and gives, at every step, the set of tokens that keep the output a
valid prefix; the others get -inf before sampling, so each token is drawn from
the model's distribution restricted to valid tokens and renormalized (the
constrained distribution, exactly). Like the other logits processors it runs
inside DFlash's verify (mlx_dflash/engine/logits.py): each verify row is masked after
its own history, so the accepted tokens are what plain decoding would draw."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Optional

from .errors import bad_request

# compact JSON: no whitespace between tokens, "," and ":" as separators. Every token
# goes to the object itself (a pretty-printed object of 3 fields took 62 tokens and could
# run out of max_tokens), and a weak model cannot loop on blank lines.
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_TOKENIZERS = {}  # id(tokenizer wrapper) -> (wrapper, llguidance tokenizer): building one walks the vocab
_LOCK = threading.Lock()


@dataclass
class Format:
    """What the client asked for, checked at request time (no model needed)."""

    kind: str  # "json_object" | "json_schema"
    grammar: str  # llguidance grammar (JSON)
    param: str

    @property
    def label(self) -> str:
        return f"response_format {self.kind}"


def _llguidance():
    try:
        import llguidance
    except ImportError:
        return None
    return llguidance


def parse_format(kind: Optional[str], schema, param: str) -> Optional[Format]:
    """None for plain text; a Format for json_object / json_schema; a 400 for a
    schema the grammar compiler refuses or when llguidance is missing."""
    if kind in (None, "text"):
        return None
    llg = _llguidance()
    if llg is None:
        raise bad_request(f"{param} '{kind}' needs constrained decoding, which needs the llguidance package "
                   "(pip install llguidance); it is not installed on this server", param, "unsupported_parameter")
    if kind == "json_object":
        schema = {"type": "object"}
    elif not isinstance(schema, dict):
        raise bad_request(f"{param}: json_schema needs a 'schema' object", param)
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=COMPACT)
    except Exception as e:  # the compiler's one-line complaint about the schema
        raise bad_request(f"{param}: the schema cannot be compiled: {str(e).splitlines()[0] if str(e) else e}",
                   param) from None
    err = llg.LLMatcher.validate_grammar(grammar)
    if err:
        raise bad_request(f"{param}: the schema cannot be compiled: {err.splitlines()[0]}", param)
    return Format(kind, grammar, param)


def ll_tokenizer(tok, n_vocab: int):
    """llguidance's view of an mlx-lm tokenizer (cached: building one walks the vocabulary)."""
    import llguidance.hf

    with _LOCK:
        hit = _TOKENIZERS.get(id(tok))
        if hit is not None and hit[0] is tok and hit[2] == n_vocab:
            return hit[1]
        hf = getattr(tok, "_tokenizer", tok)
        eos = list(tok.eos_token_ids)
        llt = llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos[0] if len(eos) == 1 else eos)
        _TOKENIZERS.clear()  # one model at a time
        _TOKENIZERS[id(tok)] = (tok, llt, n_vocab)
        return llt


class Constrained:
    """A logits processor for mlx-lm's generate_step and DFlash's verify: masks
    every token the grammar does not allow next. History-based: it keeps the
    generated ids it consumed, and a call whose history is not an extension of
    them (a verify row, then the accepted prefix) rolls the matcher back to the
    common prefix first. The matcher never enters its error state: a history
    with a token the grammar forbids (a row past a rejected draft) consumes its
    valid prefix only and leaves that row's logits as they are (the acceptance
    stops at that draft: the row before it forbids it)."""

    def __init__(self, fmt: Format, tok, n_vocab: int, n_prompt: int):
        import llguidance

        self.matcher = llguidance.LLMatcher(ll_tokenizer(tok, n_vocab), fmt.grammar)
        self.n_prompt, self.ids, self.n_vocab = n_prompt, [], n_vocab

    def __call__(self, tokens, logits):
        ids = tokens[self.n_prompt:].tolist() if tokens.size > self.n_prompt else []
        k = common_prefix(self.ids, ids)
        if k < len(self.ids):
            self.matcher.rollback(len(self.ids) - k)
            del self.ids[k:]
        new = ids[k:]
        if new:
            ok = self.matcher.validate_tokens(new)
            if ok:
                self.matcher.consume_tokens(new[:ok])
                self.ids += new[:ok]
            if ok < len(new):  # a history the grammar forbids: this row is never used
                return logits
        if self.matcher.is_error():
            raise ValueError(f"constrained decoding failed: {self.matcher.get_error()}")
        return masked(self.matcher, logits)


def common_prefix(seen: list, ids: list) -> int:
    """How many of the ids a processor consumed (`seen`) begin the history `ids`
    (all of them, the usual case, is checked at C speed)."""
    if ids[: len(seen)] == seen:
        return len(seen)
    return next(i for i, (a, b) in enumerate(zip(seen, ids + [None])) if a != b)


def masked(matcher, logits):
    """`logits` [1, V] with every token `matcher` does not allow next at -inf."""
    import mlx.core as mx
    import numpy as np

    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    allowed = np.unpackbits(bits, bitorder="little")[: logits.shape[-1]].astype(bool)
    if allowed.shape[0] < logits.shape[-1]:  # ids past the tokenizer's words: never valid
        allowed = np.concatenate([allowed, np.zeros(logits.shape[-1] - allowed.shape[0], bool)])
    if not allowed.any():
        raise ValueError("constrained decoding failed: the grammar allows no next token")
    return mx.where(mx.array(allowed), logits, mx.array(-float("inf"), logits.dtype))
