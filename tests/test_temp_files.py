"""Temp files of our atomic writers that a killed process left behind are
removed when a store opens (settings, saved chats); nothing else is touched."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from app.chat.history import Chat, HistoryStore
from mlx_dflash.settings.store import SettingsStore

ROOT = Path(__file__).resolve().parent.parent
KILLED_WRITER = """
import os, sys, time
from mlx_dflash.settings.store import atomic_write
os.replace = lambda *a: (print("written", flush=True), time.sleep(600))  # killed before the rename
atomic_write(__import__("pathlib").Path(sys.argv[1]), "x" * 100)
"""


def _killed_write(path: Path) -> Path:
    """Run a writer, SIGKILL it between its write and its rename; its temp file."""
    before = set(path.parent.iterdir()) if path.parent.is_dir() else set()
    p = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "written"
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    (tmp,) = [q for q in set(path.parent.iterdir()) - before if q.name.endswith(".tmp")]
    return tmp


def _age(p: Path, seconds=120):
    t = time.time() - seconds
    os.utime(p, (t, t))


def test_killed_writers_leave_nothing_after_the_next_start(tmp_path):
    chats = tmp_path / "chats"
    HistoryStore(chats).save(Chat(id="c1"))
    settings = tmp_path / "settings.json"
    temps = [_killed_write(chats / "c2.json"), _killed_write(chats / "c1.json"), _killed_write(settings)]
    fresh = _killed_write(chats / "c3.json")  # under a minute old: a live writer may own it
    for t in temps:
        _age(t)
    mine = chats / "my-notes.tmp"
    mine.write_text("not ours")
    _age(mine)
    HistoryStore(chats)
    SettingsStore(settings)
    assert not any(t.exists() for t in temps)
    assert fresh.exists() and mine.exists() and (chats / "c1.json").exists()
    assert [c.id for c in HistoryStore(chats).list()[0]] == ["c1"]
