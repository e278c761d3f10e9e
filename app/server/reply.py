"""One request's answer as the API's events: the engine's responses in,
("think" | "token" | "call") events out to the job, with reasoning and tool
calls split from the text (reasoning.ThinkStream, tools.ToolStream), so every
API gets the same events; and, once the stream ends, how it ended (the finish
reason and the stop string that ended it)."""

from __future__ import annotations

from typing import Optional, Tuple

from .processors import logprob_entry
from .reasoning import ThinkStream, opens_thinking
from .tools import ToolStream, template_tools


class Reply:
    """Feed it the engine's responses in order (`feed`); then `ending(last)`."""

    def __init__(self, job, tok, ids, prefix: str = "", stops: Optional[list] = None):
        req = job.req
        self.job, self.tok, self.stops = job, tok, stops
        self.n_lp = req.n_logprobs()
        self.eos = set(tok.eos_token_ids)
        chat = job.kind == "chat"
        self.tools = ToolStream(tok, template_tools(req), prefix) if chat and req.uses_tools() else None
        self.think = ThinkStream(tok, opens_thinking(tok, ids, prefix)) if chat and \
            getattr(tok, "has_thinking", False) and req.response_format is None else None  # (constrained: all answer)
        self.raw, self.ids = [], []  # the text as generated, and the ids but an end token
        self.cut = False  # ended after a tool call, the one the request asked for

    @property
    def reasoning_tokens(self) -> int:
        return self.think.tokens if self.think is not None else 0

    def feed(self, r) -> bool:
        """Send `r`'s events; False where the answer ends here though the
        engine would go on (one tool call asked for: the rest would be dropped)."""
        is_eos = r.finish_reason == "stop" and r.token in self.eos
        self.raw.append(r.text)
        if not is_eos:
            self.ids.append(r.token)
        text, calls, reasoning = r.text, [], ""
        if self.think is not None:  # reasoning first: a call inside it is part of the thought
            reasoning, text = self.think.feed(r.text)
            if r.finish_reason:
                done = self.think.finish()
                reasoning, text = reasoning + done[0], text + done[1]
        if self.tools is not None:
            evs = self.tools.feed(text) + (self.tools.finish() if r.finish_reason else [])
            text = "".join(e[1] for e in evs if e[0] == "text")
            calls = [e[1] for e in evs if e[0] == "call"]
        lp = logprob_entry(self.tok, r.token, r.logprobs, self.n_lp) if self.n_lp is not None and not is_eos else None
        if reasoning:
            self.job.send("think", reasoning)
        self.job.send("token", text, None if is_eos else r.token, lp)
        for c in calls:
            self.job.send("call", c)
        if calls and not self.job.req.parallel_tool_calls and not r.finish_reason:
            self.cut = True
            return False
        return True

    def ending(self, last) -> Tuple[str, Optional[str]]:
        """(finish reason, the stop string that ended it or None), after `last`, the last response fed."""
        finish = last.finish_reason
        if self.cut or (finish == "stop" and self.tools is not None and self.tools.calls):
            finish = "tool_calls"
        stop_seq = None
        if last.finish_reason == "stop" and last.token not in self.eos and self.stops:
            full, n = self.tok.decode(self.ids), len("".join(self.raw))  # the text was cut where the stop began
            hits = sorted((i, x) for x in self.stops if (i := full.find(x, max(0, n - len(x)))) >= 0)
            stop_seq = hits[0][1] if hits else None
        return finish, stop_seq
