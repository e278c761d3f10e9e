"""Which drafter goes with a target, so that `--model TARGET` alone finds it.

Two sources, in this order:
1. a local scan (the embedded models, $MLX_DFLASH_MODELS_DIR, the settings'
   model_dirs, the Hugging Face cache) for
   DFlash drafters that fit the target's shapes and either are a registry drafter
   of the target or name the target in their config (`target_model`, `base_model`)
   or model card (`base_model:`);
2. the registry below: published drafter repos by target, matched on the target's
   base name, so `Qwen/Qwen3-8B`, `mlx-community/Qwen3-8B-4bit` and a local folder
   `Qwen3-8B-8bit` all map to the same drafter.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from ..settings.store import SettingsStore
from . import discovery

# base name (lowercase, no org, no quantization suffix) -> published drafters, preferred first
KNOWN = {
    "qwen3-4b": ["z-lab/Qwen3-4B-DFlash-b16"],
    "qwen3-8b": ["z-lab/Qwen3-8B-DFlash-b16"],
    "qwen3-coder-30b-a3b-instruct": ["z-lab/Qwen3-Coder-30B-A3B-DFlash"],
    "qwen3-coder-next": ["z-lab/Qwen3-Coder-Next-DFlash"],
    "qwen3.5-4b": ["z-lab/Qwen3.5-4B-DFlash"],
    "qwen3.5-9b": ["z-lab/Qwen3.5-9B-DFlash"],
    "qwen3.5-27b": ["z-lab/Qwen3.5-27B-DFlash"],
    "qwen3.5-35b-a3b": ["z-lab/Qwen3.5-35B-A3B-DFlash"],
    "qwen3.5-122b-a10b": ["z-lab/Qwen3.5-122B-A10B-DFlash"],
    "qwen3.6-27b": ["z-lab/Qwen3.6-27B-DFlash"],
    "qwen3.6-35b-a3b": ["z-lab/Qwen3.6-35B-A3B-DFlash"],
    "qwen3.8-27b": ["z-lab/Qwen3.8-27B-DFlash2"],
    "llama-3.1-8b-instruct": ["z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"],
    "gpt-oss-20b": ["z-lab/gpt-oss-20b-DFlash"],
    "gpt-oss-120b": ["z-lab/gpt-oss-120b-DFlash"],
    "gemma-4-31b-it": ["z-lab/gemma-4-31B-it-DFlash"],
    "kimi-k2.5": ["z-lab/Kimi-K2.5-DFlash"],
    "muse-glimmer-30b": ["z-lab/Muse-Glimmer-30B-DFlash2"],
}

# Conversion suffixes (mlx-community and others): "-4bit", "-MLX-8bit", "-bf16", "-MXFP4-Q8", ...
_SUFFIX = re.compile(r"[-_.](mlx|\d+bit|\d+-bit|bf16|fp16|f16|fp32|fp8|mxfp4|nvfp4|q\d(_k(_[ms])?)?|dwq|awq|gptq"
                     r"|gguf|hf|mixed(_\d+_\d+)?)$")


def base_name(ref: str) -> str:
    """'mlx-community/Meta-Llama-3.1-8B-Instruct-4bit' -> 'llama-3.1-8b-instruct'.
    A Hugging Face cache path counts by its repo name."""
    s = str(ref).rstrip("/")
    m = re.search(r"models--[^/]+--([^/]+)", s)
    s = m.group(1) if m else s.rsplit("/", 1)[-1]
    s = s.lower()
    s = s.removeprefix("meta-")
    prev = None
    while prev != s:
        prev, s = s, _SUFFIX.sub("", s)
    return s


def known_drafters(target_ref: str, target_path: Optional[Path] = None) -> list:
    """Registry drafters for a target id or folder (its model card's base_model too)."""
    names = [base_name(target_ref)]
    if target_path is not None:
        names += [base_name(b) for b in _card_base_models(Path(target_path))]
    out = []
    for n in names:
        for r in KNOWN.get(n, []):
            if r not in out:
                out.append(r)
    return out


def _card_base_models(folder: Path) -> list:
    """`base_model:` entries of a model card's YAML front matter (no YAML parser needed)."""
    card = folder / "README.md"
    if not card.is_file():
        return []
    text = card.read_text(errors="ignore")
    if not text.startswith("---"):
        return []
    front = text.split("---", 2)[1] if text.count("---") >= 2 else ""
    out, in_list = [], False
    for line in front.splitlines():
        if line.startswith("base_model:"):
            v = line.split(":", 1)[1].strip().strip("'\"")
            in_list = not v
            if v:
                out.append(v)
        elif in_list and line.strip().startswith("- "):
            out.append(line.strip()[2:].strip().strip("'\""))
        elif in_list and line and not line.startswith(" "):
            in_list = False
    return out


def _candidates(roots: Iterable[Path]) -> Iterable[tuple]:
    """(folder, repo id or None, config) of every DFlash drafter under the roots:
    plain model folders one level down, and Hugging Face cache snapshots."""
    for root in roots:
        root = Path(root).expanduser()
        if not root.is_dir():
            continue
        for sub in sorted(root.iterdir()):
            if sub.name.startswith("models--"):  # a Hugging Face cache entry
                repo = sub.name[len("models--"):].replace("--", "/", 1)
                snaps = sorted((sub / "snapshots").glob("*/config.json"), key=lambda p: p.stat().st_mtime)
                folders = [snaps[-1].parent] if snaps else []
            else:
                repo, folders = None, [sub] if (sub / "config.json").is_file() else []
            for f in folders:
                try:
                    cfg = json.loads((f / "config.json").read_text())
                except (OSError, ValueError):
                    continue
                if isinstance(cfg, dict) and "dflash_config" in cfg:
                    yield f, repo, cfg


def _names_target(cfg: dict, folder: Path, target_names: set) -> bool:
    dc = cfg.get("dflash_config") or {}
    named = [cfg.get(k) or dc.get(k) for k in ("target_model", "target_model_id", "target", "base_model")]
    named += _card_base_models(folder)
    return any(isinstance(n, str) and base_name(n) in target_names for n in named)


def _fits(cfg: dict, target_cfg: dict) -> bool:
    t = target_cfg.get("text_config") or target_cfg
    if cfg.get("hidden_size") != t.get("hidden_size") or cfg.get("vocab_size") != t.get("vocab_size"):
        return False
    n = cfg.get("num_target_layers")
    return not n or n == t.get("num_hidden_layers")


def default_roots() -> list:
    roots = [discovery.models_dir()]
    extra = os.environ.get("MLX_DFLASH_MODELS_DIR")
    if extra:
        roots.append(Path(extra))
    try:  # the user's model folders (`settings set model_dirs ...`)
        roots += [Path(d) for d in SettingsStore().globals().model_dirs]
    except Exception:  # an unreadable settings file must not stop a load; `settings` reports it
        pass
    roots.append(discovery.hf_cache_dir())  # the environment, read at call time
    return roots


@dataclass
class Found:
    path: Optional[Path]  # a local drafter folder, or None when only the registry knows one
    repo: Optional[str]  # the registry / cache repo id, when there is one
    why: str  # how it was found (for `inspect` and notices)


def find_drafter(target_ref: str, target_path: Path, target_cfg: dict, roots: Optional[list] = None) -> Optional[Found]:
    """The drafter for a target: a local one that fits (DFlash 2 first), else the
    registry's repo (path None: not on this machine), else None."""
    target_path = Path(target_path)
    repos = known_drafters(target_ref, target_path)
    names = {base_name(target_ref), base_name(str(target_path))}
    names |= {base_name(b) for b in _card_base_models(target_path)}
    hits = []
    for folder, repo, cfg in _candidates(default_roots() if roots is None else roots):
        if folder.resolve() == target_path.resolve() or not _fits(cfg, target_cfg):
            continue
        if repo in repos:
            why = f"registry drafter {repo} (Hugging Face cache)"
        elif _names_target(cfg, folder, names):
            why = f"{folder} names this target"
        else:
            continue
        v2 = "DFlash2DraftModel" in (cfg.get("architectures") or [])
        rank = (repos.index(repo) if repo in repos else len(repos), not v2)
        hits.append((rank, Found(folder, repo, why)))
    if hits:
        return min(hits, key=lambda h: h[0])[1]
    if repos:
        return Found(None, repos[0], f"registry drafter for {base_name(target_ref)}")
    return None


def missing_message(target_ref: str, repo: str) -> str:
    return (f"the DFlash drafter for {target_ref} ({repo}) is not on this machine; "
            f"fetch it with `mlx-dflash models pull {target_ref}` (using plain decoding now)")
