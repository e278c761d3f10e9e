"""Where mlx-dflash keeps its files: settings (config dir), caches (cost curves,
dtype choices, prompt caches) and data (saved chats). `MLX_DFLASH_HOME` puts
all three under one folder (tests, a portable install)."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir, user_config_dir, user_data_dir

APP = "mlx-dflash"


def _home() -> "Path | None":
    env = os.environ.get("MLX_DFLASH_HOME")
    return Path(env).expanduser() if env else None


def config_dir() -> Path:
    """The folder that holds settings.json."""
    home = _home()
    return home if home is not None else Path(user_config_dir(APP, appauthor=False))


def cache_dir() -> Path:
    """Measured costs, dtype choices and other caches that can be rebuilt."""
    home = _home()
    return home / "cache" if home is not None else Path(user_cache_dir(APP))


def data_dir() -> Path:
    """What a user made and would miss: saved chats."""
    home = _home()
    return home / "data" if home is not None else Path(user_data_dir(APP))
