"""`mlx-dflash train-drafter`: train a DFlash (v1) or DFlash 2 drafter for any mlx-lm target.

    mlx-dflash train-drafter --target PATH --out DIR --version 2 --block-size 8 --layers 2 \
        --prompts prompts.jsonl [--corpus text.jsonl] --steps 1000 [--init DRAFTER]

On-policy data: the target answers every prompt (batched, resumable: the
responses are appended to OUT/responses.jsonl and reused). Checkpoints go to
OUT/checkpoints/ (`--resume` continues from the latest), metrics to
OUT/train_log.jsonl, the final drafter (bf16) to OUT/.
"""

from __future__ import annotations

from dataclasses import fields


def add_parser(sub):
    from mlx_dflash.train.config import TrainConfig

    d = {f.name: f.default for f in fields(TrainConfig)}
    p = sub.add_parser("train-drafter", help="train a DFlash / DFlash 2 drafter for a target model",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target model folder or HF repo id (default: the embedded target)")
    p.add_argument("--out", required=True, help="output folder (drafter, checkpoints/, train_log.jsonl)")
    p.add_argument("--version", type=int, choices=(1, 2), default=d["version"], help="DFlash 1 or DFlash 2")
    p.add_argument("--block-size", type=int, default=d["block_size"], help="trained block size B")
    p.add_argument("--layers", type=int, default=d["layers"], help="draft layers")
    p.add_argument("--taps", type=int, default=None, help="tapped target layers (default: up to 5)")
    p.add_argument("--intermediate-size", type=int, default=None, help="draft MLP width (default: the target's)")
    p.add_argument("--mask-token", type=int, default=None, help="mask token id (default: the tokenizer's <|mask|>)")
    p.add_argument("--init", default=None, metavar="DRAFTER",
                   help="start from this saved drafter (folder or repo: config.json + model.safetensors) instead "
                        "of fresh weights, e.g. to fine-tune a published drafter to your (quantized) target; its "
                        "architecture must match --version/--layers/--block-size/--taps and the target")
    g = p.add_argument_group("data")
    g.add_argument("--prompts", default=None,
                   help='JSONL of {"messages": [...]} (chat template) or {"prompt": raw text}: on-policy responses')
    g.add_argument("--corpus", default=None, help='JSONL of {"text": ...} to train on as given')
    g.add_argument("--responses", default=None, help="on-policy response cache (default OUT/responses.jsonl)")
    g.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts")
    g.add_argument("--gen-max-tokens", type=int, default=d["gen_max_tokens"])
    g.add_argument("--gen-temp", type=float, default=d["gen_temperature"], help="0 = greedy responses")
    g.add_argument("--gen-batch", type=int, default=d["gen_batch"], help="prompts generated together")
    g.add_argument("--generate-only", action="store_true", help="only generate the on-policy responses")
    g.add_argument("--seq-len", type=int, default=d["seq_len"], help="tokens per training row")
    g.add_argument("--feature-cache", default=None,
                   help="float16 .npy of the target features of every row, computed once (shareable between runs)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=d["steps"])
    o.add_argument("--batch", type=int, default=d["batch"], help="rows per step")
    o.add_argument("--anchors", type=int, default=d["anchors"], help="anchors (blocks) per row")
    o.add_argument("--lr", type=float, default=d["lr"])
    o.add_argument("--warmup", type=float, default=d["warmup"], help="warmup share of the steps")
    o.add_argument("--weight-decay", type=float, default=d["weight_decay"])
    o.add_argument("--clip", type=float, default=d["clip"], help="gradient-norm clip")
    o.add_argument("--gamma", type=float, default=None, help="position-weight decay (default 4 at B=8, 7 at B=16)")
    o.add_argument("--selector-weight", type=float, default=d["selector_weight"], help="DFlash 2 selector loss weight")
    o.add_argument("--seed", type=int, default=d["seed"])
    o.add_argument("--time-budget", type=float, default=None,
                   help="minutes: stop by then (the lr decay follows time if that is further along)")
    o.add_argument("--compile", action="store_true", help="mx.compile the training step")
    b = p.add_argument_group("bookkeeping")
    b.add_argument("--log-every", type=int, default=d["log_every"])
    b.add_argument("--eval-every", type=int, default=d["eval_every"])
    b.add_argument("--ckpt-every", type=int, default=d["ckpt_every"])
    b.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT/checkpoints")
    b.add_argument("--quiet", action="store_true", help="no progress bars")


def _config(args):
    from mlx_dflash.train.config import TrainConfig

    for k in ("steps", "batch", "anchors", "block_size", "layers", "seq_len", "log_every", "eval_every",
              "ckpt_every", "gen_max_tokens", "gen_batch"):
        if getattr(args, k) < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1")
    if args.lr <= 0:
        raise ValueError("--lr must be > 0")
    if not (args.prompts or args.corpus or args.responses):
        raise ValueError("no training data: pass --prompts FILE.jsonl (on-policy) and/or --corpus FILE.jsonl")
    return TrainConfig(
        out=args.out, target=args.target, version=args.version, block_size=args.block_size, layers=args.layers,
        taps=args.taps, intermediate_size=args.intermediate_size, mask_token=args.mask_token, init=args.init,
        prompts=args.prompts, corpus=args.corpus, responses=args.responses, max_prompts=args.max_prompts,
        gen_max_tokens=args.gen_max_tokens, gen_temperature=args.gen_temp, gen_batch=args.gen_batch,
        seq_len=args.seq_len, steps=args.steps, batch=args.batch, anchors=args.anchors, lr=args.lr,
        warmup=args.warmup, weight_decay=args.weight_decay, clip=args.clip, gamma=args.gamma,
        selector_weight=args.selector_weight, seed=args.seed, compile=args.compile, time_budget=args.time_budget,
        log_every=args.log_every, eval_every=args.eval_every, ckpt_every=args.ckpt_every, resume=args.resume)


def run(args) -> int:
    import sys

    from mlx_dflash.train import loop as T

    cfg = _config(args)
    if args.generate_only and not args.prompts:
        raise ValueError("--generate-only needs --prompts")
    model, tok = T.load_target(cfg.target)
    if args.generate_only:
        path = T.generate_responses(model, tok, cfg, progress=not args.quiet)
        print(f"responses: {path}")
        return 0
    out = T.train(cfg, model, tok, progress=not args.quiet, log=lambda m: print(m, file=sys.stderr),
                  feature_cache_path=args.feature_cache)
    print(f"drafter: {out} (log: {out / 'train_log.jsonl'})")
    return 0
