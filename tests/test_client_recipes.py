"""The README's recipes for opencode, aider, `llm` and LiteLLM, run with the real
clients from npm and PyPI against the server on the embedded model with default
settings (issue 37), as tests/test_agents_cli.py runs Claude Code and Codex.
Each client is installed on first use into a cache folder ($TMPDIR/mlx-dflash-agent-clis
for npm, $TMPDIR/mlx-dflash-py-clients/<package> for PyPI: a venv of its own, so its
pinned dependencies never meet the project's); where that fails, the test is skipped
with the reason."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

NPM_PREFIX = Path(tempfile.gettempdir()) / "mlx-dflash-agent-clis"
PY_PREFIX = Path(tempfile.gettempdir()) / "mlx-dflash-py-clients"
OPENCODE = ("opencode-ai", "1.18.33")
PYPI = {"llm": "0.36", "litellm": "1.110.2", "aider-chat": "0.86.2"}
KEY = "sk-local-recipes"
MODEL = "embedded/target"
SMALL_PROMPT = "You are a coding agent. To read a file, call the read tool with its filePath."


def opencode_config(url: str, key: str, model: str = MODEL, small_agent: bool = True) -> dict:
    """The README's opencode.json: the server as an OpenAI-compatible provider and,
    for a small model, an agent with one tool and a short prompt (opencode's own
    agent sends an 11k-token prompt and two dozen tools, past what a small model follows)."""
    cfg = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"mlx-dflash": {
            "npm": "@ai-sdk/openai-compatible", "name": "mlx-dflash",
            "options": {"baseURL": f"{url}/v1", "apiKey": key},
            "models": {model: {"name": model, "tool_call": True, "limit": {"context": 32768, "output": 512}}}}},
        "model": f"mlx-dflash/{model}",
        "small_model": f"mlx-dflash/{model}",
    }
    if small_agent:
        cfg["agent"] = {"small": {"mode": "primary", "description": "One tool and a short prompt, for small models",
                                  "prompt": SMALL_PROMPT, "tools": {"*": False, "read": True}}}
    return cfg


def npm_client(pkg: str, version: str, binary: str) -> Path:
    """`binary` of npm package `pkg`@`version`, installed into NPM_PREFIX on first use."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed: {pkg} comes from npm")
    exe = NPM_PREFIX / "node_modules" / ".bin" / binary

    def ok():
        try:
            out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.TimeoutExpired):
            return False
        return version in out

    if not ok():
        r = subprocess.run([npm, "install", "--prefix", str(NPM_PREFIX), "--no-audit", "--no-fund",
                            f"{pkg}@{version}"], capture_output=True, text=True, timeout=400)
        if r.returncode != 0 or not ok():
            pytest.skip(f"npm could not install {pkg}@{version}: {(r.stderr or r.stdout).strip()[-300:]}")
    return exe


def py_client(pkg: str, *extra: str) -> Path:
    """The venv of PyPI package `pkg` (at PYPI's version, with `extra` packages), made on first use."""
    venv = PY_PREFIX / pkg
    py = venv / "bin" / "python"
    want = f"{pkg}=={PYPI[pkg]}"

    def ok():
        r = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version({pkg!r}))"],
                           capture_output=True, text=True)
        return r.returncode == 0 and r.stdout.strip() == PYPI[pkg]

    if not (py.exists() and ok()):
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", want, *extra], capture_output=True, text=True,
                           timeout=900)
        if r.returncode != 0 or not ok():
            pytest.skip(f"pip could not install {want}: {(r.stderr or r.stdout).strip()[-300:]}")
    return venv / "bin"
