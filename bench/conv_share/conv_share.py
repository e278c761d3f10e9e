"""Share of a DFlash 2 decode cycle spent in the dynamic conv.

Runs the embedded pair with the convs on, then with the convs skipped (same
drafter otherwise), interleaved prompt by prompt; the conv share is the drop in
per-cycle time over the per-cycle time with convs. (The path selector runs
lazily inside the verify's graph: it has no time of its own to report.)"""

import json
import time
from pathlib import Path

import mlx_dflash  # noqa: F401,E402
from mlx_dflash import generate
from mlx_dflash import load  # noqa: E402

PROMPTS = [json.loads(l)["messages"] for l in open("runs/data/gsm8k_dev.jsonl")][:8] if Path("runs/data/gsm8k_dev.jsonl").exists() else None


def main():
    model, tok, d = load()
    if PROMPTS:
        prompts = [tok.apply_chat_template(m, add_generation_prompt=True) for m in PROMPTS]
    else:
        prompts = ["def fibonacci(n):", "import os\n", "class Stack:", "Natalia sold clips"]
    acc = {True: [0.0, 0, 0.0], False: [0.0, 0, 0.0]}  # time, cycles, t_draft
    generate(model, tok, prompts[0], d, max_tokens=16)
    for p in prompts:
        for conv in (True, False):
            for layer in d.layers:
                layer.v2 = conv
            r = generate(model, tok, p, d, max_tokens=96, block_size=5)
            s = r.stats
            a = acc[conv]
            a[0] += s.t_draft + s.t_verify + s.t_book
            a[1] += s.cycles
            a[2] += s.t_draft
    for layer in d.layers:
        layer.v2 = True
    per = {k: v[0] / v[1] for k, v in acc.items()}
    out = {
        "cycle_ms_with_conv": per[True] * 1e3,
        "cycle_ms_without_conv": per[False] * 1e3,
        "draft_ms_with_conv": acc[True][2] / acc[True][1] * 1e3,
        "draft_ms_without_conv": acc[False][2] / acc[False][1] * 1e3,
        "conv_share": (acc[True][2] / acc[True][1] - acc[False][2] / acc[False][1]) / per[True],
        "prompts": len(prompts),
        "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
