"""What the batch engine's tests share (test_batch, test_batch_lookup,
test_batch_prompt_cache, test_processors_verify): the prompts (and prompts that
repeat themselves, for lookup), tiny models by family, per-row oracle drafters
(by position, or by whole sequence for rows from cached prefixes), a guard over
a made-up cost curve and the target that keeps the clock out of it, drivers
that join and cancel rows, and the checks of sampled rows against plain sampling."""

import random
from collections import Counter

import mlx.core as mx
import numpy as np
from drafters import DrafterDouble, reference_tokens
from mlx_lm.models.cache import KVCache
from tiny_families import build

from mlx_dflash import DecodeConfig, generate
from mlx_dflash.cache.prompt_cache import PromptCache
from mlx_dflash.drafting.drafter import Proposal
from mlx_dflash.engine.batch import BatchEngine
from mlx_dflash.policy.costs import CostModel, Costs, Observed
from mlx_dflash.policy.fixed import FixedWidth
from mlx_dflash.policy.guard import Guard
from mlx_dflash.target.adapter import Target

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:", "Natalia sold clips to 48 of her friends in April",
    "import os\n", "class Stack:\n    def push(self, x):", "Janet's ducks lay 16 eggs per day. She eats",
    "for line in open(path):\n    line = line.strip()",
]
# KV; KV + sliding windows (all wrap); bfloat16 (mlx-cpu's own matmuls, not BLAS); 4-bit weights
_models = {}


def model_of(family):
    if family not in _models:
        base, _, kind = family.partition(":")
        _models[family] = build(base, dtype=mx.bfloat16 if kind == "bf16" else None,
                                bits=4 if kind == "q4" else 0)
    return _models[family]


def batch_guard(costs, prior=None, verify=None):
    """The guard over a fixed cost curve: a cycle of width w costs costs[w] plain
    steps at any batch size (verify[w] without the drafter's forward). An engine
    that runs it takes an Unclocked target: the curve is made up, so what this
    machine's clock says the cycles paid must not raise it."""
    v = verify or costs
    curve = Costs(1.0, dict(v), {w: costs[w] - v[w] for w in costs})
    return Guard(CostModel(lambda at: curve, sorted(costs)), Observed(p=list(prior)) if prior else None)


class Unclocked(Target):
    """A target whose steps report no wall-clock time, as a split target's
    (Target.clocked): a guard then decides from its curve alone, whatever the
    machine's load (prices as paid would otherwise move a test's decisions)."""

    clocked = False


class _Cfg:
    def __init__(self, layer_ids):
        self.target_layer_ids = list(layer_ids)
        self.mask_token_id = 0


class RowOracles(DrafterDouble):
    """One oracle per row (rows take their plans in the order they join): drafts
    right for a random-length prefix of each block, then wrong, so each row
    accepts a random 0..w-1 drafts per cycle, independently of the others."""

    version = 1

    def __init__(self, plans, vocab=512, block_size=16, seed=0, layer_ids=(0, 2)):
        self.plans = list(plans)  # (prompt length, the row's greedy continuation)
        self.of = {}
        self.rng = random.Random(seed)
        self.vocab, self.block_size, self.config = vocab, block_size, _Cfg(layer_ids)
        self.right = self.tried = 0

    def make_cache(self, window=None, sink=0):
        c = KVCache()
        self.of[id(c)] = self.plans.pop(0)
        return [c]

    def position(self, new_feats, cache):
        """(the row's position in its continuation, the continuation), after
        taking the new rows into its context as a real drafter does."""
        if new_feats is not None:  # the context length, as a real drafter's
            n = new_feats.shape[1]
            cache[0].update_and_fetch(mx.zeros((1, 1, n, 1)), mx.zeros((1, 1, n, 1)))
        plen, cont = self.of[id(cache[0])]
        return cache[0].offset - plen, cont

    def propose(self, target, anchor, new_feats, cache, width, temperature=0.0, key=None):
        pos, cont = self.position(new_feats, cache)
        assert cont[pos] == anchor, "oracle out of sync with the batch"
        k = self.rng.randrange(width)  # drafts right before the first wrong one
        out = []
        for j in range(1, width):
            true = cont[pos + j] if pos + j < len(cont) else 0
            out.append(true if j - 1 < k else (true + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab)
        self.tried += 1
        self.right += k
        return Proposal(out, None, [1.0] * len(out))


class WrongDrafter(RowOracles):
    """Every draft wrong (token 1): acceptance 0, the guard must stop drafting."""

    def make_cache(self, window=None, sink=0):
        return [KVCache()]

    def propose(self, target, anchor, new_feats, cache, width, temperature=0.0, key=None):
        self.tried += 1
        return Proposal([1] * (width - 1), None, [1.0] * (width - 1))


def run_engine(engine, requests, join_after=3, cancel=None):
    """Submit the first half now and the rest after `join_after` steps (they join
    a running batch); `cancel` = (request index, after how many of its tokens).
    Returns {request index: token ids (EOS excluded)}, {index: last response}."""
    eos = set(engine.tokenizer.eos_token_ids) if engine.tokenizer is not None else set()
    half = (len(requests) + 1) // 2
    uid = {}
    for i, (p, cfg) in enumerate(requests[:half]):
        uid[engine.submit(p, cfg)] = i
    out = {i: [] for i in range(len(requests))}
    last = {}
    steps = 0
    while len(engine) or len(uid) < len(requests):
        if steps == join_after:
            for i, (p, cfg) in enumerate(requests[half:], half):
                uid[engine.submit(p, cfg)] = i
        for u, r in engine.step():
            i = uid[u]
            if not (r.finish_reason == "stop" and r.token in eos):
                out[i].append(r.token)
            last[i] = r
            if cancel is not None and cancel[0] == i and len(out[i]) == cancel[1]:
                engine.cancel(u)
        steps += 1
    return out, last


def like_plain_sampling(model, tok, prompt, streams, **options) -> tuple:
    """(chi-square p-value, outcomes seen): the joint law of the 3 tokens of each
    sampled stream vs as many plain samples alone (temperature 1.5, top-k 3;
    `options`: more of the plain samples' decode options, e.g. logits_processors)."""
    from scipy.stats import chi2_contingency

    streams = list(streams)
    spec = Counter(tuple(v) for v in streams)
    plain = Counter(tuple(generate(model, tok, prompt, None, seed=s, verify_mode="off", max_tokens=3,
                                   temperature=1.5, top_k=3, **options).token_ids) for s in range(len(streams)))
    keys = sorted(set(plain) | set(spec))
    table = np.array([[plain[k] + 0.5 for k in keys], [spec[k] + 0.5 for k in keys]])
    return chi2_contingency(table).pvalue, len(keys)


def sampled_rows(model, tok, prompt, block, n, seed, **options):
    """n rows of a batch sampling 3 tokens of `prompt` (temperature 1.5, top-k 3,
    `options`), each drafting `block` (a fixed proposal) every cycle at width 3.
    Returns (each row's tokens, drafter proposals made, drafts accepted)."""

    class Fixed(RowOracles):
        def make_cache(self, window=None, sink=0):
            return [KVCache()]

        def propose(self, target, anchor, new_feats, cache, width, temperature=0.0, key=None):
            self.tried += 1
            return Proposal(block[1:width], None, [1.0] * (width - 1))

    drafter = Fixed([])
    eng = BatchEngine(model, tok, drafter, max_batch=8, policy=FixedWidth(3))
    uids = [eng.submit(prompt, DecodeConfig(max_tokens=3, temperature=1.5, top_k=3, seed=seed + s, **options))
            for s in range(n)]
    got = {u: [] for u in uids}
    accepted = 0
    for u, r in eng.run():
        got[u].append(r.token)
        if r.finish_reason:
            accepted += r.stats.accepted
    return list(got.values()), drafter.tried, accepted


class SeqOracles(RowOracles):
    """Plans are whole sequences (prompt + continuation), positions the drafter
    context's length: a row that continues a cached drafter context is bound to
    its new sequence with `bind`."""

    def bind(self, pc: PromptCache, seq):
        self.of[id(pc.drafter[0])] = (0, list(seq))


def run_rows(eng, first, later, steps_before=2):
    """Submit `first` [(prompt, max_tokens, prompt cache or None)], step
    `steps_before` times, submit `later` (joining the running batch); run to
    the end. Returns ({uid: token ids}, {uid: last response}, [uids in order])."""
    eos = set(eng.tokenizer.eos_token_ids)
    uids = [eng.submit(p, DecodeConfig(max_tokens=m), prompt_cache=pc) for p, m, pc in first]
    out, last, steps = {}, {}, 0
    while len(eng) or steps <= steps_before:
        if steps == steps_before:
            uids += [eng.submit(p, DecodeConfig(max_tokens=m), prompt_cache=pc) for p, m, pc in later]
        for u, r in eng.step():
            if not (r.finish_reason == "stop" and r.token in eos):
                out.setdefault(u, []).append(r.token)
            last[u] = r
        steps += 1
    return out, last, uids


REPEATED = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    PROMPTS[1],
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(",
    PROMPTS[4],
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,",
]
ORDINARY = (1, 4)  # the others repeat a passage
MAXES = [28, 14, 30, 9, 22, 18]  # rows leave at different cycles
_prompts = {}


def prompts_for(family, tok):
    """Token-id prompts: the ordinary ones, and each repetitive one followed by
    the model's own continuation and the passage again, so its next tokens
    repeat what the context holds (a random tiny model copies little else)."""
    if family not in _prompts:
        model = model_of(family)
        out = []
        for i, p in enumerate(REPEATED):
            ids = tok.encode(p)
            out.append(ids if i in ORDINARY else ids + reference_tokens(model, tok, ids, 24) + ids)
        _prompts[family] = out
    return _prompts[family]
