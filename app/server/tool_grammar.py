"""Tool calls the client can run. Once the model opens a call (the tokenizer's
tool-call start marker, as it chose to), the call is decoded under a grammar:
a JSON object whose `name` is one of the offered tools and whose `arguments`
fit that tool's parameters schema as JSON Schema means it (tool_schema.py:
llguidance compiles the schema itself), then the end marker. Before and after
a call the model's text is untouched; inside one, each token is drawn from the
model's distribution restricted to tokens that keep the call valid (llama.cpp's
lazy tool grammar). A call the model writes validly is kept as written (any
JSON layout; declared keys in the schema's order, as llguidance writes objects);
one that would name a tool the client does not have, leave out a required key,
add a key the schema does not allow, or never close its JSON, becomes a call
the client can run, instead of text that is neither.

The grammar covers the JSON-in-tags format (mlx-lm's json_tools parser: Qwen,
Hermes) and Qwen3-Coder's XML (xml_grammar.py: the same rules in its own syntax),
with single-token markers; other formats decode as the model writes.
Setting `tool_grammar` off (per model) leaves every call as written."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from functools import lru_cache
from typing import List, Optional

try:
    import llguidance
except ImportError:  # (a dependency; where its wheel is missing, calls are served as the model writes them)
    llguidance = None

from .structured import common_prefix, ll_tokenizer, masked
from .tool_schema import WS, arguments
from .tools import GenRequest, forced_name, forced_prefix, parser_name, template_tools
from .xml_grammar import call_grammar as xml_call_grammar


def _marker_id(tok, marker: Optional[str]) -> Optional[int]:
    """The id of a marker that is one token of the vocabulary, else None."""
    if not marker:
        return None
    ids = tok.encode(marker, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def unsupported(tok) -> Optional[str]:
    """Why this tokenizer's tool calls get no grammar (None: they do)."""
    if llguidance is None:
        return "llguidance is not installed (pip install llguidance)"
    if not getattr(tok, "has_tool_calling", False):
        return "the model has no tool-call format"
    if parser_name(tok) not in FORMATS:
        return f"its tool-call format ({parser_name(tok)}) has no grammar here (JSON in tags and Qwen3-Coder's XML do)"
    if _marker_id(tok, tok.tool_call_start) is None or _marker_id(tok, tok.tool_call_end) is None:
        return "its tool-call markers are not single tokens"
    return None


def _lit(s: str) -> str:
    """A JSON string as a Lark literal (non-ASCII as itself, as models write it)."""
    return json.dumps(json.dumps(s, ensure_ascii=False))


def grammar(tok, tools: List[dict]) -> str:
    """The llguidance (Lark) grammar of what follows the start marker: one call to
    one of `tools` (OpenAI-style function tools) in the tokenizer's format, then the end marker."""
    # (the tools in order: keys go in the schema's order)
    return _grammar(parser_name(tok), _marker_id(tok, tok.tool_call_end), json.dumps(tools))


@lru_cache(maxsize=16)  # an agent sends the same tools with every request
def _grammar(fmt: str, end: int, tools_json: str) -> str:
    return FORMATS[fmt](json.loads(tools_json), end)


def json_call_grammar(tools: List[dict], end: int) -> str:
    """JSON in tags (mlx-lm's json_tools parser): {"name": ..., "arguments": {...}}."""
    rules, alts = [], []
    for i, t in enumerate(tools):
        fn = t["function"]
        alts.append(f"c{i}")
        name, args = f'"\\"name\\"" ws ":" ws {_lit(fn["name"])}', f'"\\"arguments\\"" ws ":" ws a{i}'
        rules.append(f'c{i}: {name} ws "," ws {args} | {args} ws "," ws {name}')  # either order parses
        rules.append(f"a{i}: {arguments(fn)}")
    head = [f'start: NL? "{{" ws ({" | ".join(alts)}) ws "}}" NL? <[{end}]>', "ws: WS?", f"WS: /{WS}/",
            'NL: "\\n"']
    return "\n".join(head + rules)


FORMATS = {"json_tools": json_call_grammar, "qwen3_coder": xml_call_grammar}  # mlx-lm parser -> call grammar


# (id of the llguidance tokenizer, grammar) -> (that tokenizer, kept alive so its id stays
# its own, and a matcher compiled at the grammar's start)
_COMPILED: "OrderedDict[tuple, tuple]" = OrderedDict()
_LOCK = threading.Lock()


def _compiled(llt, text: str):
    """A fresh matcher at the grammar's start: a copy of one compiled once (compiling
    an agent's 24 tools takes ~0.1 s; a copy, microseconds); None if the grammar
    does not compile (tools whose schemas it cannot take: their calls go as written)."""
    with _LOCK:
        key = (id(llt), text)
        if key not in _COMPILED:
            try:
                m = llguidance.LLMatcher(llt, text)
            except Exception:  # (it reports errors in the matcher; a raise is not expected)
                m = None
            _COMPILED[key] = (llt, None if m is None or m.is_error() else m)
            if len(_COMPILED) > 8:
                _COMPILED.popitem(last=False)
        _COMPILED.move_to_end(key)
        m = _COMPILED[key][1]
        return None if m is None else m.deep_copy()


class ToolCallGrammar:
    """A logits processor (the engine's contract: it may be called with histories
    that are not extensions of the last call, as verify rows and rollbacks make
    them; it keeps its state as a function of the history). `opened`: tool_choice
    opened the call in the prompt (`prompt_ids` end inside it)."""

    def __init__(self, tok, llt, text: str, prompt_ids: List[int], opened: bool = False):
        self.llt, self.text = llt, text
        self.start = _marker_id(tok, tok.tool_call_start)
        self.n_prompt = len(prompt_ids)
        self.gen: List[int] = []  # the generated ids the state below reflects
        self.calls: List[list] = []  # [first body position, position after the end marker or None]
        self.matcher = None  # the open call's
        self.n_in = 0  # generated ids the open call's matcher consumed
        self.dead: Optional[int] = None  # the first position the open call's grammar refused
        self.pre: List[int] = []  # the open call's body already in the prompt (tool_choice)
        if opened and self.start in prompt_ids:
            self.pre = list(prompt_ids[len(prompt_ids) - prompt_ids[::-1].index(self.start):])
            self._open(0)

    def _open(self, at: int) -> None:
        self.matcher = _compiled(self.llt, self.text)
        if at == 0 and self.pre:
            if self.matcher.validate_tokens(self.pre) < len(self.pre):
                self.matcher, self.dead = None, -1  # the prompt's call text is not the format: leave it
                return
            self.matcher.consume_tokens(self.pre)
        self.calls.append([at, None])
        self.n_in = 0

    def _push(self, t: int) -> None:
        p = len(self.gen)
        self.gen.append(t)
        if self.dead is not None:
            return
        if self.matcher is None:
            if t == self.start:
                self._open(p + 1)
            return
        if self.matcher.validate_tokens([t]) < 1:
            self.dead = p  # a draft past what the grammar allows: rows after it are never used
            return
        self.matcher.consume_token(t)
        self.n_in += 1
        if self.matcher.is_stopped():  # the end marker: back to the model's own text
            self.calls[-1][1] = p + 1
            self.matcher = None

    def _rewind(self, k: int) -> None:
        del self.gen[k:]
        if self.dead is not None:
            if self.dead < k:  # still past what the grammar allows: nothing after it was taken in
                return
            self.dead = None
        while self.calls and self.calls[-1][0] > k and not (self.calls[-1][0] == 0 and self.pre):
            self.calls.pop()  # opened by a marker at or after k
            self.matcher = None
        if not self.calls or (self.calls[-1][1] is not None and self.calls[-1][1] <= k):
            self.matcher = None
            return
        at, end = self.calls[-1]
        if end is not None or self.matcher is None:  # back inside a call: replay its body up to k
            self.calls.pop()
            self._open(at)
            if self.matcher is not None:
                self.matcher.consume_tokens(self.gen[at:k])
                self.n_in = k - at
            return
        back = self.n_in - (k - at)
        if back > 0:
            self.matcher.rollback(back)
            self.n_in -= back

    def __call__(self, tokens, logits):
        gen = tokens[self.n_prompt:].tolist() if tokens.size > self.n_prompt else []
        k = common_prefix(self.gen, gen)  # shorter than what it has: a verify row or a rollback
        if k < len(self.gen):
            self._rewind(k)
        for t in gen[k:]:
            self._push(int(t))
        if self.matcher is None or self.dead is not None:
            return logits
        return masked(self.matcher, logits)


def call_grammar(req: GenRequest, tok, n_vocab: int, prompt_ids: List[int]) -> Optional[ToolCallGrammar]:
    """The request's tool-call grammar, or None (no tools offered, or a format without one)."""
    tools = template_tools(req)
    if not tools or unsupported(tok) is not None:
        return None
    if forced_name(req.tool_choice):
        tools = [t for t in tools if t["function"]["name"] == forced_name(req.tool_choice)]
    llt, text = ll_tokenizer(tok, n_vocab), grammar(tok, tools)
    if _compiled(llt, text) is None:
        return None
    return ToolCallGrammar(tok, llt, text, prompt_ids, opened=bool(forced_prefix(req, tok)))
