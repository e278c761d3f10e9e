"""Train the embedded default models of mlx-dflash on CPU (tokenizer, data, model, export).

Sub-commands (run from the repository root: `python -m tools.embedded target ...`):

  python -m tools.embedded target prepare                     # tokenizer + token streams -> runs/data/
  python -m tools.embedded target bench  --preset target      # tokens/s of a few steps
  python -m tools.embedded target train  --preset target --steps N [--resume]
  python -m tools.embedded target train  --preset target --resume --new-phase --ul-data RESPONSES.jsonl
                                          # + unlikelihood on the model's own greedy loops
  python -m tools.embedded target export --preset target      # -> models/target/
  python -m tools.embedded target evaluate --preset target    # generations, repetition rate
  python -m tools.embedded target card   --preset target      # README.md model card + loss curve

`--preset draft` does the same for the small classic autoregressive draft
model (runs/draft-ar -> models/draft-ar).

Data (real text only):
  * the .py files of the running interpreter's standard library
    (sysconfig stdlib; test dirs, idlelib, lib2to3, site-packages skipped; deduped
    by content hash; 1% of files held out for validation);
  * GSM8K train as ChatML chat (user = question, assistant = worked answer with
    the final `#### N` line). The LAST 473 problems of train.jsonl are the dev
    split: never used for training nor for the tokenizer; they are written to
    runs/data/gsm8k_dev.jsonl by `write_gsm8k_dev()` (deterministic).

Here: the training loop and the CLI. Next to it, one concern each:
target_data.py (data, tokenizer, `prepare`), target_model.py (presets,
model config), target_loops.py (loop measures, unlikelihood data and loss),
target_eval.py (`evaluate`, `card`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
# mlx-cpu elementwise ops are single-threaded; a 2-thread OpenBLAS only spins against them
# (and against other jobs on a small shared machine).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import mlx_dflash  # noqa: E402,F401  (must precede mlx: loads OpenBLAS)
from mlx_dflash.platform import fastblas  # noqa: E402

import numpy as np  # noqa: E402

from .target_choice import cmd_prepare_choice  # noqa: E402
from .target_data import DATA, cmd_prepare  # noqa: E402
from .target_eval import cmd_card, cmd_evaluate  # noqa: E402
from .target_loops import unlikelihood_loss, unlikelihood_rows  # noqa: E402
from .target_model import PRESETS, VAL_SEQ, build_model, count_params, model_config  # noqa: E402
from .target_tools import MAX_CONTEXT, ROPE_SCALING, cmd_prepare_tools  # noqa: E402

# what tests/test_train_target.py uses, importable from here
from .target_data import write_gsm8k_dev  # noqa: E402,F401
from .target_loops import loop_region, repeat_positions, stuck_in_loop  # noqa: E402,F401

SEQ = 512
P_GSM = 0.45  # share of training sequences drawn from the GSM8K chat stream
P_TOOLS = 0.0  # share drawn from the tool-call conversations (prepare-tools)


@dataclass
class AuxLoss:
    """A second loss on rows of its own, added to the next-token loss with a weight."""

    key: str  # its name in train_log.jsonl
    fn: Callable  # (logits, targets, mask) -> loss
    weight: float
    rows: np.ndarray  # [N, L + 1] token ids
    mask: np.ndarray  # [N, L] over next-token targets
    per_step: int  # rows a step
    trim: bool  # cut each step's rows after their last masked target (rounded up to 128s)
    rng: np.random.Generator

    def sample(self):
        pick = self.rng.integers(0, len(self.rows), size=self.per_step)
        ub, um = self.rows[pick], self.mask[pick]
        if self.trim:  # a few shapes to compile, little padding
            n = int(np.flatnonzero(um.any(0)).max()) + 2
            n = min(ub.shape[1], -(-n // 128) * 128 + 1)
            ub, um = ub[:, :n], um[:, :n - 1]
        return ub, um


class Sampler:
    """Random windows of SEQ+1 tokens; a sequence comes from the tool conversations w.p.
    P_TOOLS (half of them starting at a conversation's start, so the system prompt with
    the tools is in the window), else from GSM8K chat w.p. P_GSM, else from the stdlib."""

    def __init__(self, seed: int):
        self.code = np.load(DATA / "code_train.npy")
        self.gsm = np.load(DATA / "gsm_train.npy")
        self.tools = np.load(DATA / "tools_train.npy") if P_TOOLS else None
        if self.tools is not None:
            ends = np.flatnonzero(self.tools == 0)  # <|endoftext|> closes every conversation
            starts = np.concatenate([[0], ends + 1])
            self.tool_starts = starts[starts < self.tools.size - SEQ - 1]
        self.rng = np.random.default_rng(seed)

    def batch(self, bs: int):
        out = np.empty((bs, SEQ + 1), dtype=np.int32)
        for i in range(bs):
            if self.tools is not None and self.rng.random() < P_TOOLS:
                src = self.tools
                if self.rng.random() < 0.5:
                    o = self.tool_starts[self.rng.integers(0, self.tool_starts.size)]
                    out[i] = src[o:o + SEQ + 1]
                    continue
            else:
                src = self.gsm if self.rng.random() < P_GSM else self.code
            o = self.rng.integers(0, src.size - SEQ - 1)
            out[i] = src[o:o + SEQ + 1]
        return out


def val_batches(name: str, bs: int, n: int):
    arr = np.load(DATA / f"{name}.npy")
    k = min(n * bs, (arr.size - 1) // VAL_SEQ)
    windows = np.stack([arr[i * VAL_SEQ:(i + 1) * VAL_SEQ + 1] for i in range(k)]).astype(np.int32)
    return [windows[i:i + bs] for i in range(0, k, bs)]


def _ckpt_save(run: Path, model, opt, step, sampler, tokens, elapsed, phase):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    tmp = run / "ckpt.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
    (tmp / "state.json").write_text(json.dumps({
        "step": step, "tokens": tokens, "elapsed": elapsed, "phase": phase,
        "rng": sampler.rng.bit_generator.state}))
    final = run / "ckpt"
    old = run / "ckpt.old"
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def init_weights(model, folder: Path):
    """Load an exported model (bfloat16) as float32; embedding rows of tokens that
    prepare-tools gave new meanings start as the mean of their old spelling's rows."""
    import mlx.core as mx

    w = {k: v.astype(mx.float32) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    stats = DATA / "tools_stats.json"
    if stats.exists():
        emb = np.array(w["model.embed_tokens.weight"])
        for new, old in json.loads(stats.read_text())["embed_init"].items():
            emb[int(new)] = emb[old].mean(axis=0)
        w["model.embed_tokens.weight"] = mx.array(emb)
    model.load_weights(list(w.items()))
    print(f"initialized from {folder}", flush=True)


def cmd_train(args, bench: bool = False):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_unflatten

    assert "OpenBLAS" in fastblas.STATE["blas"], fastblas.STATE
    P = PRESETS[args.preset]
    run = ROOT / P["run"]
    run.mkdir(parents=True, exist_ok=True)
    cfg = model_config(args.preset)
    if args.long_context:  # YaRN to MAX_CONTEXT (target_tools.py)
        cfg.update(max_position_embeddings=MAX_CONTEXT, rope_scaling=dict(ROPE_SCALING))
    mx.random.seed(args.seed)
    model = build_model(cfg)
    total, non_emb = count_params(model)
    print(f"blas: {fastblas.STATE['blas']}; params {total/1e6:.2f}M (non-embedding {non_emb/1e6:.2f}M)",
          flush=True)

    steps, warmup, lr = args.steps, args.warmup, args.lr or P["lr"]
    bs = args.batch or P["batch"]
    budget = args.time_budget * 60 if args.time_budget else float("inf")
    phase = {"step0": 0, "elapsed0": 0.0}  # where the current lr schedule started

    def lr_at(step: int, elapsed: float) -> float:
        """Linear warmup (steps), then cosine to 5% over progress = max(step/steps, time/budget),
        both counted from the start of the current phase."""
        step, elapsed = step - phase["step0"], elapsed - phase["elapsed0"]
        if step < warmup:
            return lr * (0.01 + 0.99 * step / warmup)
        q = min(1.0, max(step / steps, elapsed / budget))
        return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * q)))

    opt = optim.AdamW(learning_rate=lr_at(0, 0.0), betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    sampler = Sampler(args.seed)
    step, tokens, elapsed0 = 0, 0, 0.0

    if args.resume and (run / "ckpt" / "state.json").exists():
        st = json.loads((run / "ckpt" / "state.json").read_text())
        model.load_weights(str(run / "ckpt" / "model.safetensors"))
        opt.init(model.trainable_parameters())
        opt.state = tree_unflatten(list(mx.load(str(run / "ckpt" / "optimizer.safetensors")).items()))
        sampler.rng.bit_generator.state = st["rng"]
        step, tokens, elapsed0 = st["step"], st["tokens"], st["elapsed"]
        phase.update(st.get("phase", {}))
        if args.new_phase:  # a warm restart: a fresh warmup + cosine, steps/budget counted from here
            phase.update(step0=step, elapsed0=elapsed0)
        print(f"resumed from step {step} ({tokens} tokens); phase {phase}", flush=True)
        if not bench and (run / "train_log.jsonl").exists():  # drop records past the checkpoint
            keep = [l for l in (run / "train_log.jsonl").read_text().splitlines()
                    if l.strip() and json.loads(l)["step"] <= step]
            (run / "train_log.jsonl").write_text("".join(l + "\n" for l in keep))
    else:
        if args.init_from:  # continued training from exported weights, with a fresh AdamW
            init_weights(model, Path(args.init_from))
        opt.init(model.trainable_parameters())
        if not bench:
            (run / "config.json").write_text(json.dumps(cfg, indent=2))
            (run / "train_log.jsonl").write_text("")
    mx.eval(model.parameters(), opt.state)

    def loss_fn(m, x, y):
        logits = m(x).astype(mx.float32)
        return nn.losses.cross_entropy(logits, y, reduction="mean")

    state = [model.state, opt.state]

    from functools import partial

    @partial(mx.compile, inputs=state, outputs=state)
    def train_step(batch):
        x, y = batch[:, :-1], batch[:, 1:]
        loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y)
        grads, gnorm = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss, gnorm

    # a second loss on rows of its own, added with a weight: unlikelihood on the model's own loops
    # (--ul-data) or the call tokens alone of prepare-choice's call examples (--sft-weight)
    if args.ul_data and args.sft_weight:
        raise SystemExit("--ul-data and --sft-weight each add a second loss; give one of them")
    aux = None
    if args.ul_data:
        rows, mask = unlikelihood_rows(args.ul_data, cfg["pad_token_id"], args.ul_len, args.ul_ngram)
        print(f"unlikelihood: {len(rows)} looping responses, "
              f"{int(mask.sum())} penalized tokens, weight {args.ul_weight}", flush=True)
        if not len(rows):
            raise SystemExit("--ul-data: no response fell into a loop; nothing to train on")
        aux = AuxLoss("ul_loss", unlikelihood_loss, args.ul_weight, rows, mask, args.ul_batch, False,
                      np.random.default_rng(args.seed + 1))
    elif args.sft_weight:
        z = np.load(DATA / "calls_train.npz")

        def call_loss(logits, y, mask):
            ce = nn.losses.cross_entropy(logits, y, reduction="none")
            return (ce * mask).sum() / mx.maximum(mask.sum(), 1.0)

        aux = AuxLoss("call_loss", call_loss, args.sft_weight, z["x"].astype(np.int32), z["mask"], args.sft_batch,
                      True, np.random.default_rng(args.seed + 2))
        print(f"call examples: {len(aux.rows)}, {args.sft_batch} a step, weight {args.sft_weight}", flush=True)
    if aux is not None:
        def mixed_loss(m, x, y, ux, uy, um):
            ce = loss_fn(m, x, y)
            extra = aux.fn(m(ux).astype(mx.float32), uy, um)
            return ce + aux.weight * extra, (ce, extra)

        @partial(mx.compile, inputs=state, outputs=state)
        def aux_step(batch, ub, um):
            (_, (ce, extra)), grads = nn.value_and_grad(model, mixed_loss)(
                model, batch[:, :-1], batch[:, 1:], ub[:, :-1], ub[:, 1:], um)
            grads, gnorm = optim.clip_grad_norm(grads, 1.0)
            opt.update(model, grads)
            return ce, gnorm, extra

    # not mx.compile'd: a compiled closure would freeze the weights it first saw as constants
    def eval_loss(batch):
        return loss_fn(model, batch[:, :-1], batch[:, 1:])

    vals = {"gsm_dev": val_batches("gsm_dev", 8, 3), "code_val": val_batches("code_val", 8, 3)}
    if (DATA / "tools_dev.npy").exists():
        vals["tools_dev"] = val_batches("tools_dev", 8, 3)

    def evaluate():
        return {k: float(np.mean([eval_loss(mx.array(b)).item() for b in bl])) for k, bl in vals.items()}

    log = open(run / "train_log.jsonl", "a") if not bench else None
    t_start = time.time()
    t_last_ckpt = t_start
    t_win, tok_win = time.time(), 0
    run_steps = args.bench_steps if bench else steps
    losses, aux_losses = [], []
    run_steps += phase["step0"] if not bench else 0
    while step < run_steps:
        el = elapsed0 + time.time() - t_start
        if not bench and el - phase["elapsed0"] >= budget:
            print(f"time budget of {args.time_budget} min reached at step {step}", flush=True)
            break
        cur_lr = lr_at(step, el)
        opt.learning_rate = mx.array(cur_lr, dtype=mx.float32)
        b = mx.array(sampler.batch(bs))
        if aux is None:
            loss, gnorm = train_step(b)
        else:
            ub, um = aux.sample()
            loss, gnorm, extra = aux_step(b, mx.array(ub), mx.array(um))
            aux_losses.append(extra.item())
        mx.eval(loss, gnorm, state)
        step += 1
        tokens += bs * SEQ
        tok_win += bs * SEQ
        losses.append(loss.item())
        if bench:
            dt = time.time() - t_win
            print(f"step {step} loss {losses[-1]:.3f} {bs*SEQ*step/ (time.time()-t_start):.0f} tok/s (cum) "
                  f"dt {dt:.2f}s", flush=True)
            t_win = time.time()
            continue
        last_step = step == run_steps or (elapsed0 + time.time() - t_start - phase["elapsed0"]) >= budget
        if step % args.log_every == 0 or last_step:
            now = time.time()
            rec = {"step": step, "loss": float(np.mean(losses)), "lr": cur_lr,
                   "grad_norm": float(gnorm.item()), "tokens": tokens,
                   "tokens_per_s": tok_win / (now - t_win), "elapsed": elapsed0 + now - t_start,
                   "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))}
            if aux_losses:
                rec[aux.key] = float(np.mean(aux_losses))
            if step % args.eval_every == 0 or last_step:
                rec.update({f"val_{k}": v for k, v in evaluate().items()})
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(json.dumps(rec), flush=True)
            losses, aux_losses, t_win, tok_win = [], [], time.time(), 0
        if time.time() - t_last_ckpt > args.ckpt_minutes * 60 or last_step:
            _ckpt_save(run, model, opt, step, sampler, tokens, elapsed0 + time.time() - t_start, phase)
            t_last_ckpt = time.time()
    if bench:
        n = len(losses)
        warm = max(1, n // 3)
        print(f"BENCH {args.preset}: {bs*SEQ*(n-warm)/(time.time()-t_start):.0f} tok/s approx (incl. compile)")
    else:
        (run / "DONE").write_text(json.dumps({"step": step, "tokens": tokens}))
        print("done", flush=True)


# ----------------------------------------------------------------------------- export / eval / card

def cmd_export(args):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    P = PRESETS[args.preset]
    run, out = ROOT / P["run"], ROOT / (args.out or P["out"])
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((run / "config.json").read_text())
    model = build_model(cfg)
    model.load_weights(str(run / "ckpt" / "model.safetensors"))
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DATA / "tokenizer" / f, out / f)
    shutil.copy(run / "train_log.jsonl", out / "train_log.jsonl")
    print(f"exported {out}: {sum(p.stat().st_size for p in out.iterdir())/1e6:.1f} MB")


def cmd_interpolate(args):
    """--out folder's weights := a * --new + (1 - a) * --old (weight-space interpolation towards the
    starting point, as WiSE-FT); the rows of the tool tokens (prepare-tools) are --new's."""
    import mlx.core as mx

    a = args.alpha
    new = mx.load(str(Path(args.new) / "model.safetensors"))
    old = mx.load(str(Path(args.old) / "model.safetensors"))
    stats = DATA / "tools_stats.json"  # prepare-tools' new token rows (prepare-choice adds none)
    ids = [int(i) for i in json.loads(stats.read_text())["embed_init"]] if stats.exists() else []
    out = {}
    for k, v in new.items():
        w = a * v.astype(mx.float32) + (1 - a) * old[k].astype(mx.float32)
        if k == "model.embed_tokens.weight" and ids:  # the tool tokens' rows have no old meaning
            w[mx.array(ids)] = v.astype(mx.float32)[mx.array(ids)]
        out[k] = w.astype(mx.bfloat16)
    dest = ROOT / (args.out or PRESETS[args.preset]["out"])
    mx.save_safetensors(str(dest / "model.safetensors"), out, metadata={"format": "mlx"})
    print(f"{dest}: {a} x {args.new} + {1 - a:g} x {args.old}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["prepare", "prepare-tools", "prepare-choice", "bench", "train", "export", "interpolate",
                                    "evaluate", "card"])
    ap.add_argument("--preset", choices=list(PRESETS), default="target")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--new-phase", action="store_true",
                    help="with --resume: keep weights and AdamW state, restart the lr schedule "
                         "(warmup + cosine over --steps / --time-budget counted from the checkpoint)")
    ap.add_argument("--seq", type=int, default=SEQ, help="training sequence length")
    ap.add_argument("--p-gsm", type=float, default=P_GSM, help="share of sequences from GSM8K chat")
    ap.add_argument("--p-tools", type=float, default=P_TOOLS,
                    help="share of sequences from the tool-call conversations (prepare-tools)")
    ap.add_argument("--n-choice-gsm", type=int, default=800,
                    help="prepare-choice: how many GSM8K calculator conversations to keep (of ~7,000)")
    ap.add_argument("--init-from", default=None,
                    help="train (not --resume): start from this exported model folder's weights")
    ap.add_argument("--long-context", action="store_true",
                    help="train: YaRN RoPE scaling to 32k positions (rope_scaling in config.json)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="minutes of training (all resumes together); the cosine follows the larger "
                         "of step/steps and time/budget, and training stops when either is reached")
    ap.add_argument("--ul-data", action="append", default=None,
                    help="train: a response cache (train-drafter --generate-only) of this model's own "
                         "greedy outputs; adds sequence-level unlikelihood on the loops they fell into (repeat)")
    ap.add_argument("--ul-weight", type=float, default=1.0)
    ap.add_argument("--sft-weight", type=float, default=0.0,
                    help="train: add this weight x the loss of the call tokens of prepare-choice's call examples")
    ap.add_argument("--sft-batch", type=int, default=8, help="call examples a step (--sft-weight)")
    ap.add_argument("--ul-batch", type=int, default=8)
    ap.add_argument("--ul-ngram", type=int, default=0,
                    help="also penalize every token completing a repeated N-gram of an unfinished response")
    ap.add_argument("--ul-len", type=int, default=256, help="unlikelihood rows are cut/padded to this length")
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--ckpt-minutes", type=float, default=4.0)
    ap.add_argument("--bench-steps", type=int, default=8)
    ap.add_argument("--n-gsm", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out", default=None, help="export: the model folder (default: the preset's, e.g. models/target)")
    ap.add_argument("--alpha", type=float, default=0.8, help="interpolate: the share of --new")
    ap.add_argument("--new", default=None, help="interpolate: the exported model folder of the last phase")
    ap.add_argument("--old", default=None, help="interpolate: the exported model folder it started from")
    ap.add_argument("--note", default="", help="extra markdown line for the Training section of the card")
    ap.add_argument("--repro-cmd", default=None, help="train command line(s) to print in the card")
    ap.add_argument("--phase", action="append", default=None,
                    help="card: one training phase as END_STEP,SEQ,P_GSM,PEAK_LR,BATCH (repeat; END_STEP 0: the last step)")
    args = ap.parse_args(argv)
    globals().update(SEQ=args.seq, P_GSM=args.p_gsm, P_TOOLS=args.p_tools)
    {"prepare": cmd_prepare, "prepare-tools": cmd_prepare_tools,
     "prepare-choice": cmd_prepare_choice, "bench": lambda a: cmd_train(a, bench=True), "train": cmd_train,
     "export": cmd_export, "interpolate": cmd_interpolate, "evaluate": cmd_evaluate, "card": cmd_card}[args.cmd](args)

