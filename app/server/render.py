"""Chat messages to prompt text with the model's template. System (and
developer) messages anywhere in the conversation (Claude Code and Codex send
them mid-conversation) are rendered in place where the template accepts them,
and merged into the leading system message where it refuses them or drops them."""

from __future__ import annotations

from typing import List


def render(tok, msgs: List[dict], **kw) -> str:
    """The prompt text; the template's own exception if it rejects the messages."""
    later = [m["content"] for i, m in enumerate(msgs) if i and m["role"] == "system"]
    if later:
        try:
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw)
            if all(c in text for c in later):  # a template may skip them without a word
                return text
        except Exception:  # e.g. "System message must be at the beginning"
            pass
        msgs = merge_system(msgs)
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw)


def merge_system(msgs: List[dict]) -> List[dict]:
    """Every system message's text in one leading system message, in order."""
    system = [m["content"] for m in msgs if m["role"] == "system" and m["content"]]
    rest = [m for m in msgs if m["role"] != "system"]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest
