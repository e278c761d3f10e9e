"""One rank of tests/test_distributed.py, started by `mlx.launch` (or with
MLX_RANK / MLX_HOSTFILE set by the test): tiny random-weight targets from
mlx-lm's ModelArgs, split over the group, decoded by the distributed session;
each rank writes what it decoded (and the single-process reference, computed
in the same process before the split) to OUT/rank{R}.json.

    python tests/dist_ranks.py OUT lossless
    python tests/dist_ranks.py OUT families  (more cache kinds: recurrent, sliding windows, MoE)
    python tests/dist_ranks.py OUT kill      (rank 1 dies mid-generation)
"""

import json
import os
import random
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx_dflash  # noqa: E402,F401  (fast BLAS before mlx)
import mlx.core as mx  # noqa: E402
from make_test_pair import make_drafter  # noqa: E402
from tiny_families import config, build  # noqa: E402

from mlx_dflash.engine.decode_config import DecodeConfig  # noqa: E402
from mlx_dflash.engine.decoder import Decoder  # noqa: E402
from mlx_dflash.engine.distributed import Leader, Session, follow, lost_rank, split_model, world  # noqa: E402
from mlx_dflash.drafting.drafter import Proposal  # noqa: E402
from mlx_dflash.cache.prompt_cache import PromptCache  # noqa: E402
from mlx_dflash.engine.calibrate import Calibration  # noqa: E402
from drafters import DrafterDouble  # noqa: E402

# (family, split, config overrides): kv heads divisible by the two ranks for tensor parallelism
CASES = [("qwen3", "tensor", dict(num_key_value_heads=2)), ("qwen2", "pipeline", {})]
WIDTHS = (1, 5, 8)
MAX_TOKENS = 20
TAPS = [1, 2]  # one layer on each pipeline stage (rank 1 holds 0-1, rank 0 holds 2-3)


class Mixed(DrafterDouble):
    """A real random DFlash drafter whose first k drafts of each block are
    replaced by the target's known continuation (k random, seeded): its drafts
    depend on the features it receives, and every cycle accepts a different
    number, so rollback runs at every position. Logs a checksum of the
    features it receives and its own drafts."""

    def __init__(self, real, prompt_len, cont, seed=0):
        self.real, self.prompt_len, self.cont = real, prompt_len, (list(cont) if cont is not None else None)
        self.block_size, self.config, self.version = real.block_size, real.config, real.config.version
        self.rng = random.Random(seed)
        self.seen = 0
        self.log = []

    def make_cache(self, *a, **kw):
        return self.real.make_cache(*a, **kw)

    def propose(self, target, anchor, new_feats, cache, width, temperature=0.0, key=None):
        p = self.real.propose(target, anchor, new_feats, cache, width, temperature)
        if new_feats is not None:
            self.seen += new_feats.shape[1]
            fsum = float(new_feats.astype(mx.float32).sum().item())
        else:
            fsum = None
        own = p.tokens.tolist()
        self.log.append([fsum, own])
        if self.cont is None:
            return p
        pos = self.seen - self.prompt_len
        k = self.rng.randrange(width)
        right = [t for t in self.cont[pos + 1: pos + 1 + k]]
        toks = mx.concatenate([mx.array(right, mx.int32), p.tokens[len(right):].astype(mx.int32)])
        return Proposal(toks, p.q, p.conf)


def progress(group, what):
    """One line per finished case on stderr (what a timed-out test shows)."""
    print(f"rank {group.rank()}: {what} done", file=sys.stderr, flush=True)


def model_and_drafter(family, over, version):
    cfg = config(family, **over)
    model = build(family, seed=0, dtype=mx.float32, **over)
    drafter = make_drafter(Path(os.environ.get("TMPDIR", "/tmp")) / f"dist-drafter-{family}-{os.getpid()}", cfg, 4,
                           version=version, block_size=8, seed=3, n_taps=len(TAPS))
    drafter.config.target_layer_ids = list(TAPS)
    drafter.set_dtype(mx.float32)
    return model, drafter


def prompts(vocab):
    rng = random.Random(11)
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in (9, 23)]


def run_one(session_or_model, drafter, ids, cfg, split=None):
    if split is None:
        dec = Decoder(session_or_model, None, drafter, cfg, PromptCache(), Calibration())
        out = [(r.token, r.from_draft) for r in dec.run(ids)]
        return [t for t, _ in out], [s for _, s in out], None
    toks, src, last = session_or_model.generate(ids, cfg)
    return toks, src, last.stats.distributed


def lossless(out: Path, group):
    res = {}
    for family, how, over in CASES:
        ref_model, d_ref = model_and_drafter(family, over, version=1)
        model, d = model_and_drafter(family, over, version=1)
        split = split_model(model, group, how, seed=5)
        sess = Session(model, None, None, split)
        for pi, ids in enumerate(prompts(ref_model.args.vocab_size)):
            plain, _, _ = run_one(ref_model, None, ids, DecodeConfig(max_tokens=MAX_TOKENS, verify_mode="off"))
            for w in WIDTHS if pi == 0 else ():  # (the second prompt: the guard only, to keep CI fast)
                key = f"{family}/{how}/p{pi}/w{w}"
                cfg = DecodeConfig(max_tokens=MAX_TOKENS, block_size=w, guard=False)
                one = Mixed(d_ref, len(ids), plain, seed=w)
                t1, s1, _ = run_one(ref_model, one, ids, cfg)
                sess.drafter = many = Mixed(d, len(ids), plain, seed=w)
                t2, s2, info = run_one(sess, many, ids, cfg, split)
                res[key] = dict(plain=plain, single=t1, single_src=s1, single_log=one.log, split=t2, split_src=s2,
                                split_log=many.log, info=info)
                progress(group, key)
            # the guard (default width): costs measured by all ranks together, rank 0's shared
            sess.drafter = Mixed(d, len(ids), plain, seed=1)
            t2, s2, info = run_one(sess, sess.drafter, ids, DecodeConfig(max_tokens=MAX_TOKENS), split)
            res[f"{family}/{how}/p{pi}/guard"] = dict(plain=plain, split=t2, split_src=s2, info=info)
            progress(group, f"{family}/{how}/p{pi}/guard")
        # sampled, DFlash 2 drafter (its selector samples too): same seed, same tokens on every rank
        _, d2 = model_and_drafter(family, over, version=2)
        sess.drafter = Mixed(d2, 0, None)
        ids = prompts(ref_model.args.vocab_size)[0]
        cfg = DecodeConfig(max_tokens=MAX_TOKENS, block_size=5, guard=False, temperature=0.9, seed=42)
        t2, s2, info = run_one(sess, sess.drafter, ids, cfg, split)
        # unseeded: the generator every rank was seeded with at the split
        t3, s3, _ = run_one(sess, sess.drafter, ids, DecodeConfig(max_tokens=MAX_TOKENS, block_size=5, guard=False,
                                                                   temperature=0.9), split)
        res[f"{family}/{how}/sampled"] = dict(split=t2, split_src=s2, unseeded=t3, unseeded_src=s3,
                                              split_log=sess.drafter.log, info=info)
        progress(group, f"{family}/{how}/sampled")
        res[f"{family}/{how}/served"] = served(sess, d, ref_model, group)
        progress(group, f"{family}/{how}/served")
    (out / f"rank{group.rank()}.json").write_text(json.dumps(res))


def served(sess, d, ref_model, group) -> dict:
    """Requests as a server takes them: rank 0 leads (its reader stops one
    request early), the others follow; then every rank decodes one more prompt
    directly, which only works if the ranks are still in step."""
    a, b = prompts(ref_model.args.vocab_size)
    plain = {i: run_one(ref_model, None, p, DecodeConfig(max_tokens=MAX_TOKENS, verify_mode="off"))[0]
             for i, p in enumerate((a, b))}
    sess.drafter = d
    cfg = DecodeConfig(max_tokens=MAX_TOKENS, block_size=5, guard=False)
    out = {"plain": plain[1]}
    if group.rank() == 0:
        lead = Leader(sess)
        early = []
        for r in lead.stream(a, cfg):
            early.append(r.token)
            if len(early) == 3:
                break  # a client that left: rank 0 still runs the rest with the others
        out["early"] = early
        out["served"] = [r.token for r in lead.stream(b, cfg)]
        lead.close()
    else:
        out["followed"] = follow(sess)
    out["after"] = sess.generate(b, cfg)[0]
    return out


# more cache kinds, split: recurrent state (qwen3_next: gated delta), sliding windows that wrap
# (ministral3), sliding windows + MoE under tensor parallelism (gpt_oss)
MORE = [("qwen3_next", "pipeline", {}), ("ministral3", "pipeline", {}),
        ("gpt_oss", "tensor", dict(num_key_value_heads=2))]


def families(out: Path, group):
    """Greedy DFlash on the split target vs plain decoding in one process, widths 5 and 8."""
    res = {}
    for family, how, over in MORE:
        ref_model, _ = model_and_drafter(family, over, version=1)
        model, d = model_and_drafter(family, over, version=1)
        sess = Session(model, None, None, split_model(model, group, how, seed=5), measure=False)
        ids = prompts(ref_model.args.vocab_size)[1]
        plain, _, _ = run_one(ref_model, None, ids, DecodeConfig(max_tokens=MAX_TOKENS, verify_mode="off"))
        for w in (5, 8):
            sess.drafter = Mixed(d, len(ids), plain, seed=w)
            t, src, _ = run_one(sess, sess.drafter, ids, DecodeConfig(max_tokens=MAX_TOKENS, block_size=w,
                                                                      guard=False), sess.split)
            res[f"{family}/{how}/w{w}"] = dict(plain=plain, split=t, split_src=src)
    (out / f"rank{group.rank()}.json").write_text(json.dumps(res))


def kill(out: Path, group):
    family, how, over = CASES[0]
    model, d = model_and_drafter(family, over, version=1)
    split = split_model(model, group, how, seed=5)
    sess = Session(model, None, d, split, measure=False)
    ids = prompts(model.args.vocab_size)[0]
    cfg = DecodeConfig(max_tokens=100000, block_size=5, guard=False)
    (out / f"ready{group.rank()}").write_text("1")
    for i, r in enumerate(sess.stream(ids, cfg)):
        if group.rank() == 1 and i == 30:
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    out, what = Path(sys.argv[1]), sys.argv[2]
    group = world()
    if group is None:
        sys.exit("dist_ranks.py: run under mlx.launch with two ranks")
    try:
        {"lossless": lossless, "families": families, "kill": kill}[what](out, group)
    except RuntimeError as e:
        why = lost_rank(e, group)
        if why is None:
            raise
        sys.stderr.write(f"mlx-dflash: error: {why}\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
