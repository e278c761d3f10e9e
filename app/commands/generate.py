"""`mlx-dflash generate`: one prompt, streamed to stdout (or one JSON object).

The model's saved settings apply (`mlx-dflash settings`), as in chat and serve;
a flag given on the command line overrides its setting for this run."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import fields, replace

from app.errors import UserError


def _verify_modes() -> tuple:
    from mlx_dflash.policy.registry import VERIFY_MODES

    return tuple(VERIFY_MODES)


def add_parser(sub):
    p = sub.add_parser("generate", help="generate text for one prompt",
                       description="Generate text for one prompt. Unset flags take the model's saved settings "
                                   "(mlx-dflash settings get MODEL).")
    p.add_argument("--model", default=None,
                   help="target: an id from `mlx-dflash models list`, a folder or a Hugging Face repo id "
                        "(default: the default model)")
    p.add_argument("--drafter", default=None, help="DFlash drafter, named the same ways (default: the saved or "
                                                  "best compatible one)")
    p.add_argument("--prompt", required=True, help="the prompt; '-' reads it from stdin")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temp", type=float, default=None, help="temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None,
                   help="the fixed verify width: every cycle verifies exactly this many rows (the guard off, unless "
                        "--guard on; default from settings: 5)")
    p.add_argument("--guard", choices=("on", "off"), default=None,
                   help="on: each cycle's width is the guard's choice, from plain decoding up to the drafter's "
                        "trained block size; off: --block-size exactly (default from settings: on)")
    modes = _verify_modes()
    p.add_argument("--verify-mode", default=None, metavar="MODE",
                   help=f"{' | '.join(modes)} (default from settings: dflash)")
    p.add_argument("--dtype", default=None, metavar="DTYPE",
                   help="the target's compute dtype: auto | checkpoint | float32 | bfloat16 | float16 (default from "
                        "settings: auto = $MLX_DFLASH_DTYPE if set, else the fastest measured on this machine: "
                        "float32 for a bf16 model on mlx-cpu, the checkpoint's on Metal)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--system", default=None, help="system prompt (chat template only; default from settings)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--split", default="auto", choices=("auto", "tensor", "pipeline"),
                   help="under mlx.launch: how the target is split over the ranks (default auto: tensor "
                        "parallelism where mlx-lm has it for the family, else pipeline)")


def build_prompt(tokenizer, text: str, raw: bool, system=None):
    if raw or not getattr(tokenizer, "chat_template", None):
        return text
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True)


# flag -> ModelSettings field
FLAGS = {"max_tokens": "max_tokens", "temp": "temperature", "top_p": "top_p", "top_k": "top_k",
         "min_p": "min_p", "block_size": "block_size", "verify_mode": "verify_mode"}


def effective_settings(saved, args):
    """The saved settings with the flags that were given on top, checked as the
    settings file is (so `--block-size 0` or `--temp nan` is refused, not ignored)."""
    from mlx_dflash.settings.schema import SettingsError, check_model

    names = {f.name for f in fields(saved)}
    over = {FLAGS[k]: v for k, v in vars(args).items() if k in FLAGS and v is not None and FLAGS[k] in names}
    guard = getattr(args, "guard", None)
    if guard is not None or over.get("block_size") is not None:  # a width given is drafted exactly, as a call's
        over["guard"] = guard == "on"  # block_size is (DecodeConfig.guarded), unless --guard on
    s = replace(saved, **over)
    try:
        check_model(s)
    except SettingsError as e:  # name the flag when a flag set the refused value
        flag = {f: k for k, f in FLAGS.items()}
        bad = next((f for f in over if str(e).startswith(f) or f.replace("_", " ") in str(e)), None)
        raise SettingsError(f"--{flag[bad].replace('_', '-')}: {e}" if bad else str(e)) from None
    return s


def _read_prompt(text: str) -> str:
    if text != "-":
        return text
    if sys.stdin is None or sys.stdin.isatty():
        raise UserError("--prompt -: pipe the prompt on stdin (echo 'hi' | mlx-dflash generate --prompt -)")
    try:
        data = sys.stdin.read()
    except UnicodeDecodeError:
        raise UserError("--prompt -: stdin is not UTF-8 text") from None
    if not data.strip():
        raise UserError("--prompt -: stdin was empty")
    return data.rstrip("\n")


class _Pipe:
    """stdout that stops the run quietly when the reader has gone (`| head`)."""

    class Closed(Exception):
        pass

    def write(self, s: str) -> None:
        try:
            sys.stdout.write(s)
            sys.stdout.flush()
        except BrokenPipeError:
            # later writes (and the interpreter's own flush at exit) go nowhere
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            raise self.Closed from None


def run(args):
    from mlx_dflash.engine.distributed import world

    group = world()
    if group is not None:  # started by mlx.launch: the target split over the ranks
        from app.commands.distributed import generate

        return generate(args, group, build_prompt, effective_settings)
    from mlx_dflash import DecodeConfig, stream_generate
    from mlx_dflash.cache.prompt_store import open_store
    from mlx_dflash.engine.calibrate import DEFAULT as CALIBRATION
    from mlx_dflash.engine.cost_source import prepare_at_load
    from mlx_dflash.engine.decoder import encode
    from mlx_dflash.models.loader import model_dtype
    from mlx_dflash.models.manager import acceptance_warning, load_model
    from mlx_dflash.models.settings_checks import settings_store
    from mlx_dflash.policy.registry import fit_block_size
    from mlx_dflash.settings.schema import COMPUTE_DTYPES, SettingsError
    from mlx_dflash.target.adapter import Target

    if args.dtype is not None and args.dtype not in COMPUTE_DTYPES:
        raise SettingsError(f"--dtype: unknown dtype '{args.dtype}'; valid: {', '.join(COMPUTE_DTYPES)}")
    prompt_text = _read_prompt(args.prompt)
    store = settings_store()
    dflash = None if args.verify_mode is None else args.verify_mode != "off"
    if args.drafter is not None and dflash is None:
        dflash = True  # naming a drafter asks for it
    lm = load_model(args.model, store, drafter=args.drafter, dflash=dflash, download=True, dtype=args.dtype)
    if lm.dtype_notice():
        sys.stderr.write(f"mlx-dflash: {lm.dtype_notice()}\n")
    s = effective_settings(lm.settings, args)
    if lm.drafter is not None and args.block_size is not None:
        try:
            fit_block_size(s.block_size, lm.drafter.block_size, explicit=True)
        except ValueError as e:
            raise UserError(f"--block-size: {e}") from None
    tok = lm.tokenizer
    prompt = build_prompt(tok, prompt_text, args.raw, args.system if args.system is not None else s.system_prompt)
    def progress(done, total):  # a prompt of more than two prefill chunks: its progress on stderr
        if total > 4096:
            sys.stderr.write(f"\rmlx-dflash: prefill {done}/{total} tokens{chr(10) if done == total else ''}")
            sys.stderr.flush()

    cfg = DecodeConfig.from_settings(s, lm.drafter, seed=args.seed, stop=args.stop, prefill_progress=progress)
    prompt_ids = encode(tok, prompt)
    if cfg.needs_costs(lm.drafter, len(prompt_ids)):  # the guard's costs at load, not inside the answer (once)
        line = prepare_at_load(lm.model, lm.drafter, CALIBRATION, (len(prompt_ids),))
        if line:
            sys.stderr.write(f"mlx-dflash: {line}\n")
    # the prompt's longest prefix cached on disk by an earlier run (chat, serve, generate); this one's after
    cache = open_store(*store.globals().prompt_store_bytes(), lm.model, tok, lm.drafter, lm.id, keep_last=True)
    target = Target(lm.model)
    pc, _ = cache.take(target, prompt_ids, lm.drafter, cfg.keeps_drafter_context(lm.drafter, len(prompt_ids)))
    out = _Pipe()
    text, ids, r = [], [], None
    eos = set(tok.eos_token_ids)
    gen, kept = stream_generate(lm.model, tok, prompt_ids, lm.drafter, prompt_cache=pc, config=cfg), False
    try:
        for r in gen:
            if not (r.finish_reason == "stop" and r.token in eos):
                ids.append(r.token)
            text.append(r.text)
            if not args.json:
                out.write(r.text)
        kept = True  # the generation ended as it should
        if r is None:
            return 0
        s = r.stats
        why = acceptance_warning(s, lm.drafter_id)  # judged on the whole answer: its start is often the hardest
        if why:
            sys.stderr.write(f"\nmlx-dflash: {why}\n")
        if args.json:
            res = {"text": "".join(text), "token_ids": ids, "finish_reason": r.finish_reason, "model": lm.id,
                   "drafter": lm.drafter_id, "dtype": model_dtype(lm.model),
                   "dtype_why": lm.dtype.why if lm.dtype is not None else None,
                   "stats": {"tau": s.tau, "cycles": s.cycles, "drafted": s.drafted, "accepted": s.accepted,
                             "acceptance_rate": s.acceptance_rate, "tokens_per_second": s.generation_tps,
                             "prompt_tokens": s.prompt_tokens, "generation_tokens": s.generation_tokens,
                             "prompt_tps": s.prompt_tps, "mode": s.mode, "fallback": s.fallback,
                             "policy": s.policy, "reused_tokens": s.reused_tokens, "prompt_cache": s.prompt_cache,
                             "max_width": s.max_width, "width": s.width, "guard": s.guard,
                             "peak_memory_gb": s.peak_memory}}
            out.write(json.dumps(res) + "\n")
        else:
            out.write("\n")
            sys.stderr.write(
                f"[{s.generation_tokens} tokens, {s.generation_tps:.1f} tok/s, tau {s.tau:.2f}, "
                f"accept {s.acceptance_rate:.0%}, mode {s.mode}{', fallback: ' + s.fallback if s.fallback else ''}, "
                f"{s.width_text() + ', ' if s.mode != 'off' else ''}"
                f"{model_dtype(lm.model)}]\n")
    except _Pipe.Closed:
        kept = True  # (the cache agrees with the tokens at every yield)
        return 0  # the reader took what it wanted
    finally:
        gen.close()  # (its drafter features go to the cache)
        if kept and r is not None:  # not after an error: the cache may be half-written
            cache.put(pc, target)
        cache.close(timeout=60)  # the output is out: writing the prefix delays only the exit
    return 0
