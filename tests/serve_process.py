"""`mlx-dflash serve` as a real server process on loopback for the server tests:
the process, the model folder and settings home it serves from, the error shape."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS_SETTING = 24  # per-model max_tokens default written to the settings file
SYSTEM = "You are terse."  # per-model system prompt from the settings file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m app.cli serve ...` in a subprocess with its own settings home."""

    def __init__(self, home: Path, *args, model="qwen", key=None, key_env=True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = home / f"server-{self.port}.log"
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        env = {**os.environ, "MLX_DFLASH_HOME": str(home), "HF_HUB_OFFLINE": "1"}
        env.pop("MLX_DFLASH_API_KEY", None)
        if key and key_env:  # from the environment: a key on the command line would show in `ps`
            env["MLX_DFLASH_API_KEY"] = key
        cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(self.port), *args]
        if "--max-batch" not in args:  # the single-stream server (prompt cache) unless a test batches
            cmd += ["--max-batch", "1"]
        if model:
            cmd += ["--model", model]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(self.log, "w"))
        deadline = time.monotonic() + 300  # startup cap only (model load on a busy CPU)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200 and \
                        (not model or self.metrics()["loaded"] is not None):  # loaded at start with --model
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not come up: {self.log.read_text()}")

    def metrics(self) -> dict:
        return httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).json()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def client(self, key="none"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)


def make_serve_models(pairs, tmp_path_factory):
    """A model folder with two targets (qwen: DFlash drafter; llama: another
    size, so the drafters do not mix) and a settings home pointing at it."""
    a, b = pairs(), pairs(family="llama", hidden=32)
    root = tmp_path_factory.mktemp("models")
    for name, src in (("qwen", a / "target"), ("qwen-drafter", a / "drafter"),
                      ("llama", b / "target"), ("llama-drafter", b / "drafter")):
        (root / name).symlink_to(src)
    home = tmp_path_factory.mktemp("home")
    (home / "settings.json").write_text(json.dumps({
        "version": 1, "global": {"model_dirs": [str(root)], "default_model": "qwen"},
        "models": {"qwen": {"max_tokens": MAX_TOKENS_SETTING, "system_prompt": SYSTEM}}}))
    return root, home


def api_error(r, status):
    """The OpenAI-style error body of a response with `status`."""
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert isinstance(e["message"], str) and e["message"] and "type" in e and "code" in e and "param" in e
    return e
