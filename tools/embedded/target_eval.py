"""`evaluate` (greedy generations and their loop rates) and `card` (the model's
README.md and loss curve) of tools/embedded/target.py."""

from __future__ import annotations

import json
import time

import numpy as np

from .target_data import DATA, N_DEV, ROOT, write_gsm8k_dev
from .target_loops import repeated_ngram_loop, stuck_in_loop
from .target_model import PRESETS, VAL_SEQ, build_model, count_params


def cmd_evaluate(args):
    from mlx_lm import load
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    P = PRESETS[args.preset]
    out = ROOT / P["out"]
    model, tok = load(str(out))
    # check the tokenizer contract
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True)  # the template renders
    txt = "def f(x):\n    if x:\n\treturn  x + 1\n\n# done\n"
    assert tok.decode(tok.encode(txt, add_special_tokens=False)) == txt
    greedy = make_sampler(temp=0.0)
    dev = [json.loads(l) for l in write_gsm8k_dev().read_text().splitlines()]
    results = {"gsm8k": [], "python": []}
    py_prompts = ["def fibonacci(n):", "import os\n\n\ndef list_files(path):",
                  "class Stack:\n    def __init__(self):", "def is_prime(n):",
                  "def read_json(path):\n    \"\"\"Read a JSON file.\"\"\"",
                  "import re\n\n\ndef tokenize(text):", "def binary_search(items, target):",
                  "class Point:\n    \"\"\"A 2D point.\"\"\"\n\n    def __init__(self, x, y):",
                  "def _quote(s):", "    def __repr__(self):"]
    chat_example = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)

    def greedy_ids(prompt):  # -> (generated ids, ended by eos)
        ids, finish = [], None
        for r in stream_generate(model, tok, prompt, max_tokens=args.max_tokens, sampler=greedy):
            finish = r.finish_reason
            if finish != "stop":  # the eos token is not part of the output
                ids.append(r.token)
        return ids, finish == "stop"

    def dump():  # written after every prompt, so a slow/killed run still leaves partial results
        summ = {}
        for k, rs in results.items():
            if rs:
                summ[k] = {"n": len(rs), "loop_rate": float(np.mean([r["loop"] for r in rs])),
                           "stuck_rate": float(np.mean([r["stuck"] for r in rs])),
                           "mean_tokens": float(np.mean([r["n_tokens"] for r in rs]))}
        if results["gsm8k"]:
            summ["gsm8k"]["has_final_rate"] = float(np.mean([r["has_final"] for r in results["gsm8k"]]))
            summ["gsm8k"]["accuracy"] = float(np.mean([r["correct"] for r in results["gsm8k"]]))
        res = {"summary": summ, "max_tokens": args.max_tokens, "chat_prompt_example": chat_example,
               "complete": len(results["gsm8k"]) == args.n_gsm and len(results["python"]) == len(py_prompts),
               "results": results}
        (ROOT / P["run"] / "eval.json").write_text(json.dumps(res, indent=2))
        return summ

    # interleave the two sets so that partial results cover both
    order, py_left = [], list(py_prompts)
    for i, r in enumerate(dev[:args.n_gsm]):
        order.append(("gsm", r))
        if i % 3 == 2 and py_left:
            order.append(("py", py_left.pop(0)))
    order += [("py", p) for p in py_left]
    for kind, item in order:
        t0 = time.time()
        if kind == "gsm":
            r = item
            p = tok.apply_chat_template(r["messages"], add_generation_prompt=True)
            ids, ended = greedy_ids(p)
            text = tok.decode(ids)
            gold = r["answer"].split("####")[-1].strip()
            pred = text.split("####")[-1].strip().split("\n")[0].strip() if "####" in text else None
            results["gsm8k"].append({"question": r["messages"][0]["content"], "output": text,
                                     "n_tokens": len(ids), "has_final": "####" in text,
                                     "correct": pred == gold, "gold": gold,
                                     "loop": repeated_ngram_loop(ids), "ended": ended,
                                     "stuck": stuck_in_loop(ids, ended), "s": time.time() - t0})
        else:
            ids, ended = greedy_ids(tok.encode(item, add_special_tokens=False))
            text = tok.decode(ids)
            results["python"].append({"prompt": item, "output": text, "n_tokens": len(ids),
                                      "loop": repeated_ngram_loop(ids), "ended": ended,
                                      "stuck": stuck_in_loop(ids, ended), "s": time.time() - t0})
        summ = dump()
    print(json.dumps(summ, indent=2))
    for r in results["gsm8k"][:3] + results["python"][:3]:
        print("-----", r.get("question", r.get("prompt")))
        print(r["output"])


def cmd_card(args):
    P = PRESETS[args.preset]
    run, out = ROOT / P["run"], ROOT / P["out"]
    cfg = json.loads((out / "config.json").read_text())
    log = [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines() if l.strip()]
    ev_path = run / "eval.json"
    ev = json.loads(ev_path.read_text()) if ev_path.exists() else {
        "summary": {}, "max_tokens": 0, "results": {"gsm8k": [], "python": []}, "complete": False}
    stats = json.loads((DATA / "stats.json").read_text())
    model = build_model(cfg)
    total, non_emb = count_params(model)
    last = log[-1]
    lastval = [r for r in log if "val_gsm_dev" in r][-1]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in log], [r["loss"] for r in log], label="train", lw=1)
        ev_r = [r for r in log if "val_gsm_dev" in r]
        ax.plot([r["step"] for r in ev_r], [r["val_gsm_dev"] for r in ev_r], "o-", label="val gsm8k dev (chat)")
        ax.plot([r["step"] for r in ev_r], [r["val_code_val"] for r in ev_r], "s-", label="val stdlib (held-out files)")
        ax.set_xlabel("step"); ax.set_ylabel("cross-entropy (nats/token)"); ax.set_ylim(0, 6)
        ax.grid(alpha=.3); ax.legend(); ax.set_title(P["title"])
        fig.tight_layout(); fig.savefig(out / "loss.png", dpi=80)
        curve = "![loss curve](loss.png)\n"
    except ImportError:
        curve = "(matplotlib not installed: no plot)\n"
    s = ev["summary"]
    from tokenizers import Tokenizer

    _tk = Tokenizer.from_file(str(out / "tokenizer.json"))
    _dev = [json.loads(l) for l in write_gsm8k_dev().read_text().splitlines()]
    gold_loop = float(np.mean([repeated_ngram_loop(_tk.encode(d["answer"]).ids) for d in _dev]))
    rows = []
    stuck = lambda g: f"{g['stuck_rate']:.0%}" if "stuck_rate" in g else "n/a"  # noqa: E731  (older evals)
    if "gsm8k" in s:
        g = s["gsm8k"]
        rows.append(f"| GSM8K dev (chat) | {g['n']} | {stuck(g)} | {g['loop_rate']:.0%} | {g['mean_tokens']:.0f} | "
                    f"ends with `#### N`: {g['has_final_rate']:.0%}, exact answer: {g['accuracy']:.0%} |")
    if "python" in s:
        g = s["python"]
        rows.append(f"| Python (raw) | {g['n']} | {stuck(g)} | {g['loop_rate']:.0%} | {g['mean_tokens']:.0f} | |")
    partial = "" if ev.get("complete", True) else (
        "\n**Partial:** the evaluation was still running (CPU starved by other jobs) when this card "
        "was written; rerun `evaluate` then `card` to complete it.\n")
    tps = np.median([r["tokens_per_s"] for r in log])
    model_keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
                  "rope_theta", "tie_word_embeddings")
    arch = "\n".join(f"| {k} | {cfg[k]} |" for k in model_keys)
    steps = last["step"]
    samples = []
    for r in ev["results"]["gsm8k"][:3]:
        samples.append(f"**GSM8K dev** (chat template, greedy) -- question: {r['question']}\n\n"
                       f"```text\n{r['output']}\n```\n(gold: {r['gold']}, stuck: {r.get('stuck')}, 8-gram repeat: {r['loop']})\n")
    for r in ev["results"]["python"][:3]:
        samples.append(f"**Python** (raw prompt, greedy)\n\n```python\n{r['prompt']}{r['output']}\n```\n"
                       f"(stuck: {r.get('stuck')}, 8-gram repeat: {r['loop']})\n")
    pre = "--preset " + args.preset
    loop_txt = " and".join(f" on {round(s[k]['stuck_rate'] * s[k]['n'])} of {s[k]['n']} {name} prompts"
                           for k, name in (("gsm8k", "GSM8K dev"), ("python", "Python")) if "stuck_rate" in s.get(k, {}))
    # training phases (warm restarts): end step, sequence length, GSM8K share, peak lr, batch
    phases = [dict(zip(("end", "seq", "p_gsm", "lr", "batch"), map(float, ph.split(","))))
              for ph in (args.phase or [f"{steps},{args.seq},{args.p_gsm},{args.lr or P['lr']},{args.batch or P['batch']}"])]
    ph_rows, gsm_tok, code_tok, prev_step, prev_tok = [], 0.0, 0.0, 0, 0
    for i, ph in enumerate(phases):
        end = int(ph["end"]) if ph["end"] > 0 else steps
        tok_end = next((r["tokens"] for r in log if r["step"] >= end), last["tokens"])
        n = tok_end - prev_tok
        gsm_tok += n * ph["p_gsm"]
        code_tok += n * (1 - ph["p_gsm"])
        ph_rows.append(f"| {i + 1} | {prev_step}-{end} | {n:,} | {int(ph['batch'])}×{int(ph['seq'])} | "
                       f"{ph['p_gsm']:.0%} | {ph['lr']:g} |")
        prev_step, prev_tok = end, tok_end
    phase_table = ("| phase | steps | tokens | batch × seq | GSM8K share | peak lr |\n|---|---|---|---|---|---|\n"
                   + "\n".join(ph_rows))
    lines = f"""# {P['title']}

A tiny Qwen3-architecture (`model_type: qwen3`, mlx-lm format) causal language
model trained from scratch on CPU for mlx-dflash, so the project ships a
self-contained model {'pair' if args.preset == 'target' else 'family'} with no download. It is a heavily
under-trained toy ({last['tokens']/1e6:.1f}M tokens on 2 shared CPU cores): it has learned the *format* of
GSM8K answers (`<<calc>>` lines ending in `#### N`, then `<|im_end|>`) and the layout of Python
source, but its content is mostly wrong, and greedy decoding fell into an endless loop{loop_txt} (see Quality check). Weights: `model.safetensors` (bfloat16, tied
embeddings), tokenizer shared by `models/target` and `models/draft-ar`.

## Architecture

| field | value |
|---|---|
{arch}

Parameters: **{total:,}** total ({non_emb:,} non-embedding; the LM head is tied to the embedding).

## Tokenizer

Byte-level BPE (HF `tokenizers`), vocab {cfg['vocab_size']}, trained on the training text below
(never on the GSM8K dev split). Special tokens: `<|endoftext|>` (id {cfg['pad_token_id']}, pad / document
separator), `<|im_start|>`, `<|im_end|>` (eos), `<|mask|>` (id {cfg['mask_token_id']}, the DFlash mask token).
ChatML chat template (`<|im_start|>role\\ncontent<|im_end|>\\n`; `add_generation_prompt`
appends `<|im_start|>assistant\\n`). `eos_token_id` in config.json = {cfg['eos_token_id']}
(`<|im_end|>`, `<|endoftext|>`). Decoding round-trips spaces, tabs, newlines.

## Data (real text only)

* Python {stats['python']} standard library `.py` sources (`sysconfig.get_paths()['stdlib']`; skipping
  `test`/`tests`, `idlelib`, `lib2to3`, `site-packages`; deduplicated by content):
  {stats['n_stdlib_files']} files, {stats['code_train']:,} training tokens
  ({stats['n_code_val_files']} files / {stats['code_val']:,} tokens held out for validation).
* GSM8K train (`/work/shared/data/gsm8k/train.jsonl`) as ChatML chat: user = question,
  assistant = worked answer including the `<<calc>>` annotations and the final `#### N` line:
  {stats['n_gsm_train']} problems, {stats['gsm_train']:,} tokens. The **last {N_DEV} problems of train.jsonl are the
  dev split** (regenerated deterministically by `write_gsm8k_dev()` into `runs/data/gsm8k_dev.jsonl`):
  never trained on, not used for the tokenizer.
* Documents are packed with `<|endoftext|>` separators into one token stream per source;
  each training sequence (seq+1 tokens) is a random window from the GSM8K stream with
  the phase's GSM8K share as probability and from the stdlib stream otherwise (phases
  under Training): ≈{gsm_tok/stats['gsm_train']:.1f} epochs of GSM8K chat and ≈{code_tok/stats['code_train']:.1f} of the stdlib in all.

## Training

float32, AdamW (β=(0.9, 0.95), weight decay 0.1), linear warmup then cosine decay to 5% of
the phase's peak lr, grad-norm clip 1.0, `mx.compile`d step, mlx {__import__('mlx.core').core.__version__} on CPU
with OpenBLAS (2 shared x86-64 cores). A later phase is a warm restart from the previous
phase's last checkpoint (weights and AdamW state kept; `train --resume --new-phase`).

{phase_table}

* steps: **{steps}**, tokens seen: **{last['tokens']:,}**, wall time {last['elapsed']/60:.0f} min,
  median throughput {tps:.0f} tokens/s
* final train loss (mean over the last {args.log_every} steps): **{last['loss']:.3f}**;
  validation loss at step {lastval['step']}: GSM8K dev chat **{lastval['val_gsm_dev']:.3f}**,
  held-out stdlib **{lastval['val_code_val']:.3f}** (nats/token)
* full metrics: `train_log.jsonl` (step, loss, lr, grad_norm, tokens, tokens_per_s, elapsed, val_*;
  `loss` is the mean over the {args.log_every} steps since the previous record; val_* = mean loss on
  3 batches of {VAL_SEQ}-token windows of the GSM8K dev chats / held-out stdlib files)
{args.note + chr(10) if args.note else ''}
{curve}
## Quality check

Greedy decoding with `mlx_lm.stream_generate` (max {ev['max_tokens']} new tokens) on the first
{args.n_gsm} GSM8K dev questions (chat template) and 10 raw Python prompts (`evaluate`, results in
`{P['run']}/eval.json`).
{partial}
**Stuck rate** := share of outputs that never end (max new tokens reached, no `<|im_end|>`)
and whose last 48 tokens are one cycle of at most 24 tokens repeated exactly: decoding
fell into a loop. **8-gram repeat rate** := share of outputs whose last 64 generated tokens
(or all of them if fewer) contain some token 8-gram at least twice; stricter, it also counts
the repeated phrases of a finished answer (the gold GSM8K dev answers score {gold_loop:.1%}).
Raw Python prompts have no natural end, so every Python output runs to the limit.

| set | n | stuck rate | 8-gram repeat rate | mean new tokens | other |
|---|---|---|---|---|---|
{chr(10).join(rows)}

### Sample outputs

""" + "\n".join(samples) + f"""

## Reproduce

From the repository root (Linux, CPU; `mlx[cpu]`, `mlx-lm`, `tokenizers`, `scipy-openblas32`,
`matplotlib`; `PYTHONPATH=.` so the script loads the OpenBLAS shim before mlx):

```bash
export PYTHONPATH=.
python -m tools.embedded target prepare
{args.repro_cmd or f'python -m tools.embedded target train {pre} --steps {steps}'}
python -m tools.embedded target export {pre}
python -m tools.embedded target evaluate {pre}
python -m tools.embedded target card {pre}{' --repro-cmd "..."' if args.repro_cmd else ''}
```

A killed run continues with the same `train` command plus `--resume` (weights, AdamW
state, step and the data-sampler RNG are checkpointed every few minutes to `{P['run']}/ckpt`).
"""
    (out / "README.md").write_text(lines)
    print(f"wrote {out/'README.md'}")
