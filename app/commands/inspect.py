"""`mlx-dflash inspect PATH`: what a drafter checkpoint is, without loading its
weights: every config field read (drafter_config.FIELDS), its value and its effect."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def add_parser(sub):
    p = sub.add_parser("inspect", help="show every field a drafter's config sets and what it does")
    p.add_argument("path", help="drafter folder or Hugging Face repo id")
    p.add_argument("--json", action="store_true")


def _weight_keys(path: Path) -> dict:
    """name -> (dtype, shape) from the safetensors headers (no tensor data read)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        out.update({k.removeprefix("model."): (v["dtype"], v["shape"]) for k, v in header.items()
                    if k != "__metadata__"})
    return out


def run(args):
    from mlx_dflash.drafting.drafter import Drafter, param_counts
    from mlx_dflash.drafting.drafter_config import attention_summary, read_config
    from mlx_dflash.models.discovery import weights_problem
    from mlx_dflash.models.model_names import model_path
    from mlx_dflash.platform.hub import HubError, resolve_path

    path = resolve_path(model_path(args.path), "drafter")  # any name `models list` prints
    c = read_config(path)
    problem = weights_problem(path)  # a truncated download must not look fine
    if problem:
        raise HubError(problem)
    keys = _weight_keys(path)
    if c.version == 2:
        c.selector_codebooks = "candidate_selector.predecessor_codebook" in keys or \
            "candidate_selector.predecessor_codebook.weight" in keys
    counts = param_counts(Drafter(c))  # lazy: shapes only
    dtypes = sorted({d for d, _ in keys.values()})
    rows = c.describe()
    layout = None
    if c.version == 2:
        layout = ("published [V, r] codebooks" if c.selector_codebooks
                  else "factorised projections of the target embedding")
    info = {"path": str(path), "version": c.version, "block_size": c.block_size,
            "target_layer_ids": c.target_layer_ids, "num_layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "mask_token_id": c.mask_token_id,
            "fields": {k: v for k, v, _ in rows}, "effects": {k: e for k, _, e in rows},
            "attention": attention_summary(c), "selector_layout": layout,
            "checkpoint_dtypes": dtypes, "params": counts, "extra_fields": sorted(c.extra)}
    if args.json:
        print(json.dumps(info, default=str))
        return 0
    print(f"DFlash {c.version} drafter at {path}")
    for k, v, effect in rows:
        print(f"  {k:<29} {json.dumps(v, default=str):<24} {effect}")
    for line in attention_summary(c):
        print(f"  {line}")
    if layout:
        print(f"  selector layout: {layout}")
    print(f"  checkpoint dtype: {', '.join(dtypes) or 'no weights'} (the drafter runs in it unless quantized)")
    if c.extra:
        print(f"  not read (no effect): {', '.join(sorted(c.extra))}")
    for k in ("layers", "fc", "conv", "selector", "total"):
        print(f"  {k:>8}: {counts[k] / 1e6:9.3f}M")
    return 0
