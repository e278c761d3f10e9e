"""`mlx-dflash generate`: one prompt, streamed to stdout (or one JSON object)."""

from __future__ import annotations

import json
import sys


def add_parser(sub):
    p = sub.add_parser("generate", help="generate text for one prompt")
    p.add_argument("--model", default=None, help="target: folder or Hugging Face repo id (default: embedded pair)")
    p.add_argument("--drafter", default=None, help="DFlash drafter: folder or repo id")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None, help="verify width w (default 5)")
    p.add_argument("--verify-mode", default="dflash", help="dflash | off")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--system", default=None, help="system prompt (chat template only)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def build_prompt(tokenizer, text: str, raw: bool, system=None):
    if raw or not getattr(tokenizer, "chat_template", None):
        return text
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True)


def run(args):
    from mlx_dflash import load, stream_generate

    model, tok, drafter = load(args.model, args.drafter)
    prompt = build_prompt(tok, args.prompt, args.raw, args.system)
    kw = dict(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
              min_p=args.min_p, seed=args.seed, block_size=args.block_size, verify_mode=args.verify_mode,
              stop=args.stop)
    text, ids, r = [], [], None
    eos = set(tok.eos_token_ids)
    for r in stream_generate(model, tok, prompt, drafter, **kw):
        if not (r.finish_reason == "stop" and r.token in eos):
            ids.append(r.token)
        text.append(r.text)
        if not args.json:
            sys.stdout.write(r.text)
            sys.stdout.flush()
    s = r.stats
    if args.json:
        out = {"text": "".join(text), "token_ids": ids, "finish_reason": r.finish_reason,
               "stats": {"tau": s.tau, "cycles": s.cycles, "drafted": s.drafted, "accepted": s.accepted,
                         "acceptance_rate": s.acceptance_rate, "tokens_per_second": s.generation_tps,
                         "prompt_tokens": s.prompt_tokens, "generation_tokens": s.generation_tokens,
                         "prompt_tps": s.prompt_tps, "mode": s.mode, "fallback": s.fallback,
                         "block_size": s.block_size, "peak_memory_gb": s.peak_memory}}
        print(json.dumps(out))
    else:
        sys.stdout.write("\n")
        sys.stderr.write(
            f"[{s.generation_tokens} tokens, {s.generation_tps:.1f} tok/s, tau {s.tau:.2f}, "
            f"accept {s.acceptance_rate:.0%}, mode {s.mode}{', fallback: ' + s.fallback if s.fallback else ''}]\n")
    return 0
