"""The chat's engine side: the model manager it talks to, one answer being
generated (Turn), the messages the engine thread posts to the UI, and the
generation job itself (run on the engine thread)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from textual.message import Message

from mlx_dflash import DecodeConfig, stream_generate
from mlx_dflash.cache.prompt_store import PromptStore, open_store
from mlx_dflash.engine.calibrate import DEFAULT as CALIBRATION
from mlx_dflash.engine.cost_source import prepare_at_load
from mlx_dflash.settings.schema import GlobalSettings
from mlx_dflash.target.adapter import Target

from .history import Chat


class ManagerBackend:
    """What the chat needs from the model manager; tests may pass another object
    with these methods."""

    def __init__(self, store=None):
        from mlx_dflash.models.settings_checks import settings_store

        self.store = store if store is not None else settings_store()

    def resolve(self, model_id):
        from mlx_dflash.models.model_names import resolve

        return resolve(model_id, self.store, download=True)

    def targets(self) -> list:
        from mlx_dflash.models.discovery import list_targets

        return list_targets(self.store)

    def load(self, model_id):
        from mlx_dflash.models.manager import load_model

        return load_model(model_id, self.store)

    def save_settings(self, model_id, **changes):
        return self.store.set_model(model_id, **changes)


def prompt_store(backend, lm) -> PromptStore:
    """The loaded model's prompt store: the conversation being continued (and a
    few others) in memory, every turn's prefix on disk, so a new chat, a chat
    opened again or the next start of the app finds its prompt prefilled."""
    try:
        g = backend.store.globals()
    except (AttributeError, ValueError):  # a backend without settings, or an unreadable file
        g = GlobalSettings()
    return open_store(*g.prompt_store_bytes(), lm.model, lm.tokenizer, lm.drafter, lm.id, keep_last=True)


def costs_at_load(lm) -> None:
    """The guard's costs for short contexts, at load (measured once per machine,
    then cached), so the first answer measures nothing; a long conversation's
    curves are measured when it first reaches their length (`mlx-dflash doctor`
    measures them ahead)."""
    if DecodeConfig.from_settings(lm.settings, lm.drafter).needs_costs(lm.drafter, 0):
        prepare_at_load(lm.model, lm.drafter, CALIBRATION)


# settings whose change needs the drafter (or model) loaded again
RELOAD_KEYS = ("drafter", "drafter_quant_bits", "drafter_quant_group_size", "drafter_activation_dtype", "dtype")

# stats the chat keeps per answer (GenerationStats.to_dict keys)
STATS_KEYS = ("mode", "fallback", "policy", "max_width", "width", "guard", "prompt_tokens", "reused_tokens",
              "generation_tokens", "cycles", "drafted", "accepted", "tau", "acceptance_rate", "generation_tps",
              "prompt_tps", "prompt_time", "generation_time", "peak_memory", "prompt_cache")


def build_prompt(tokenizer, system: str, messages: list) -> list:
    """Token ids of the conversation with the model's chat template (plain
    "role: text" lines for a tokenizer without one)."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": m["role"], "content": m["content"]} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
    text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
    return tokenizer.encode(text)


def one_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


@dataclass
class Turn:
    """One answer being generated (owned by the engine thread until Finished)."""

    chat: Chat
    loaded: object
    settings: object
    text: str = ""
    spans: list = field(default_factory=list)  # [[text, from_draft], ...] merged runs
    stats: dict = field(default_factory=dict)
    ttft: Optional[float] = None
    batches: int = 0  # token batches the UI received
    cancel: threading.Event = field(default_factory=threading.Event)
    widget: object = None
    question: object = None  # the chat's last message when the answer began
    recorded: bool = False  # added to the chat

    def add(self, text: str, from_draft: bool) -> None:
        if not text:
            return
        self.text += text
        if self.spans and self.spans[-1][1] == from_draft:
            self.spans[-1][0] += text
        else:
            self.spans.append([text, from_draft])


class Tokens(Message):
    def __init__(self, turn: Turn, pieces: list, stats: dict):
        super().__init__()
        self.turn, self.pieces, self.stats = turn, pieces, stats


class Finished(Message):
    def __init__(self, turn: Turn, reason: str, stats: dict, error: Optional[str] = None):
        super().__init__()
        self.turn, self.reason, self.stats, self.error = turn, reason, stats, error


class Prefill(Message):
    """Progress of a long prompt's prefill: `done` of `total` tokens."""

    def __init__(self, turn: Turn, done: int, total: int):
        super().__init__()
        self.turn, self.done, self.total = turn, done, total


class Cancelled(Exception):
    """Esc during the prefill (raised from its progress callback, between two chunks)."""


class Loaded(Message):
    def __init__(self, model_id, loaded=None, error: Optional[str] = None, store: Optional[PromptStore] = None):
        super().__init__()
        self.model_id, self.loaded, self.error, self.store = model_id, loaded, error, store


def turn_stats(st, turn: Turn) -> dict:
    d = st.to_dict()
    out = {k: d[k] for k in STATS_KEYS if k in d}
    out["ttft"] = turn.ttft
    return out


def generate_job(post, flush_s: float, turn: Turn, history: list, store: PromptStore) -> None:
    """Runs on the engine thread: stream the answer, posting token batches every
    `flush_s` seconds, then Finished. Esc sets turn.cancel, checked after each token
    and, during the prefill of a long prompt, after each chunk (Prefill messages
    show its progress). The prompt's longest cached prefix comes from `store`
    (memory, then disk); the cache goes back to it after, unless an error may
    have left it half-written."""
    lm, s = turn.loaded, turn.settings
    reason, pieces, r, err, pc = "stopped", [], None, None, None
    t0 = last = time.perf_counter()

    def progress(done: int, total: int) -> None:
        if turn.cancel.is_set():
            raise Cancelled
        if total > cfg.prefill_step_size:  # more than one chunk: worth showing
            post(Prefill(turn, done, total))

    try:
        prompt = build_prompt(lm.tokenizer, s.system_prompt, history)
        cfg = DecodeConfig.from_settings(s, lm.drafter, prefill_progress=progress)
        target = Target(lm.model)
        pc, _ = store.take(target, prompt, lm.drafter, cfg.keeps_drafter_context(lm.drafter, len(prompt)))
        gen = stream_generate(lm.model, lm.tokenizer, prompt, lm.drafter, prompt_cache=pc, config=cfg)
        try:
            while not turn.cancel.is_set():
                r = next(gen, None)
                if r is None:
                    break
                if turn.ttft is None:
                    turn.ttft = time.perf_counter() - t0
                if r.text:
                    pieces.append((r.text, r.from_draft))
                if r.finish_reason:
                    reason = r.finish_reason
                    break
                now = time.perf_counter()
                if pieces and now - last >= flush_s:
                    post(Tokens(turn, pieces, turn_stats(r.stats, turn)))
                    pieces, last = [], now
        finally:
            gen.close()  # stops the engine at once, leaving the prompt cache consistent
    except Cancelled:  # the prompt cache holds the chunks done: the next turn goes on from them
        pass
    except Exception as e:  # bad settings for this model and the like: one line in the chat
        reason, err = "error", one_line(e)
        pc = None  # a failure mid-prefill may leave it half-written: not kept
    if pc is not None:
        store.put(pc, target)
    stats = turn_stats(r.stats, turn) if r is not None else {"ttft": turn.ttft}
    if pieces:
        post(Tokens(turn, pieces, stats))
    post(Finished(turn, reason, stats, err))
