"""Can an agent talk to the embedded target? Against a real `mlx-dflash serve` (no flags:
the embedded pair), on a fixed prompt set never trained on:

  * tool-call rate: greedy answers to requests with tools, in the OpenAI chat format
    (`tool_calls` in the response) and the Anthropic Messages format (`tool_use` blocks):
    GSM8K dev questions with a calculator tool (the dev split: the last 473 problems),
    the held-out stdlib files with read_file / list_files tools, and a few generic agent tasks
    with tools the model never saw;
  * long prompts: an 8k- and a 32k-token prompt (held-out stdlib text as a read_file result),
    prefill + 4 tokens: wall time, prompt tokens, the server's peak resident memory.

    PYTHONPATH=. python -m tools.embedded check-agent --out bench/agent_model [--n-gsm 20]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
from .target_data import gsm8k_split, stdlib_files
from .target_tools import tool_schema

AGENT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    tool_schema("bash"), tool_schema("read_file"),
]
AGENT_TASKS = ["What is the weather in Paris?", "Show me the contents of setup.py.",
               "Run the command `ls -la` and tell me what you see.", "Read README.md and summarize it.",
               "What is the weather like in Tokyo today?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def held_out_files():
    import numpy as np

    files = stdlib_files()
    rng = np.random.default_rng(0)  # the same split as `target prepare`
    val = set(rng.choice(len(files), size=max(1, len(files) // 100), replace=False).tolist())
    return [f for i, f in enumerate(files) if i in val]


def prompt_set(n_gsm: int):
    """(name, messages, OpenAI tools)"""
    _, dev = gsm8k_split()
    out = [(f"gsm_dev_{i}", [{"role": "user", "content": r["question"]}],
            [tool_schema("calculator")]) for i, r in enumerate(dev[:n_gsm])]
    for path, _ in held_out_files():
        out.append((f"read_{path}", [{"role": "user", "content": f"What is Lib/{path} for?"}],
                    [tool_schema("read_file"), tool_schema("list_files")]))
        d = path.rpartition("/")[0] or "."
        out.append((f"list_{d}", [{"role": "user", "content": f"Which files are in Lib/{d}?"}],
                    [tool_schema("read_file"), tool_schema("list_files")]))
    out += [(f"agent_{i}", [{"role": "system", "content": "You are a helpful assistant with tools."},
                            {"role": "user", "content": t}], AGENT_TOOLS) for i, t in enumerate(AGENT_TASKS)]
    return out


def anthropic_tools(tools):
    return [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
             "input_schema": t["function"]["parameters"]} for t in tools]


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/agent_model")
    ap.add_argument("--n-gsm", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--long", type=int, nargs="*", default=[8192, 32768])
    a = ap.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    home = tempfile.mkdtemp(prefix="agentcheck-")
    env = {**os.environ, "MLX_DFLASH_HOME": home, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("MLX_DFLASH_API_KEY", None)
    log = Path(home) / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    res = {"openai": [], "anthropic": [], "long": []}
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > 300:
                raise SystemExit("server did not come up")
            time.sleep(0.5)
        c = httpx.Client(base_url=url, timeout=900)
        for name, msgs, tools in prompt_set(a.n_gsm):
            r = c.post("/v1/chat/completions", json={"model": "any", "messages": msgs, "tools": tools,
                                                     "temperature": 0, "max_tokens": a.max_tokens})
            body = r.json()
            ch = body["choices"][0] if r.status_code == 200 else {}
            calls = [(t["function"]["name"], t["function"]["arguments"])
                     for t in (ch.get("message", {}).get("tool_calls") or [])]
            res["openai"].append({"name": name, "status": r.status_code, "calls": calls,
                                  "known_tool": all(n in [t["function"]["name"] for t in tools] for n, _ in calls),
                                  "finish": ch.get("finish_reason"), "content": ch.get("message", {}).get("content"),
                                  "tau": (body.get("dflash") or {}).get("tau") if r.status_code == 200 else None})
            system = [m["content"] for m in msgs if m["role"] == "system"]
            am = {"model": "claude-sonnet-4-5", "max_tokens": a.max_tokens, "temperature": 0,
                  "messages": [m for m in msgs if m["role"] != "system"], "tools": anthropic_tools(tools)}
            if system:
                am["system"] = system[0]
            r = c.post("/v1/messages", json=am, headers={"anthropic-version": "2023-06-01"})
            blocks = r.json().get("content", []) if r.status_code == 200 else []
            res["anthropic"].append({"name": name, "status": r.status_code,
                                     "calls": [(b["name"], b["input"]) for b in blocks if b.get("type") == "tool_use"],
                                     "stop_reason": r.json().get("stop_reason") if r.status_code == 200 else r.text})
            print(name, res["openai"][-1]["calls"], res["anthropic"][-1]["calls"], flush=True)
        text = "".join(t for _, t in held_out_files()) * 40
        for n in a.long:
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "models/target/tokenizer.json"))
            body = tok.decode(tok.encode(text)[: n - 400])
            msgs = [{"role": "user", "content": "Read Lib/big.py."},
                    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "read_file", "arguments": "{\"path\": \"Lib/big.py\"}"}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": body}]
            t1 = time.time()
            r = c.post("/v1/chat/completions", json={"model": "any", "messages": msgs, "tools": [tool_schema("read_file")],
                                                     "temperature": 0, "max_tokens": 4})
            dt = time.time() - t1
            j = r.json()
            res["long"].append({"target_tokens": n, "status": r.status_code, "wall_s": round(dt, 1),
                                "prompt_tokens": j.get("usage", {}).get("prompt_tokens"),
                                "completion_tokens": j.get("usage", {}).get("completion_tokens"),
                                "text": (j.get("choices") or [{}])[0].get("message", {}).get("content")
                                if r.status_code == 200 else r.text[:300],
                                "server_peak_rss_mb": round(peak_rss_mb(proc.pid))})
            print(res["long"][-1], flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    summ = {}
    for api in ("openai", "anthropic"):
        rows = res[api]
        groups = {"gsm_dev": [r for r in rows if r["name"].startswith("gsm")],
                  "stdlib": [r for r in rows if r["name"].startswith(("read", "list"))],
                  "agent": [r for r in rows if r["name"].startswith("agent")], "all": rows}
        summ[api] = {k: {"n": len(g), "ok_http": sum(r["status"] == 200 for r in g),
                         "with_tool_call": sum(bool(r["calls"]) for r in g)} for k, g in groups.items()}
    res["summary"] = summ
    res["errors_in_server_log"] = [l for l in log.read_text().splitlines() if " 4" in l and "HTTP" in l][:20]
    out = ROOT / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(str(out) + ".json").write_text(json.dumps(res, indent=1))
    print(json.dumps(summ, indent=1))

