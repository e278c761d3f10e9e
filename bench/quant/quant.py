"""Drafter quantization: tau and drafter memory with and without, on the
embedded pair (or a random make_test_pair pair with --test-pair, where tau says
nothing about quality and only the memory and losslessness columns mean much).

    PYTHONPATH=. python bench/quant/quant.py [--prompts 24] [--max-tokens 128] [--block-size 5]
        [--configs none,8:64,4:32,4:64,4:128] [--out bench/quant]

Each configuration loads the drafter afresh, quantizes it as `load_model` does
(mlx_dflash.models.manager.quantize_drafter: Linear layers whose input dim divides the
group size, bfloat16 scales; activations in the target's dtype) and decodes the
same greedy prompts. Writes OUT.json and OUT.md with this exact command."""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
import mlx_dflash  # noqa: E402,F401  (fast BLAS before mlx)
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_dflash import load, stream_generate  # noqa: E402
from mlx_dflash.drafting.drafter import load_drafter, validate  # noqa: E402
from mlx_dflash.models.discovery import default_pair  # noqa: E402
from mlx_dflash.models.dtype_choice import cast as _cast, param_dtype as _param_dtype  # noqa: E402
from mlx_dflash.models.drafter_precision import quantize_drafter  # noqa: E402
from mlx_dflash.models.drafter_precision import param_bytes
from mlx_dflash.target.adapter import Target  # noqa: E402

CONFIGS = "none,8:64,4:32,4:64,4:128"  # bits:group size; "none" (the reference) always runs first


def parse_configs(text: str) -> list:
    out = [(None, None)]
    for c in text.split(","):
        if c.strip() and c.strip() != "none":
            bits, group = c.split(":")
            out.append((int(bits), int(group)))
    return out


def prompts(tok, n: int) -> list:
    """GSM8K dev questions (never trained on), chat-templated; code prefixes if absent."""
    dev = ROOT / "runs" / "data" / "gsm8k_dev.jsonl"
    out = []
    if dev.exists():
        for line in dev.read_text().splitlines()[:n]:
            msgs = json.loads(line)["messages"][:1]
            out.append(tok.apply_chat_template(msgs, add_generation_prompt=True))
    code = ["import os\n\n\ndef ", "class Queue:\n    def __init__(self", "def parse_args(argv):\n    "]
    while len(out) < n:
        out.append(code[len(out) % len(code)])
    return out


def run_config(model, tok, drafter_path, bits, group, ps, max_tokens, block_size):
    d = load_drafter(drafter_path)
    validate(d, Target(model))
    _cast(d, _param_dtype(model))
    fp16_bytes = sum(v.size * 2 for _, v in tree_flatten(d.parameters()))
    fp_bytes = param_bytes(d)
    nq = quantize_drafter(d, bits, group, scale_dtype=mx.bfloat16) if bits else 0
    cycles = cycle_tokens = drafted = accepted = gen = 0
    outputs, t = [], 0.0
    for p in ps:
        ids = []
        tic = time.perf_counter()
        for r in stream_generate(model, tok, p, d, max_tokens=max_tokens, block_size=block_size):
            ids.append(r.token)
        t += time.perf_counter() - tic
        s = r.stats
        cycles += s.cycles
        cycle_tokens += s.cycle_tokens
        drafted += s.drafted
        accepted += s.accepted
        gen += s.generation_tokens
        outputs.append(ids)
    return dict(bits=bits, group_size=group, quantized_layers=nq, drafter_bytes=param_bytes(d),
                drafter_fp_bytes=fp_bytes, fp16_bytes=fp16_bytes, mem_vs_fp16=param_bytes(d) / fp16_bytes,
                tau=cycle_tokens / cycles if cycles else 0.0, acceptance=accepted / drafted if drafted else 0.0,
                cycles=cycles, generated=gen, tokens_per_s=gen / t if t else 0.0), outputs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target folder (default: the embedded pair)")
    ap.add_argument("--drafter", default=None, help="drafter folder (default: the embedded pair)")
    ap.add_argument("--test-pair", action="store_true", help="use a random make_test_pair pair instead")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=5)
    ap.add_argument("--configs", default=CONFIGS, help=f"quantizations to compare (default {CONFIGS})")
    ap.add_argument("--out", default=str(ROOT / "bench" / "quant"))
    a = ap.parse_args(argv)
    cmd = "PYTHONPATH=. python bench/quant/quant.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    if a.test_pair:
        from tests.make_test_pair import make_drafter, make_target

        tmp = Path(tempfile.mkdtemp(prefix="bench-quant-"))
        t = make_target(tmp / "target", "qwen3", 256, 4, 1024, 0)
        make_drafter(tmp / "drafter", t["config"], t["special_ids"]["<|mask|>"], version=2, layers=2, block_size=8)
        target, drafter, pair = tmp / "target", tmp / "drafter", "random make_test_pair pair (hidden 256, 4 layers, DFlash 2)"
    else:
        dt, dd = default_pair()
        target, drafter = Path(a.model or dt), Path(a.drafter or dd)
        pair = f"{target.relative_to(ROOT) if target.is_relative_to(ROOT) else target} + " \
               f"{drafter.relative_to(ROOT) if drafter.is_relative_to(ROOT) else drafter}"
        for p in (target, drafter):
            if not (p / "config.json").exists():
                raise SystemExit(f"bench_quant: {p} has no model yet; train/export it or pass --test-pair")
    model, tok, _ = load(str(target))
    ps = prompts(tok, a.prompts)
    meta = dict(command=cmd, pair=pair, target=str(target), drafter=str(drafter), prompts=len(ps),
                max_tokens=a.max_tokens, block_size=a.block_size,
                backend="cpu" if mx.default_device() == mx.cpu else "gpu",
                target_dtype=str(_param_dtype(model)).rsplit(".", 1)[-1], machine=platform.machine(),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                goal="tau loss <= 2%, drafter memory <= 30% of fp16")
    rows, ref = [], None
    for bits, group in parse_configs(a.configs):
        row, outs = run_config(model, tok, str(drafter), bits, group, ps, a.max_tokens, a.block_size)
        if ref is None:
            ref = outs
        row["identical_output"] = outs == ref  # lossless: the drafter only changes speed
        base = rows[0]["tau"] if rows else row["tau"]
        row["tau_loss"] = (base - row["tau"]) / base if base else 0.0
        rows.append(row)
        print(json.dumps(row), flush=True)
        write(Path(a.out), meta, rows)  # after every configuration: a cut-short run keeps what it measured


def write(out: Path, meta: dict, rows: list) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    lines = [
        "# Drafter quantization: tau and memory", "",
        f"Pair: {meta['pair']}. {meta['prompts']} greedy prompts (GSM8K dev questions, chat template), "
        f"max {meta['max_tokens']} tokens, block size {meta['block_size']}; backend {meta['backend']}, "
        f"target dtype {meta['target_dtype']}; {meta['date']}.", "",
        f"Command: `{meta['command']}`", "",
        "Memory is the drafter's own parameters as loaded (embedding and head are the target's); "
        "'vs fp16' divides by the same parameters at 2 bytes each. Quantized layers keep bfloat16 "
        "scales; activations stay in the target's dtype (float16 is refused unless the target is float16 "
        "on a GPU: it overflows on bf16 targets' hidden states and zeroes acceptance).", "",
        "| drafter | quantized layers | memory | vs fp16 | tau | tau loss | acceptance | tok/s | output = unquantized |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = "as loaded" if not r["bits"] else f"{r['bits']}-bit, group {r['group_size']}"
        lines.append(f"| {name} | {r['quantized_layers']} | {r['drafter_bytes'] / 1e6:.2f} MB | {r['mem_vs_fp16']:.0%} | "
                     f"{r['tau']:.3f} | {r['tau_loss']:+.1%} | {r['acceptance']:.1%} | {r['tokens_per_s']:.1f} | "
                     f"{'yes' if r['identical_output'] else 'NO'} |")
    lines += ["", f"Goal: {meta['goal']}. tok/s is indicative only (shared CPU)."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}", flush=True)


if __name__ == "__main__":
    main()
