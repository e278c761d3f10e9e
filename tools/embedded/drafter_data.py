"""Prompt and corpus files for training the embedded drafters (deterministic).

    python -m tools.embedded drafter-data OUT [--gsm 400] [--code 200] [--corpus-gsm 300] [--corpus-code 120]

Writes, from the embedded target's own training sources (tools/embedded/target.py)
and never from its held-out parts:

  OUT/prompts_gsm.jsonl   {"messages": [user: question]}  GSM8K train questions
                          (the last 473 problems, the dev split, are excluded)
  OUT/prompts_code.jsonl  {"prompt": "def f(...):\\n    \"\"\"doc\"\"\"\\n"}  a function
                          header + docstring from the stdlib training files (HumanEval-like)
  OUT/corpus.jsonl        {"text": ...}  other GSM8K train problems as ChatML chat, and
                          windows of stdlib training files: the target's training text
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

import numpy as np

from .target_data import DATA, chat_text, gsm8k_split, stdlib_files  # the target's data sources and split
from .target_tools import conversations as tool_conversations


def training_stdlib_files():
    """The stdlib files the target trained on (its 1% validation files removed, same rng)."""
    files = stdlib_files()
    rng = np.random.default_rng(0)
    val = set(rng.choice(len(files), size=max(1, len(files) // 100), replace=False).tolist())
    return [f for i, f in enumerate(files) if i not in val]


def function_prefixes(src: str):
    """`def ...:` header + docstring of every documented function (its source indentation kept)."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return []
    lines = src.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) and node.body:
            doc = node.body[0]
            start = node.lineno - 1 - len(node.decorator_list)
            text = "".join(lines[start: doc.end_lineno])
            if 40 < len(text) < 1200 and len(node.body) > 1:
                out.append(text)
    return out


def write_tool_prompts(path: Path, train_rows, files, n: int, seed: int, max_chars: int = 6000,
                       tok_dir: Path = DATA / "tokenizer"):
    """n raw-text prompts: a tool conversation (GSM8K calculator or stdlib read_file /
    list_files, as the target trained on) rendered up to the start of one of its
    assistant turns, with the chat template of the tokenizer in `tok_dir`."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    hf.chat_template = json.loads((tok_dir / "tokenizer_config.json").read_text())["chat_template"]
    rng = np.random.default_rng(seed + 22)
    convs = tool_conversations(train_rows, files, rng)
    k = 0
    with open(path, "w") as f:
        for msgs, tools in convs:
            turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
            cut = turns[int(rng.integers(0, len(turns)))]
            text = hf.apply_chat_template(msgs[:cut], tools=tools, tokenize=False, add_generation_prompt=True)
            if len(text) <= max_chars:
                f.write(json.dumps({"prompt": text}) + "\n")
                k += 1
                if k == n:
                    break


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--gsm", type=int, default=400, help="GSM8K prompts")
    ap.add_argument("--code", type=int, default=200, help="code prompts")
    ap.add_argument("--corpus-gsm", type=int, default=300, help="GSM8K chats in the corpus")
    ap.add_argument("--corpus-code", type=int, default=120, help="stdlib windows in the corpus")
    ap.add_argument("--window", type=int, default=2000, help="characters per stdlib window")
    ap.add_argument("--tools", type=int, default=0,
                    help="tool-call prompts (prompts_tools.jsonl): tool conversations of the target's "
                         "training data (target_tools.py) cut before an assistant turn; needs "
                         "the target's tool chat template (see --tool-tokenizer)")
    ap.add_argument("--tool-tokenizer", default=str(DATA / "tokenizer"),
                    help="folder with tokenizer.json + tokenizer_config.json (its chat template) for the tool "
                         "prompts: runs/data/tokenizer after prepare-tools, or the exported target's folder")
    ap.add_argument("--tool-max-chars", type=int, default=6000, help="longest tool prompt, in characters")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(a.seed)

    train_rows, dev = gsm8k_split()
    dev_q = {r["question"] for r in dev}
    order = rng.permutation(len(train_rows))
    prompt_rows = [train_rows[i] for i in order[: a.gsm]]
    corpus_rows = [train_rows[i] for i in order[a.gsm: a.gsm + a.corpus_gsm]]
    assert not any(r["question"] in dev_q for r in prompt_rows + corpus_rows)
    with open(out / "prompts_gsm.jsonl", "w") as f:
        for r in prompt_rows:
            f.write(json.dumps({"messages": [{"role": "user", "content": r["question"]}]}) + "\n")

    files = training_stdlib_files()
    prefixes = [p for _, src in files for p in function_prefixes(src)]
    pick = rng.choice(len(prefixes), size=min(a.code, len(prefixes)), replace=False)
    with open(out / "prompts_code.jsonl", "w") as f:
        for i in sorted(pick):
            f.write(json.dumps({"prompt": prefixes[i]}) + "\n")

    with open(out / "corpus.jsonl", "w") as f:
        for r in corpus_rows:
            f.write(json.dumps({"text": chat_text(r["question"], r["answer"])}) + "\n")
        for i in rng.choice(len(files), size=a.corpus_code, replace=True):
            src = files[i][1]
            o = int(rng.integers(0, max(1, len(src) - a.window)))
            f.write(json.dumps({"text": src[o: o + a.window]}) + "\n")
    if a.tools:
        tok_dir = Path(a.tool_tokenizer)
        if not (tok_dir / "tokenizer_config.json").is_file():
            sys.exit(f"--tool-tokenizer {tok_dir} has no tokenizer_config.json; pass the target's folder "
                     "(e.g. models/target)")
        write_tool_prompts(out / "prompts_tools.jsonl", train_rows, files, a.tools, a.seed, a.tool_max_chars, tok_dir)
    print(f"{out}: {len(prompt_rows)} GSM8K prompts, {len(pick)} code prompts (of {len(prefixes)} documented "
          f"functions), corpus {len(corpus_rows)} GSM8K chats + {a.corpus_code} stdlib windows")

