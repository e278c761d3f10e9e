"""A request's prompt as token ids: the chat template with tools and the system
prompt setting, or a completion prompt; refused in one line when it cannot fit the
model's context, counted without tokenizing more than the context's worth of text
(a huge request must not hold the worker)."""

from __future__ import annotations

import weakref
from typing import List, Optional, Tuple

from .catalog import Job, context_limit
from .errors import APIError, ContextTooLong, bad_request, error_line
from .render import render
from .tools import forced_prefix, template_tools

CHUNK_CHARS = 32 << 10  # a long prompt is counted in pieces of this size, stopping once it cannot fit


def prompt_ids(job: Job, lm, settings) -> Tuple[List[int], str]:
    """(prompt token ids, the text forced after the generation prompt)."""
    tok, req = lm.tokenizer, job.req
    vocab = vocab_size(lm)
    prefix = ""
    if job.kind in ("chat", "count"):
        if not getattr(tok, "chat_template", None):
            raise bad_request(f"model '{lm.id}' has no chat template; use /v1/completions", "messages")
        msgs = [dict(m) for m in req.messages]
        system = settings.system_prompt
        if system and not (msgs and msgs[0]["role"] == "system"):
            msgs.insert(0, {"role": "system", "content": system})
        tools = template_tools(req)
        if tools and not getattr(tok, "has_tool_calling", False):
            raise bad_request(f"model '{lm.id}' has no tool-call format (mlx-lm knows no tool parser for its "
                              "chat template); send the request without tools", "tools", "tools_unsupported")
        kw = dict(req.template_kwargs)
        if req.response_format is not None:  # the grammar allows no thinking: the template's off switch
            kw.setdefault("enable_thinking", False)
        if tools:
            kw["tools"] = tools
        try:
            text = render(tok, msgs, **kw)  # system messages anywhere: in place or merged
        except Exception as e:  # jinja raise_exception(): e.g. roles that must alternate
            raise bad_request(f"the chat template rejected these messages: {error_line(e)}", "messages") from None
        if tools:
            prefix = forced_prefix(req, tok)
            text += prefix
        ids = encode(tok, text, limit(job, lm))
    elif isinstance(req.prompt, str):
        ids = encode(tok, req.prompt, limit(job, lm))
    else:
        ids = list(req.prompt)
        bad = [t for t in ids if vocab is not None and t >= vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (size {vocab})", "prompt")
    if not ids:
        raise bad_request("the prompt is empty", "prompt")
    for k in (req.logit_bias or {}):
        if vocab is not None and int(k) >= vocab:
            raise bad_request(f"logit_bias token id {k} is outside the vocabulary (size {vocab})", "logit_bias")
    return ids, prefix


def vocab_size(lm) -> Optional[int]:
    n = getattr(getattr(lm.model, "args", None), "vocab_size", None)
    return int(n) if isinstance(n, int) else None


def max_new_tokens(asked: Optional[int], n_prompt: int, ctx: Optional[int], cap: Optional[int],
                   default: int) -> int:
    """How many tokens a request may generate, as the APIs decide it: what the client
    asked for (`asked`), else the room left in the context (`ctx`: the model's own
    limit, from its config) capped by the server's max_tokens setting only where a
    user set one (`cap`); never past the end of the context (finish_reason "length").
    A model whose config says no context gets `cap`, else the settings' `default`."""
    room = None if ctx is None else max(1, ctx - n_prompt)
    want = asked if asked is not None else cap
    if want is None:
        return room if room is not None else default
    return want if room is None else max(1, min(want, room))


def user_cap(catalog, model_id: str) -> Optional[int]:
    """The max_tokens setting of `model_id` where a user set one, else None (catalog.Catalog)."""
    return catalog.explicit_max_tokens(model_id)


def limit(job: Job, lm) -> Optional[int]:
    """The most prompt tokens `job` may have (None: any, e.g. a token count)."""
    return None if job.kind == "count" else context_limit(lm.model)


def too_long(tokens: int, ctx: int, job: Job) -> APIError:
    return ContextTooLong(f"the prompt has {tokens} tokens; this model's context is {ctx} tokens",
                          "messages" if job.kind in ("chat", "count") else "prompt", tokens, ctx)


def text_chars(req) -> int:
    """Characters of text in a request (its messages' or prompt's strings): how
    long tokenizing it may take, known before any of it is rendered."""
    def size(x) -> int:
        if isinstance(x, str):
            return len(x)
        if isinstance(x, dict):
            return sum(size(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(size(v) for v in x)
        dump = getattr(x, "model_dump", None)
        return size(dump()) if dump is not None else 0

    return size(getattr(req, "messages", None)) + size(getattr(req, "prompt", None))


_max_token_chars: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def max_token_chars(tok) -> int:
    """The most characters of text one token of `tok` can stand for, from its
    vocabulary (computed once per tokenizer). A token's string in the vocabulary
    is never shorter than the text it decodes to (byte-level BPE spells each byte
    as one character, SentencePiece a space as one '▁', byte fallbacks as
    '<0xNN>'), so text of n characters has at least n / this many tokens."""
    try:
        return _max_token_chars[tok]
    except (KeyError, TypeError):
        pass
    n = max((len(t) for t in tok.get_vocab()), default=1)
    try:
        _max_token_chars[tok] = n
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return n


NORMALIZER_SLACK = 4  # a tokenizer's Unicode normalization may merge up to this many characters into one
COUNT_SLACK = 1.1  # counted in pieces, a prompt may differ a little from its count as a whole


def encode(tok, text: str, limit: Optional[int] = None) -> List[int]:
    """The token ids of `text`. With `limit`, a text that cannot fit in `limit`
    tokens is refused before it is tokenized whole: first from its length (a lower
    bound on its token count, max_token_chars), then by counting it in pieces of
    CHUNK_CHARS and stopping as soon as the count is clearly over. Memory and time
    stay bounded by the context, not by the request."""
    bos = tok.bos_token
    add = bos is None or not text.startswith(bos)
    try:
        if limit is not None and len(text) > CHUNK_CHARS:
            least = len(text) // (max_token_chars(tok) * NORMALIZER_SLACK)
            if least >= limit:
                raise ContextTooLong(f"the prompt has at least {least} tokens ({len(text)} characters); this "
                                     f"model's context is {limit} tokens", "prompt", least, limit)
            counted = 0
            for piece in pieces(text, CHUNK_CHARS):
                counted += len(tok.encode(piece, add_special_tokens=False))
                if counted > limit * COUNT_SLACK:
                    raise ContextTooLong(f"the prompt has more than {int(limit * COUNT_SLACK)} tokens; this model's "
                                         f"context is {limit} tokens", "prompt", int(limit * COUNT_SLACK), limit)
        return tok.encode(text, add_special_tokens=add)
    except (TypeError, ValueError) as e:
        raise bad_request(f"the tokenizer cannot encode this text: {error_line(e)}", "prompt") from None


def pieces(text: str, size: int):
    """`text` in pieces of about `size` characters, cut after a newline or space
    where there is one (tokenizers split words there too, so the counts add up)."""
    i = 0
    while i < len(text):
        j = min(len(text), i + size)
        if j < len(text):
            cut = max(text.rfind("\n", i + size // 2, j), text.rfind(" ", i + size // 2, j))
            if cut > i:
                j = cut + 1
        yield text[i:j]
        i = j
