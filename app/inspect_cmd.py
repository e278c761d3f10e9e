"""`mlx-dflash inspect PATH`: what a drafter checkpoint is, without loading its weights."""

from __future__ import annotations

import json


def add_parser(sub):
    p = sub.add_parser("inspect", help="show a drafter's version, block size, taps and parameter counts")
    p.add_argument("path", help="drafter folder or Hugging Face repo id")
    p.add_argument("--json", action="store_true")


def run(args):
    from mlx_dflash.drafter import Drafter, param_counts, read_config
    from mlx_dflash.hub import resolve_path

    path = resolve_path(args.path, "drafter")
    c = read_config(path)
    counts = param_counts(Drafter(c))  # lazy: shapes only
    info = {"path": str(path), "version": c.version, "block_size": c.block_size,
            "target_layer_ids": c.target_layer_ids, "num_layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "mask_token_id": c.mask_token_id,
            "params": counts}
    if c.version == 2:
        info.update(conv_group_size=c.conv_group_size, selector_rank=c.selector_rank,
                    selector_top_k=c.selector_top_k, selector_codebooks=c.selector_codebooks)
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"DFlash {c.version} drafter at {path}")
    print(f"  block size {c.block_size}, {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
          f"taps target layers {c.target_layer_ids}, mask token {c.mask_token_id}")
    for k in ("layers", "fc", "conv", "selector", "total"):
        print(f"  {k:>8}: {counts[k] / 1e6:9.3f}M")
    return 0
