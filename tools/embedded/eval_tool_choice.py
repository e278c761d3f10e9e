"""Does a model call the tools a request offers? Greedy answers (mlx-lm's own generate, the
model's chat template) to requests never trained on, with tool names and argument keys that
the training pool (target_choice.py) never used, and one tool list shaped like Claude
Code's `Read` (a long description, an absolute-path key, optional offset / limit):

  * held-out stdlib files (read), held-out packages (list), GSM8K dev questions (calculator),
    each offered with 1-4 tools in a random order;
  * "What is hello.txt for?" with only the Claude-Code-shaped Read tool.

Per answer: a call at all, a call to an offered name, the expected tool, argument keys that
the tool's schema has (required ones present).

    PYTHONPATH=. python -m tools.embedded tool-choice --model models/target [--n 12] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
import mlx_dflash  # noqa: F401  (fast BLAS before mlx)
import numpy as np
from mlx_lm import generate, load

from .check_agent import held_out_files
from .target_data import gsm8k_split

# names and keys outside the training pool
HELD_OUT = {
    "read": (["ReadTextFile", "fs_read", "show_file", "file_viewer"], ["relative_path", "uri", "file_name"],
             "Return the text of a file."),
    "list": (["ListDir", "fs_list", "browse_folder"], ["folder_path", "location"], "List a directory."),
    "calc": (["calculate", "do_math", "Arithmetic"], ["math_expression", "question"], "Evaluate arithmetic."),
    "bash": (["run_terminal_cmd", "sh", "ExecShell"], ["command_line", "argv"], "Run a shell command."),
}
CLAUDE_READ = {"type": "function", "function": {
    "name": "Read",
    "description": "Reads a file from the local filesystem. You can access any file directly by using this tool.\n"
                   "Usage:\n- The file_path parameter must be an absolute path, not a relative path\n"
                   "- By default, it reads up to 2000 lines starting from the beginning of the file",
    "parameters": {"type": "object", "properties": {
        "file_path": {"type": "string", "description": "The absolute path to the file to read"},
        "offset": {"type": "number", "description": "The line number to start reading from"},
        "limit": {"type": "number", "description": "The number of lines to read"}},
        "required": ["file_path"], "additionalProperties": False}}}
CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def schema(cap: str, rng) -> dict:
    names, keys, desc = HELD_OUT[cap]
    key = keys[int(rng.integers(len(keys)))]
    return {"type": "function", "function": {
        "name": names[int(rng.integers(len(names)))], "description": desc,
        "parameters": {"type": "object", "properties": {key: {"type": "string"}}, "required": [key]}}}


def cases(n: int, rng):
    _, dev = gsm8k_split()
    files = held_out_files()
    dirs = sorted({p.rpartition("/")[0] for p, _ in files if "/" in p})
    out = []
    for i in range(n):
        kind = ["read", "calc", "list"][i % 3]
        if kind == "read":
            ask = f"What is Lib/{files[i % len(files)][0]} for?"
        elif kind == "calc":
            ask = dev[i]["question"]
        else:
            ask = f"Which files are in Lib/{dirs[i % len(dirs)] if dirs else 'json'}?"
        others = [c for c in HELD_OUT if c != kind]
        offered = [kind] + list(rng.choice(others, size=int(rng.integers(0, 4)), replace=False))
        rng.shuffle(offered)
        tools = [schema(c, rng) for c in offered]
        want = tools[offered.index(kind)]["function"]["name"]
        out.append({"kind": kind, "messages": [{"role": "user", "content": ask}], "tools": tools, "want": want})
    out.append({"kind": "claude-read", "want": "Read", "tools": [CLAUDE_READ], "messages": [
        {"role": "system", "content": "You are a coding agent. To read a file, call the Read tool with its file_path."},
        {"role": "user", "content": "What is hello.txt for?"}]})
    return out


def score(text: str, case: dict) -> dict:
    m = CALL.search(text)
    if not m:
        return {"call": False}
    try:
        c = json.loads(m.group(1))
        name, args = c["name"], c.get("arguments") or {}
    except (ValueError, KeyError, TypeError):
        return {"call": True, "parsed": False}
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in case["tools"]}
    p = by_name.get(name)
    keys_ok = bool(p) and isinstance(args, dict) and set(args) <= set(p["properties"]) \
        and set(p["required"]) <= set(args)
    return {"call": True, "parsed": True, "name": name, "offered": p is not None, "right": name == case["want"],
            "keys_ok": keys_ok, "arguments": args}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "target"))
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model, tok = load(args.model)
    rows = []
    for case in cases(args.n, np.random.default_rng(7)):
        prompt = tok.apply_chat_template(case["messages"], tools=case["tools"], add_generation_prompt=True)
        text = generate(model, tok, prompt, max_tokens=args.max_tokens, verbose=False)
        rows.append(dict(kind=case["kind"], want=case["want"], tools=[t["function"]["name"] for t in case["tools"]],
                         text=text, **score(text, case)))
    n = len(rows)
    summary = {k: sum(bool(r.get(k)) for r in rows) for k in ("call", "offered", "right", "keys_ok")}
    claude = rows[-1]
    print(f"{args.model}: {n} requests; a call {summary['call']}, to an offered tool {summary['offered']}, "
          f"the expected tool {summary['right']}, argument keys valid {summary['keys_ok']}; "
          f"Claude-Code-shaped Read: {claude.get('name')} {json.dumps(claude.get('arguments'))}")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "summary": summary, "n": n, "rows": rows}, indent=1))

