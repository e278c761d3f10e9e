#!/usr/bin/env python
"""Train the embedded default models of mlx-dflash on CPU (tokenizer, data, model, export).

Sub-commands (run from the repository root, with PYTHONPATH=. so that
`mlx_dflash` -- which loads the fast OpenBLAS into mlx -- is importable):

  python scripts/train_target.py prepare                     # tokenizer + token streams -> runs/data/
  python scripts/train_target.py bench  --preset target      # tokens/s of a few steps
  python scripts/train_target.py train  --preset target --steps N [--resume]
  python scripts/train_target.py train  --preset target --resume --new-phase --ul-data RESPONSES.jsonl
                                          # + unlikelihood on the model's own greedy loops
  python scripts/train_target.py export --preset target      # -> models/target/
  python scripts/train_target.py evaluate --preset target    # generations, repetition rate
  python scripts/train_target.py card   --preset target      # README.md model card + loss curve

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
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# mlx-cpu elementwise ops are single-threaded; a 2-thread OpenBLAS only spins against them
# (and against other jobs on a small shared machine).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(ROOT))
import mlx_dflash  # noqa: E402,F401  (must precede mlx: loads OpenBLAS)
from mlx_dflash import fastblas  # noqa: E402

import numpy as np  # noqa: E402

GSM8K = Path("/work/shared/data/gsm8k/train.jsonl")
N_DEV = 473
DATA = ROOT / "runs" / "data"
VOCAB_SIZE = 4096  # 8192 doubles the (scalar-exp bound) softmax cost on mlx-cpu
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

PRESETS = {
    "target": dict(
        model=dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=96, intermediate_size=1024),
        lr=2e-3, batch=8, run="runs/target", out="models/target",
        title="mlx-dflash default target model"),
    "draft": dict(
        model=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=64, intermediate_size=1024),
        lr=3e-3, batch=8, run="runs/draft-ar", out="models/draft-ar",
        title="mlx-dflash classic autoregressive draft model"),
}
SEQ = 512
VAL_SEQ = 512  # fixed, so val losses stay comparable when --seq changes
P_GSM = 0.45  # share of training sequences drawn from the GSM8K chat stream


# ----------------------------------------------------------------------------- data

def gsm8k_rows():
    return [json.loads(l) for l in GSM8K.read_text().splitlines() if l.strip()]


def gsm8k_split():
    rows = gsm8k_rows()
    return rows[:-N_DEV], rows[-N_DEV:]


def write_gsm8k_dev(path: Path = DATA / "gsm8k_dev.jsonl") -> Path:
    """Deterministically (re)write the dev split: the last 473 problems of train.jsonl."""
    _, dev = gsm8k_split()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in dev:
            f.write(json.dumps({"messages": [{"role": "user", "content": r["question"]}],
                                "answer": r["answer"]}) + "\n")
    return path


def chat_text(q: str, a: str) -> str:
    return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n"


def stdlib_files():
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    seen, out = set(), []
    for d, dirs, files in os.walk(root):
        rel = Path(d).relative_to(root).parts
        if any(p in skip or p.startswith("config-") for p in rel):
            dirs[:] = []
            continue
        dirs.sort()
        for fn in sorted(files):
            if not fn.endswith(".py"):
                continue
            p = Path(d) / fn
            try:
                txt = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            h = hashlib.sha1(txt.encode()).hexdigest()
            if h in seen or len(txt) < 20:
                continue
            seen.add(h)
            out.append((str(p.relative_to(root)), txt))
    return out


def train_tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 2048,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "mask_token": "<|mask|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|mask|>"],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def cmd_prepare(args):
    DATA.mkdir(parents=True, exist_ok=True)
    write_gsm8k_dev()
    train_rows, _ = gsm8k_split()
    files = stdlib_files()
    rng = np.random.default_rng(0)
    val_idx = set(rng.choice(len(files), size=max(1, len(files) // 100), replace=False).tolist())
    code_train = [t for i, (_, t) in enumerate(files) if i not in val_idx]
    code_val = [t for i, (_, t) in enumerate(files) if i in val_idx]
    chats = [chat_text(r["question"], r["answer"]) for r in train_rows]
    print(f"stdlib files {len(files)} ({sum(len(t) for _, t in files)/1e6:.1f} MB), "
          f"gsm8k train {len(chats)}", flush=True)

    t0 = time.time()
    tok = train_tokenizer(code_train + chats)
    print(f"tokenizer trained in {time.time()-t0:.0f}s, vocab {tok.get_vocab_size()}", flush=True)
    tok_dir = DATA / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2))
    (tok_dir / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "mask_token": "<|mask|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|mask|>"]}, indent=2))

    for s in SPECIALS:
        assert len(tok.encode(s).ids) == 1, s
    sample = "def f(x):\n    return  x\t+ 1\n\n\nclass A:\n        pass\n"
    assert tok.decode(tok.encode(sample).ids, skip_special_tokens=False) == sample
    eot = tok.token_to_id("<|endoftext|>")

    def stream(texts):
        ids = []
        for enc in tok.encode_batch(texts):
            ids.extend(enc.ids)
            ids.append(eot)
        return np.array(ids, dtype=np.uint16)

    _, dev = gsm8k_split()
    streams = {
        "code_train": stream(code_train),
        "code_val": stream(code_val),
        "gsm_train": stream(chats),
        "gsm_dev": stream([chat_text(r["question"], r["answer"]) for r in dev]),
    }
    for k, v in streams.items():
        np.save(DATA / f"{k}.npy", v)
    stats = {k: int(v.size) for k, v in streams.items()}
    stats.update(n_stdlib_files=len(files), n_code_val_files=len(code_val),
                 n_gsm_train=len(chats), n_gsm_dev=len(dev),
                 stdlib=sysconfig.get_paths()["stdlib"], python=sys.version.split()[0])
    (DATA / "stats.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats, indent=2))


# ----------------------------------------------------------------------------- model

def model_config(preset: str) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DATA / "tokenizer" / "tokenizer.json"))
    cfg = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"],
               vocab_size=tok.get_vocab_size(), rms_norm_eps=1e-6,
               max_position_embeddings=2048, rope_theta=10000.0,
               tie_word_embeddings=True, hidden_act="silu",
               attention_bias=False, rope_scaling=None)
    cfg.update(PRESETS[preset]["model"])
    cfg["eos_token_id"] = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    cfg["pad_token_id"] = tok.token_to_id("<|endoftext|>")
    cfg["bos_token_id"] = None
    cfg["mask_token_id"] = tok.token_to_id("<|mask|>")
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def build_model(cfg):
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs.from_dict(cfg)
    return qwen3.Model(args)


def count_params(model):
    from mlx.utils import tree_flatten

    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    emb = model.model.embed_tokens.weight.size
    return total, total - emb


class Sampler:
    """Random windows of SEQ+1 tokens; a sequence comes from GSM8K chat w.p. P_GSM."""

    def __init__(self, seed: int):
        self.code = np.load(DATA / "code_train.npy")
        self.gsm = np.load(DATA / "gsm_train.npy")
        self.rng = np.random.default_rng(seed)

    def batch(self, bs: int):
        out = np.empty((bs, SEQ + 1), dtype=np.int32)
        for i in range(bs):
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

    ul_data = None
    if args.ul_data:  # MLE on the training text + unlikelihood on the model's own loops
        ul_data = unlikelihood_rows(args.ul_data, cfg["pad_token_id"], args.ul_len, args.ul_ngram)
        print(f"unlikelihood: {len(ul_data[0])} looping responses, "
              f"{int(ul_data[1].sum())} penalized tokens, weight {args.ul_weight}", flush=True)
        if not len(ul_data[0]):
            raise SystemExit("--ul-data: no response fell into a loop; nothing to train on")
        ul_rng = np.random.default_rng(args.seed + 1)

        def mixed_loss(m, x, y, ux, uy, um):
            ce = loss_fn(m, x, y)
            ul = unlikelihood_loss(m(ux).astype(mx.float32), uy, um)
            return ce + args.ul_weight * ul, (ce, ul)

        @partial(mx.compile, inputs=state, outputs=state)
        def ul_step(batch, ub, um):
            (_, (ce, ul)), grads = nn.value_and_grad(model, mixed_loss)(
                model, batch[:, :-1], batch[:, 1:], ub[:, :-1], ub[:, 1:], um)
            grads, gnorm = optim.clip_grad_norm(grads, 1.0)
            opt.update(model, grads)
            return ce, gnorm, ul

    # not mx.compile'd: a compiled closure would freeze the weights it first saw as constants
    def eval_loss(batch):
        return loss_fn(model, batch[:, :-1], batch[:, 1:])

    vals = {"gsm_dev": val_batches("gsm_dev", 8, 3), "code_val": val_batches("code_val", 8, 3)}

    def evaluate():
        return {k: float(np.mean([eval_loss(mx.array(b)).item() for b in bl])) for k, bl in vals.items()}

    log = open(run / "train_log.jsonl", "a") if not bench else None
    t_start = time.time()
    t_last_ckpt = t_start
    t_win, tok_win = time.time(), 0
    run_steps = args.bench_steps if bench else steps
    losses, ul_losses = [], []
    run_steps += phase["step0"] if not bench else 0
    while step < run_steps:
        el = elapsed0 + time.time() - t_start
        if not bench and el - phase["elapsed0"] >= budget:
            print(f"time budget of {args.time_budget} min reached at step {step}", flush=True)
            break
        cur_lr = lr_at(step, el)
        opt.learning_rate = mx.array(cur_lr, dtype=mx.float32)
        b = mx.array(sampler.batch(bs))
        if ul_data is None:
            loss, gnorm = train_step(b)
        else:
            pick = ul_rng.integers(0, len(ul_data[0]), size=args.ul_batch)
            loss, gnorm, ul = ul_step(b, mx.array(ul_data[0][pick]), mx.array(ul_data[1][pick]))
            ul_losses.append(ul.item())
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
            if ul_losses:
                rec["ul_loss"] = float(np.mean(ul_losses))
            if step % args.eval_every == 0 or last_step:
                rec.update({f"val_{k}": v for k, v in evaluate().items()})
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(json.dumps(rec), flush=True)
            losses, ul_losses, t_win, tok_win = [], [], time.time(), 0
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


def repeated_ngram_loop(ids, window=64, n=8):
    """True iff the last `window` generated tokens contain some 8-gram twice."""
    tail = list(ids[-window:])
    seen = set()
    for i in range(len(tail) - n + 1):
        g = tuple(tail[i:i + n])
        if g in seen:
            return True
        seen.add(g)
    return False


def stuck_in_loop(ids, finished, window=48, max_period=24):
    """True iff the output never ended (hit max tokens) and its last `window` tokens are
    one cycle of at most `max_period` tokens repeated exactly: decoding that fell into a
    loop and would never stop. (The 8-gram measure above also counts the repeated phrases
    of a finished GSM8K answer, which gold answers have too.)"""
    return not finished and loop_region(list(ids), max_period, window) is not None


def loop_region(ids, max_period=24, min_len=48):
    """(start, period) of the exact periodic tail of `ids` -- the loop a response fell into --
    or None when its tail is not one cycle of at most `max_period` tokens repeated over at
    least `min_len` tokens. The earliest start over all periods wins."""
    n, best = len(ids), None
    for p in range(1, max_period + 1):
        j = n - p  # ids[i] == ids[i + p] for every i >= j
        while j > 0 and ids[j - 1] == ids[j - 1 + p]:
            j -= 1
        if n - j >= max(min_len, 2 * p) and (best is None or j < best[0]):
            best = (j, p)
    return best


def repeat_positions(ids, n):
    """Indices t at which ids[t-n+1..t] is an n-gram seen earlier in ids."""
    seen, out = set(), []
    for t in range(n - 1, len(ids)):
        g = tuple(ids[t - n + 1:t + 1])
        if g in seen:
            out.append(t)
        seen.add(g)
    return out


def unlikelihood_rows(paths, pad_id, max_len, ngram=0):
    """Sequence-level unlikelihood data (Welleck et al. 2019, "Neural text generation with
    unlikelihood training"): the model's own greedy responses that never ended and fell into
    a loop. Each row is (prompt + response ids, mask over next-token targets): the mask marks
    every token that repeats an earlier cycle of the loop, whose probability the loss pushes
    down; with `ngram` > 0 also every token that completes a repeated n-gram of the response
    (near-loops whose cycles differ a little). Rows are cut to `max_len` tokens (the first
    penalized token kept in view) and padded."""
    xs, ms = [], []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            if r.get("finish") != "length":
                continue
            resp, off = r["response"], len(r["prompt"])
            marked = set(repeat_positions(resp, ngram)) if ngram else set()
            loop = loop_region(resp)
            if loop is not None:
                marked.update(range(loop[0] + loop[1], len(resp)))  # the tokens that copy the cycle
            if not marked:
                continue
            ids = r["prompt"] + resp
            start = off + min(marked)
            cut = max(0, min(start - max_len // 2, len(ids) - max_len - 1))
            ids = ids[cut:cut + max_len + 1]
            mask = [0.0] * (len(ids) - 1)
            for t in marked:
                if 1 <= off + t - cut < len(ids):
                    mask[off + t - cut - 1] = 1.0  # target position t-1 predicts ids[t]
            pad = max_len + 1 - len(ids)
            xs.append(ids + [pad_id] * pad)
            ms.append(mask + [0.0] * pad)
    return np.array(xs, dtype=np.int32).reshape(-1, max_len + 1), np.array(ms, dtype=np.float32).reshape(-1, max_len)


def unlikelihood_loss(logits, y, mask):
    """mean over masked targets of -log(1 - p(target))."""
    import mlx.core as mx

    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = mx.exp(mx.take_along_axis(logp, y[..., None], axis=-1)[..., 0])
    ul = -mx.log(mx.maximum(1.0 - p, 1e-5))
    return (ul * mask).sum() / mx.maximum(mask.sum(), 1.0)


def cmd_evaluate(args):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    P = PRESETS[args.preset]
    out = ROOT / P["out"]
    model, tok = load(str(out))
    # check the tokenizer contract
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
    txt = "def f(x):\n    if x:\n\treturn  x + 1\n\n# done\n"
    assert tok.decode(tok.encode(txt, add_special_tokens=False)) == txt
    greedy = make_sampler(temp=0.0)
    dev = [json.loads(l) for l in write_gsm8k_dev().read_text().splitlines()]
    results = {"gsm8k": [], "python": []}
    py_prompts = ["def fibonacci(n):", "import os\n\n\ndef list_files(path):",
                  "class Stack:\n    def __init__(self):", "def is_prime(n):",
                  "def read_json(path):\n    \"\"\"Read a JSON file.\"\"\"",
                  "import re\n\n\ndef tokenize(text):", "def binary_search(items, target):",
                  "class Point:\n    \"\"\"A 2D point.\"\"\"\n\n    def __init__(self, x, y):",
                  "def _quote(s):", "    def __repr__(self):"]
    chat_example = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)

    def greedy_ids(prompt):  # -> (generated ids, ended by eos)
        ids, finish = [], None
        for r in stream_generate(model, tok, prompt, max_tokens=args.max_tokens, sampler=greedy):
            finish = r.finish_reason
            if finish != "stop":  # the eos token is not part of the output
                ids.append(r.token)
        return ids, finish == "stop"

    def dump():  # written after every prompt, so a slow/killed run still leaves partial results
        summ = {}
        for k, rs in results.items():
            if rs:
                summ[k] = {"n": len(rs), "loop_rate": float(np.mean([r["loop"] for r in rs])),
                           "stuck_rate": float(np.mean([r["stuck"] for r in rs])),
                           "mean_tokens": float(np.mean([r["n_tokens"] for r in rs]))}
        if results["gsm8k"]:
            summ["gsm8k"]["has_final_rate"] = float(np.mean([r["has_final"] for r in results["gsm8k"]]))
            summ["gsm8k"]["accuracy"] = float(np.mean([r["correct"] for r in results["gsm8k"]]))
        res = {"summary": summ, "max_tokens": args.max_tokens, "chat_prompt_example": chat_example,
               "complete": len(results["gsm8k"]) == args.n_gsm and len(results["python"]) == len(py_prompts),
               "results": results}
        (ROOT / P["run"] / "eval.json").write_text(json.dumps(res, indent=2))
        return summ

    # interleave the two sets so that partial results cover both
    order, py_left = [], list(py_prompts)
    for i, r in enumerate(dev[:args.n_gsm]):
        order.append(("gsm", r))
        if i % 3 == 2 and py_left:
            order.append(("py", py_left.pop(0)))
    order += [("py", p) for p in py_left]
    for kind, item in order:
        t0 = time.time()
        if kind == "gsm":
            r = item
            p = tok.apply_chat_template(r["messages"], add_generation_prompt=True)
            ids, ended = greedy_ids(p)
            text = tok.decode(ids)
            gold = r["answer"].split("####")[-1].strip()
            pred = text.split("####")[-1].strip().split("\n")[0].strip() if "####" in text else None
            results["gsm8k"].append({"question": r["messages"][0]["content"], "output": text,
                                     "n_tokens": len(ids), "has_final": "####" in text,
                                     "correct": pred == gold, "gold": gold,
                                     "loop": repeated_ngram_loop(ids), "ended": ended,
                                     "stuck": stuck_in_loop(ids, ended), "s": time.time() - t0})
        else:
            ids, ended = greedy_ids(tok.encode(item, add_special_tokens=False))
            text = tok.decode(ids)
            results["python"].append({"prompt": item, "output": text, "n_tokens": len(ids),
                                      "loop": repeated_ngram_loop(ids), "ended": ended,
                                      "stuck": stuck_in_loop(ids, ended), "s": time.time() - t0})
        summ = dump()
    print(json.dumps(summ, indent=2))
    for r in results["gsm8k"][:3] + results["python"][:3]:
        print("-----", r.get("question", r.get("prompt")))
        print(r["output"])


def cmd_card(args):
    P = PRESETS[args.preset]
    run, out = ROOT / P["run"], ROOT / P["out"]
    cfg = json.loads((out / "config.json").read_text())
    log = [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines() if l.strip()]
    ev_path = run / "eval.json"
    ev = json.loads(ev_path.read_text()) if ev_path.exists() else {
        "summary": {}, "max_tokens": 0, "results": {"gsm8k": [], "python": []}, "complete": False}
    stats = json.loads((DATA / "stats.json").read_text())
    model = build_model(cfg)
    total, non_emb = count_params(model)
    last = log[-1]
    lastval = [r for r in log if "val_gsm_dev" in r][-1]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in log], [r["loss"] for r in log], label="train", lw=1)
        ev_r = [r for r in log if "val_gsm_dev" in r]
        ax.plot([r["step"] for r in ev_r], [r["val_gsm_dev"] for r in ev_r], "o-", label="val gsm8k dev (chat)")
        ax.plot([r["step"] for r in ev_r], [r["val_code_val"] for r in ev_r], "s-", label="val stdlib (held-out files)")
        ax.set_xlabel("step"); ax.set_ylabel("cross-entropy (nats/token)"); ax.set_ylim(0, 6)
        ax.grid(alpha=.3); ax.legend(); ax.set_title(P["title"])
        fig.tight_layout(); fig.savefig(out / "loss.png", dpi=80)
        curve = "![loss curve](loss.png)\n"
    except ImportError:
        curve = "(matplotlib not installed: no plot)\n"
    s = ev["summary"]
    from tokenizers import Tokenizer

    _tk = Tokenizer.from_file(str(out / "tokenizer.json"))
    _dev = [json.loads(l) for l in write_gsm8k_dev().read_text().splitlines()]
    gold_loop = float(np.mean([repeated_ngram_loop(_tk.encode(d["answer"]).ids) for d in _dev]))
    rows = []
    stuck = lambda g: f"{g['stuck_rate']:.0%}" if "stuck_rate" in g else "n/a"  # noqa: E731  (older evals)
    if "gsm8k" in s:
        g = s["gsm8k"]
        rows.append(f"| GSM8K dev (chat) | {g['n']} | {stuck(g)} | {g['loop_rate']:.0%} | {g['mean_tokens']:.0f} | "
                    f"ends with `#### N`: {g['has_final_rate']:.0%}, exact answer: {g['accuracy']:.0%} |")
    if "python" in s:
        g = s["python"]
        rows.append(f"| Python (raw) | {g['n']} | {stuck(g)} | {g['loop_rate']:.0%} | {g['mean_tokens']:.0f} | |")
    partial = "" if ev.get("complete", True) else (
        "\n**Partial:** the evaluation was still running (CPU starved by other jobs) when this card "
        "was written; rerun `evaluate` then `card` to complete it.\n")
    tps = np.median([r["tokens_per_s"] for r in log])
    model_keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
                  "rope_theta", "tie_word_embeddings")
    arch = "\n".join(f"| {k} | {cfg[k]} |" for k in model_keys)
    steps = last["step"]
    samples = []
    for r in ev["results"]["gsm8k"][:3]:
        samples.append(f"**GSM8K dev** (chat template, greedy) -- question: {r['question']}\n\n"
                       f"```text\n{r['output']}\n```\n(gold: {r['gold']}, stuck: {r.get('stuck')}, 8-gram repeat: {r['loop']})\n")
    for r in ev["results"]["python"][:3]:
        samples.append(f"**Python** (raw prompt, greedy)\n\n```python\n{r['prompt']}{r['output']}\n```\n"
                       f"(stuck: {r.get('stuck')}, 8-gram repeat: {r['loop']})\n")
    pre = "--preset " + args.preset
    loop_txt = " and".join(f" on {round(s[k]['stuck_rate'] * s[k]['n'])} of {s[k]['n']} {name} prompts"
                           for k, name in (("gsm8k", "GSM8K dev"), ("python", "Python")) if "stuck_rate" in s.get(k, {}))
    # training phases (warm restarts): end step, sequence length, GSM8K share, peak lr, batch
    phases = [dict(zip(("end", "seq", "p_gsm", "lr", "batch"), map(float, ph.split(","))))
              for ph in (args.phase or [f"{steps},{SEQ},{P_GSM},{args.lr or P['lr']},{args.batch or P['batch']}"])]
    ph_rows, gsm_tok, code_tok, prev_step, prev_tok = [], 0.0, 0.0, 0, 0
    for i, ph in enumerate(phases):
        end = int(ph["end"]) if ph["end"] > 0 else steps
        tok_end = next((r["tokens"] for r in log if r["step"] >= end), last["tokens"])
        n = tok_end - prev_tok
        gsm_tok += n * ph["p_gsm"]
        code_tok += n * (1 - ph["p_gsm"])
        ph_rows.append(f"| {i + 1} | {prev_step}-{end} | {n:,} | {int(ph['batch'])}×{int(ph['seq'])} | "
                       f"{ph['p_gsm']:.0%} | {ph['lr']:g} |")
        prev_step, prev_tok = end, tok_end
    phase_table = ("| phase | steps | tokens | batch × seq | GSM8K share | peak lr |\n|---|---|---|---|---|---|\n"
                   + "\n".join(ph_rows))
    lines = f"""# {P['title']}

A tiny Qwen3-architecture (`model_type: qwen3`, mlx-lm format) causal language
model trained from scratch on CPU for mlx-dflash, so the project ships a
self-contained model {'pair' if args.preset == 'target' else 'family'} with no download. It is a heavily
under-trained toy ({last['tokens']/1e6:.1f}M tokens on 2 shared CPU cores): it has learned the *format* of
GSM8K answers (`<<calc>>` lines ending in `#### N`, then `<|im_end|>`) and the layout of Python
source, but its content is mostly wrong, and greedy decoding fell into an endless loop{loop_txt} (see Quality check). Weights: `model.safetensors` (bfloat16, tied
embeddings), tokenizer shared by `models/target` and `models/draft-ar`.

## Architecture

| field | value |
|---|---|
{arch}

Parameters: **{total:,}** total ({non_emb:,} non-embedding; the LM head is tied to the embedding).

## Tokenizer

Byte-level BPE (HF `tokenizers`), vocab {cfg['vocab_size']}, trained on the training text below
(never on the GSM8K dev split). Special tokens: `<|endoftext|>` (id {cfg['pad_token_id']}, pad / document
separator), `<|im_start|>`, `<|im_end|>` (eos), `<|mask|>` (id {cfg['mask_token_id']}, the DFlash mask token).
ChatML chat template (`<|im_start|>role\\ncontent<|im_end|>\\n`; `add_generation_prompt`
appends `<|im_start|>assistant\\n`). `eos_token_id` in config.json = {cfg['eos_token_id']}
(`<|im_end|>`, `<|endoftext|>`). Decoding round-trips spaces, tabs, newlines.

## Data (real text only)

* Python {stats['python']} standard library `.py` sources (`sysconfig.get_paths()['stdlib']`; skipping
  `test`/`tests`, `idlelib`, `lib2to3`, `site-packages`; deduplicated by content):
  {stats['n_stdlib_files']} files, {stats['code_train']:,} training tokens
  ({stats['n_code_val_files']} files / {stats['code_val']:,} tokens held out for validation).
* GSM8K train (`/work/shared/data/gsm8k/train.jsonl`) as ChatML chat: user = question,
  assistant = worked answer including the `<<calc>>` annotations and the final `#### N` line:
  {stats['n_gsm_train']} problems, {stats['gsm_train']:,} tokens. The **last {N_DEV} problems of train.jsonl are the
  dev split** (regenerated deterministically by `write_gsm8k_dev()` into `runs/data/gsm8k_dev.jsonl`):
  never trained on, not used for the tokenizer.
* Documents are packed with `<|endoftext|>` separators into one token stream per source;
  each training sequence (seq+1 tokens) is a random window from the GSM8K stream with
  the phase's GSM8K share as probability and from the stdlib stream otherwise (phases
  under Training): ≈{gsm_tok/stats['gsm_train']:.1f} epochs of GSM8K chat and ≈{code_tok/stats['code_train']:.1f} of the stdlib in all.

## Training

float32, AdamW (β=(0.9, 0.95), weight decay 0.1), linear warmup then cosine decay to 5% of
the phase's peak lr, grad-norm clip 1.0, `mx.compile`d step, mlx {__import__('mlx.core').core.__version__} on CPU
with OpenBLAS (2 shared x86-64 cores). A later phase is a warm restart from the previous
phase's last checkpoint (weights and AdamW state kept; `train --resume --new-phase`).

{phase_table}

* steps: **{steps}**, tokens seen: **{last['tokens']:,}**, wall time {last['elapsed']/60:.0f} min,
  median throughput {tps:.0f} tokens/s
* final train loss (mean over the last {args.log_every} steps): **{last['loss']:.3f}**;
  validation loss at step {lastval['step']}: GSM8K dev chat **{lastval['val_gsm_dev']:.3f}**,
  held-out stdlib **{lastval['val_code_val']:.3f}** (nats/token)
* full metrics: `train_log.jsonl` (step, loss, lr, grad_norm, tokens, tokens_per_s, elapsed, val_*;
  `loss` is the mean over the {args.log_every} steps since the previous record; val_* = mean loss on
  3 batches of {VAL_SEQ}-token windows of the GSM8K dev chats / held-out stdlib files)
{args.note + chr(10) if args.note else ''}
{curve}
## Quality check

Greedy decoding with `mlx_lm.stream_generate` (max {ev['max_tokens']} new tokens) on the first
{args.n_gsm} GSM8K dev questions (chat template) and 10 raw Python prompts (`evaluate`, results in
`{P['run']}/eval.json`).
{partial}
**Stuck rate** := share of outputs that never end (max new tokens reached, no `<|im_end|>`)
and whose last 48 tokens are one cycle of at most 24 tokens repeated exactly: decoding
fell into a loop. **8-gram repeat rate** := share of outputs whose last 64 generated tokens
(or all of them if fewer) contain some token 8-gram at least twice; stricter, it also counts
the repeated phrases of a finished answer (the gold GSM8K dev answers score {gold_loop:.1%}).
Raw Python prompts have no natural end, so every Python output runs to the limit.

| set | n | stuck rate | 8-gram repeat rate | mean new tokens | other |
|---|---|---|---|---|---|
{chr(10).join(rows)}

### Sample outputs

""" + "\n".join(samples) + f"""

## Reproduce

From the repository root (Linux, CPU; `mlx[cpu]`, `mlx-lm`, `tokenizers`, `scipy-openblas32`,
`matplotlib`; `PYTHONPATH=.` so the script loads the OpenBLAS shim before mlx):

```bash
export PYTHONPATH=.
python scripts/train_target.py prepare
{args.repro_cmd or f'python scripts/train_target.py train {pre} --steps {steps}'}
python scripts/train_target.py export {pre}
python scripts/train_target.py evaluate {pre}
python scripts/train_target.py card {pre}{' --repro-cmd "..."' if args.repro_cmd else ''}
```

A killed run continues with the same `train` command plus `--resume` (weights, AdamW
state, step and the data-sampler RNG are checkpointed every few minutes to `{P['run']}/ckpt`).
"""
    (out / "README.md").write_text(lines)
    print(f"wrote {out/'README.md'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["prepare", "bench", "train", "export", "evaluate", "card"])
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
    ap.add_argument("--time-budget", type=float, default=None,
                    help="minutes of training (all resumes together); the cosine follows the larger "
                         "of step/steps and time/budget, and training stops when either is reached")
    ap.add_argument("--ul-data", action="append", default=None,
                    help="train: a response cache (train-drafter --generate-only) of this model's own "
                         "greedy outputs; adds sequence-level unlikelihood on the loops they fell into (repeat)")
    ap.add_argument("--ul-weight", type=float, default=1.0)
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
    ap.add_argument("--note", default="", help="extra markdown line for the Training section of the card")
    ap.add_argument("--repro-cmd", default=None, help="train command line(s) to print in the card")
    ap.add_argument("--phase", action="append", default=None,
                    help="card: one training phase as END_STEP,SEQ,P_GSM,PEAK_LR,BATCH (repeat; END_STEP 0: the last step)")
    args = ap.parse_args()
    globals().update(SEQ=args.seq, P_GSM=args.p_gsm)
    {"prepare": cmd_prepare, "bench": lambda a: cmd_train(a, bench=True), "train": cmd_train,
     "export": cmd_export, "evaluate": cmd_evaluate, "card": cmd_card}[args.cmd](args)


if __name__ == "__main__":
    main()
