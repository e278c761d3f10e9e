"""`mlx-dflash generate` under `mlx.launch`: the target split over the ranks
(mlx_dflash.engine.distributed), the drafter on every rank; every rank decodes, rank 0
alone prints. A rank that is lost ends the others with one line."""

from __future__ import annotations

import json
import sys

import mlx.core as mx

from app.errors import UserError
from mlx_dflash.engine.decode_config import DecodeConfig
from mlx_dflash.engine.distributed import DistributedError, Session, load, lost_rank
from mlx_dflash.models.dtype_choice import cast
from mlx_dflash.models.loader import model_dtype
from mlx_dflash.models.model_names import model_path, resolve
from mlx_dflash.policy.registry import fit_block_size
from mlx_dflash.models.settings_checks import settings_store


def _paths(args, store) -> tuple:
    """(model id, target folder, drafter id, drafter folder or None, saved settings)."""
    entry = resolve(args.model, store, download=True)
    if entry.kind != "target":
        raise UserError(f"'{entry.id}' is a {entry.kind_label}, not a target model")
    s = store.model(entry.id)
    did = args.drafter or s.drafter or (entry.compatible_drafters[0] if entry.compatible_drafters else None)
    off = args.verify_mode == "off" or (args.verify_mode is None and not s.dflash_enabled)
    if off:
        did = None
    return entry.id, str(entry.path), did, (model_path(did, store) if did else None), s


def generate(args, group, build_prompt, effective_settings) -> int:
    """`generate`'s run on one rank; `build_prompt` and `effective_settings` are
    generate_cmd's (passed in: that module imports this one)."""
    lead = group.rank() == 0
    out = sys.stdout if lead else None
    try:
        return _generate(args, group, out, build_prompt, effective_settings)
    except RuntimeError as e:
        why = lost_rank(e, group)
        if why is None:
            raise
        raise UserError(why) from None
    except DistributedError as e:
        raise UserError(str(e)) from None


def _generate(args, group, out, build_prompt, effective_settings) -> int:
    if args.prompt == "-":
        raise UserError("--prompt -: stdin is not passed to the ranks under mlx.launch; give the prompt as text")
    store = settings_store()
    mid, path, did, dpath, saved = _paths(args, store)
    model, tok, drafter, split = load(path, dpath, group, args.split, seed=args.seed)
    if args.dtype in ("float32", "bfloat16", "float16"):  # the same cast on every rank (auto would time one)
        for m in (model, drafter):
            if m is not None:
                cast(m, getattr(mx, args.dtype))
    s = effective_settings(saved, args)
    if drafter is not None:
        try:
            fit_block_size(s.block_size, drafter.block_size, explicit=args.block_size is not None)
        except ValueError as e:
            raise UserError(f"--block-size: {e}") from None
    sess = Session(model, tok, drafter, split)
    text = sess.channel.share(args.prompt)  # rank 0's prompt is the one every rank decodes
    prompt = build_prompt(tok, text, args.raw, args.system if args.system is not None else saved.system_prompt)
    cfg = DecodeConfig.from_settings(s, drafter, seed=args.seed, stop=args.stop)
    pieces, ids, r = [], [], None
    eos = set(tok.eos_token_ids)
    for r in sess.stream(prompt, cfg):
        if not (r.finish_reason == "stop" and r.token in eos):
            ids.append(r.token)
        pieces.append(r.text)
        if out is not None and not args.json:
            out.write(r.text)
            out.flush()
    if out is None or r is None:
        return 0
    st = r.stats
    if args.json:
        res = {"text": "".join(pieces), "token_ids": ids, "finish_reason": r.finish_reason, "model": mid,
               "drafter": did if drafter is not None else None, "dtype": model_dtype(model),
               "stats": {"tau": st.tau, "cycles": st.cycles, "drafted": st.drafted, "accepted": st.accepted,
                         "acceptance_rate": st.acceptance_rate, "tokens_per_second": st.generation_tps,
                         "prompt_tokens": st.prompt_tokens, "generation_tokens": st.generation_tokens,
                         "prompt_tps": st.prompt_tps, "mode": st.mode, "fallback": st.fallback,
                         "policy": st.policy, "max_width": st.max_width, "width": st.width, "guard": st.guard,
                         "peak_memory_gb": st.peak_memory,
                         "distributed": st.distributed}}
        out.write(json.dumps(res) + "\n")
    else:
        d = st.distributed or {}
        out.write("\n")
        sys.stderr.write(
            f"[{st.generation_tokens} tokens, {st.generation_tps:.1f} tok/s, tau {st.tau:.2f}, "
            f"accept {st.acceptance_rate:.0%}, mode {st.mode}, {d.get('ranks')} ranks ({d.get('split')}), "
            f"collectives {d.get('t_collectives', 0.0):.2f} s, {model_dtype(model)}]\n")
    return 0
