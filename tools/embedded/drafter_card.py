"""Write the model card (README.md) of an exported drafter from its training run and
the tau benchmark.

    python -m tools.embedded drafter-card models/dflash2 --run runs/drafters/dflash2 \
        [--bench bench/tau_ablation.json] [--commands tools/embedded/train_drafters.sh]

A run started from a saved drafter (`train-drafter --init`) is carded as a refresh;
`--before-after BENCH.json` (a tau.py run whose dflash1 slot held the drafter
before the refresh and whose dflash2 slot the refreshed one) adds the before/after table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
import mlx_dflash  # noqa: F401  (fast BLAS before mlx)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--run", required=True)
    ap.add_argument("--bench", default=str(ROOT / "bench" / "tau_ablation.json"))
    ap.add_argument("--commands", default=str(ROOT / "tools" / "embedded" / "train_drafters.sh"))
    ap.add_argument("--note", default=None, help="a paragraph on how the run actually went")
    ap.add_argument("--before-after", default=None, metavar="JSON",
                    help="tau.py results with the drafter before a refresh in the dflash1 slot")
    a = ap.parse_args(argv)
    from mlx.utils import tree_flatten

    from mlx_dflash.drafting.drafter import load_drafter

    model, run = Path(a.model), Path(a.run)
    d = load_drafter(str(model))
    c = d.config
    n_params = sum(v.size for _, v in tree_flatten(d.parameters()))
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    tc = json.loads((run / "train_config.json").read_text())
    stats = json.loads((run / "data_stats.json").read_text())
    log = [json.loads(l) for l in (model / "train_log.jsonl").read_text().splitlines() if l.strip()]
    tr = [r for r in log if "loss" in r]
    ev = [r for r in log if "val_loss" in r]
    name = "DFlash 2" if c.version == 2 else "DFlash 1"
    other = "dflash1" if c.version == 2 else "dflash2"
    key = f"dflash{c.version}"

    tot = sum(s["tokens"] for s in stats.values())
    anc = sum(s["anchor_tokens"] for s in stats.values())
    op = stats.get("on-policy", {"tokens": 0, "anchor_tokens": 0, "examples": 0, "rows": 0})
    data_rows = "\n".join(f"| {k} | {v['examples']} | {v['rows']} ({v['held_out_rows']} held out) | {v['tokens']:,} | "
                          f"{v['anchor_tokens']:,} |" for k, v in stats.items())
    refresh = tc.get("init")
    L = [f"# mlx-dflash embedded {name} drafter", ""]
    if refresh:
        L += [f"**Refreshed**: fine-tuned from the previous weights of this drafter (`{refresh}` as it was "
              "before the run) on the current target's own greedy responses, at a lower learning rate; "
              "see Training and the before/after table.", ""]
    L += [(f"The default drafter of the embedded pair: a {name} drafter for `models/target`, trained with "
          "`mlx-dflash train-drafter`." if c.version == 2 else
          f"The {name} drafter of the embedded pair, kept for the DFlash 1 vs DFlash 2 ablation "
          "(`bench/tau_ablation.md`); it was trained with exactly the same layers, block size, data, steps and "
          f"seed as `models/{other}`."), "",
          "## Model", "",
          "| field | value |", "|---|---|",
          f"| architecture | `{c.to_dict()['architectures'][0]}` |",
          f"| draft layers | {c.num_hidden_layers} (hidden {c.hidden_size}, MLP {c.intermediate_size}, "
          f"{c.num_attention_heads} heads / {c.num_key_value_heads} KV heads, head_dim {c.head_dim}) |",
          f"| block size (trained) | {c.block_size} |",
          f"| tapped target layers | {c.target_layer_ids} of {c.num_target_layers} |",
          f"| mask token id | {c.mask_token_id} (`<|mask|>`) |"]
    if c.version == 2:
        L.append(f"| DFlash 2 extras | two-tap dynamic convs (group {c.conv_group_size}), path selector "
                 f"(rank {c.selector_rank}, top-{c.selector_top_k}) |")
    L += [f"| parameters | {n_params:,} (embedding and LM head are the target's) |",
          f"| weights | `model.safetensors`, bfloat16, {size / 1e6:.1f} MB |", "",
          "## Data", "",
          "| source | examples | rows | tokens | anchor-eligible tokens |", "|---|---|---|---|---|", data_rows, "",
          f"Rows of {tc['seq_len']} tokens. On-policy = the target's own greedy responses (at most "
          f"{tc['gen_max_tokens']} tokens) to GSM8K *train* questions (chat template) and to Python function "
          "headers + docstrings from the standard-library files the target trained on (`tools/embedded/drafter_data.py`"
          "); "
          "anchors are drawn from response tokens. Corpus = the target's own training text (other GSM8K train "
          "problems as ChatML chat, windows of the same stdlib files). The GSM8K dev split (the last 473 problems) "
          "was never used. "
          f"On-policy share: {op['tokens'] / tot:.0%} of the tokens, {op['anchor_tokens'] / anc:.0%} of the anchor "
          "positions. 5% of each source's rows (at most 48, evenly spaced through it) are held out for the metrics below.", "",
          "## Training", "",
          (f"* fine-tuned from `{refresh}` (its config and weights, selector tables included): " if refresh else "* ")
          + f"{tr[-1]['step'] if tr else 0} steps of {tc['batch']} rows x {tc['anchors']} anchors (blocks "
          f"`[token_p, MASK x {c.block_size - 1}]` that see the target features of the rows before p); wall time "
          f"{(tr[-1]['elapsed'] if tr else 0) / 60:.0f} min on 2 shared x86-64 CPU cores (mlx CPU backend).",
          f"* loss: cross-entropy on block positions 1..{c.block_size - 1} weighted exp(-(k-1)/gamma), gamma "
          f"{tc['gamma'] or 'default (4 at B=8)'}"
          + (f", plus {tc['selector_weight']} x the selector loss (teacher-forced pair scores over the top-K "
             "candidates)" if c.version == 2 else "") + ".",
          f"* AdamW (weight decay {tc['weight_decay']}), peak lr {tc['lr']}, warmup {tc['warmup']:.0%} of the steps, "
          f"cosine to {tc['min_lr']:.0%} of peak, gradient clip {tc['clip']}, seed {tc['seed']}; the target is frozen.",
          ""]
    if ev:
        e0, e1 = ev[0], ev[-1]
        w = max(e1["tau_est"], key=int)
        L += ["| held-out metric | step 0 | final |", "|---|---|---|",
              f"| weighted CE | {e0['val_loss']:.3f} | {e1['val_loss']:.3f} |",
              f"| accuracy, position 1 | {e0['val_acc'][0]:.3f} | {e1['val_acc'][0]:.3f} |",
              f"| estimated tau (w={w}, per-position argmax) | {e0['tau_est'][w]:.2f} | {e1['tau_est'][w]:.2f} |"]
        if "tau_est_selector" in e1:
            L.append(f"| estimated tau (w={w}, selector walk) | {e0['tau_est_selector'][w]:.2f} | "
                     f"{e1['tau_est_selector'][w]:.2f} |")
        L += ["", f"Final train loss (last log window): {tr[-1]['loss']:.3f}. Per-position held-out accuracy "
              f"(k = 1..{c.block_size - 1}): {e1['val_acc']}.", ""]
    L += ["![loss curve](loss.png)", "", "`train_log.jsonl`: the full metrics log.", ""]
    b = Path(a.bench)
    if b.exists():
        res = json.loads(b.read_text())
        L += ["## Measured tau (greedy, real decoding)", "",
              f"`tools/embedded/tau.py`, max {res['max_tokens']} new tokens, {res['date']}; "
              f"full results in `bench/{(b.with_suffix('.md') if b.with_suffix('.md').exists() else b).name}`.", "",
              "| prompts | " + " | ".join(f"tau w={w} | tok/s w={w}" for w in res["widths"]) + " | plain tok/s |",
              "|---|" + "---|---|" * len(res["widths"]) + "---|"]
        for s, r in res["sets"].items():
            cells = []
            for w in res["widths"]:
                x = r["summary"][f"{key}@w{w}"]
                cells += [f"{x['tau']:.2f}", f"{x['tok_per_s']:.1f}"]
            L.append(f"| {s} ({r['n_prompts']}) | " + " | ".join(cells) + f" | {r['summary']['plain']['tok_per_s']:.1f} |")
        L.append("")
    if a.before_after:
        res = json.loads(Path(a.before_after).read_text())
        ws = res["widths"]
        L += ["## Before / after the refresh (greedy tau, same prompts)", "",
              f"`{res['command']}` ({res['date']}): the `dflash1` slot held the weights before the refresh, the "
              "`dflash2` slot the refreshed ones; every output was compared with plain decoding.", "",
              "| prompts | " + " | ".join(f"tau before (w={w}) | tau after (w={w})" for w in ws)
              + " | outputs identical to plain |", "|---|" + "---|---|" * len(ws) + "---|"]
        for s, r in res["sets"].items():
            cells = [f"{r['summary'][f'{n}@w{w}']['tau']:.2f}" for w in ws for n in ("dflash1", "dflash2")]
            L.append(f"| {s} ({r['n_prompts']}) | " + " | ".join(cells) + f" | {'yes' if r['lossless'] else 'NO'} |")
        L.append("")
    if a.note:
        L += ["## Run notes", "", a.note, ""]
    cmd = Path(a.commands)
    L += ["## Exact commands", "",
          f"From `{cmd.relative_to(ROOT) if cmd.is_relative_to(ROOT) else cmd}` (data, on-policy generation, "
          "training, benchmark, export):", "", "```bash",
          cmd.read_text().rstrip() if cmd.exists() else "(missing)", "```", "",
          "Training configuration as run (`train_config.json` of the run):", "", "```json",
          json.dumps(tc, indent=1), "```", ""]
    (model / "README.md").write_text("\n".join(L))
    print(f"wrote {model / 'README.md'}")

