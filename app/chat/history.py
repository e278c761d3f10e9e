"""Chat history: one JSON file per chat under the user data dir
(`$MLX_DFLASH_HOME/data/chats` when that is set), written atomically (the
temp files a killed writer leaves are removed when a store opens). A file
that cannot be read is skipped with a notice and never deleted or overwritten."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

from mlx_dflash.platform.paths import data_dir
from mlx_dflash.settings.store import atomic_write, remove_stale_temps  # one crash-safe writer for settings and history

VERSION = 1


def chats_dir() -> Path:
    return data_dir() / "chats"


@dataclass
class Message:
    role: str  # user | assistant
    content: str
    spans: Optional[list] = None  # assistant: [[text, from_draft], ...] runs, for the token colours
    stats: Optional[dict] = None  # assistant: tokens, tok/s, tau, ttft, ...


@dataclass
class Chat:
    id: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
    title: str = ""
    model: Optional[str] = None
    system: str = ""
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    messages: List[Message] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"version": VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "Chat":
        if not isinstance(d, dict) or not isinstance(d.get("id"), str) or not isinstance(d.get("messages"), list):
            raise ValueError("not a chat file")
        msgs = [Message(m["role"], m["content"], m.get("spans"), m.get("stats")) for m in d["messages"]]
        return cls(id=d["id"], title=d.get("title", ""), model=d.get("model"), system=d.get("system", ""),
                   created=float(d.get("created", 0)), updated=float(d.get("updated", 0)), messages=msgs)


class HistoryStore:
    def __init__(self, root: Optional[Path] = None):
        self.root = Path(root) if root is not None else chats_dir()
        remove_stale_temps(self.root)  # left by a writer that was killed mid-save

    def path(self, chat_id: str) -> Path:
        return self.root / f"{chat_id}.json"

    def list(self) -> Tuple[List[Chat], List[str]]:
        """(chats, newest first; notices about files that were skipped)."""
        chats, notices = [], []
        if not self.root.is_dir():
            return chats, notices
        for p in sorted(self.root.glob("*.json")):
            try:
                chats.append(Chat.from_dict(json.loads(p.read_text(encoding="utf-8"))))
            except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:  # never a crash at start
                notices.append(f"skipped unreadable chat file {p.name} ({type(e).__name__}); it was left as is")
        chats.sort(key=lambda c: c.updated, reverse=True)
        return chats, notices

    def save(self, chat: Chat, touch: bool = True) -> None:
        """Write the chat; `touch` marks it as just used (a rename does not)."""
        if not chat.title:
            first = next((m.content for m in chat.messages if m.role == "user"), "")
            chat.title = " ".join(first.split())[:60]
        if touch:
            chat.updated = time.time()
        atomic_write(self.path(chat.id), json.dumps(chat.to_dict(), ensure_ascii=False, indent=1))

    def delete(self, chat_id: str) -> None:
        """Remove a chat's file (the chat list asks first)."""
        try:
            self.path(chat_id).unlink()
        except FileNotFoundError:
            pass
