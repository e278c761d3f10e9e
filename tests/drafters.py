"""Test drafters with the `propose` interface of mlx_dflash.drafting.drafter.Drafter, and
the mlx-lm reference they are checked against."""

import random
import time

from mlx_lm.models.cache import KVCache

from mlx_dflash.drafting.drafter import Proposal
from mlx_dflash.drafting.proposers import propose_rows


# prompts the policy tests decode (test_adaptive, test_guard)
PROMPTS = ["def fibonacci(n):", "Natalia sold clips to 48 of her friends", "import os\nimport sys\n",
           "class Stack:\n    def push(self, x):", "The answer is", "while True:"]


class DrafterDouble:
    """What the engine asks of a drafter besides `propose` (drafting/drafter.Drafter's
    interface): `propose_batch`, here one row at a time through `propose`."""

    def propose_batch(self, target, anchors, feats, caches, width, temperatures, keys):
        return propose_rows(self, target, anchors, feats, caches, width, temperatures, keys)


class _Cfg:
    def __init__(self, layer_ids, mask_id=0):
        self.target_layer_ids = layer_ids
        self.mask_token_id = mask_id


class OracleDrafter(DrafterDouble):
    """Proposes the target's own greedy continuation (known in advance), each
    draft corrupted with probability `noise` (noise=1: always wrong). `delay`:
    seconds each proposal takes, as a real drafter's forward does."""

    version = 1

    def __init__(self, prompt_len, continuation, vocab, block_size=16, noise=0.0, seed=0, layer_ids=(0,), delay=0.0):
        self.prompt_len = prompt_len
        self.delay, self.proposed = delay, 0
        self.cont = list(continuation)
        self.vocab = vocab
        self.block_size = block_size
        self.noise = noise
        self.rng = random.Random(seed)
        self.config = _Cfg(list(layer_ids))

    def make_cache(self, window=None, sink=0):  # (a bounded context changes nothing here)
        return [KVCache()]

    def propose(self, target, anchor, new_feats, cache, width, temperature=0.0, key=None):
        import mlx.core as mx

        if new_feats is not None:  # track the context length like a real drafter
            n = new_feats.shape[1]
            cache[0].update_and_fetch(mx.zeros((1, 1, n, 1)), mx.zeros((1, 1, n, 1)))
        pos = cache[0].offset - self.prompt_len  # index of the anchor in the continuation
        assert self.cont[pos] == anchor, "oracle out of sync with the decode loop"
        time.sleep(self.delay)
        self.proposed += 1
        out = []
        for k in range(1, width):
            true = self.cont[pos + k] if pos + k < len(self.cont) else 0
            wrong = self.rng.random() < self.noise
            out.append((true + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab if wrong else true)
        return Proposal(out, None, [1.0] * len(out))


class FixedDrafter(OracleDrafter):
    """Always proposes the same tokens, whatever the anchor (for sampling tests)."""

    def __init__(self, tokens, block_size=16):
        super().__init__(0, [], 0, block_size)
        self.tokens = list(tokens)
        self.proposed = 0

    def propose(self, target, anchor, new_feats, cache, width, temperature=0.0, key=None):
        self.proposed += 1
        return Proposal(self.tokens[: width - 1], None, [1.0] * (width - 1))


def reference_tokens(model, tok, prompt, max_tokens=24):
    """Token ids of mlx-lm's own `stream_generate` (EOS excluded): the reference."""
    import mlx_lm

    out = []
    for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=max_tokens):
        if r.finish_reason == "stop" and r.token in tok.eos_token_ids:
            break
        out.append(r.token)
    return out


class PrefixOracle(OracleDrafter):
    """Right for a random-length prefix of each block, then wrong: every cycle
    accepts a random 0..w-1 drafts, so rollback runs at every position. `log`
    keeps (width, right prefix length) per proposal, for the expected tau."""

    def __init__(self, prompt_len, continuation, vocab, block_size=16, seed=0, layer_ids=(0,)):
        super().__init__(prompt_len, continuation, vocab, block_size, 0.0, seed, layer_ids)
        self.log = []

    def propose(self, target, anchor, new_feats, cache, width, temperature=0.0, key=None):
        prop = super().propose(target, anchor, new_feats, cache, width, temperature)
        k = self.rng.randrange(width)  # drafts right before the first wrong one
        out = list(prop.tokens)
        if k < len(out):
            out[k] = (out[k] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
        self.log.append((width, k))
        return Proposal(out, None, [1.0] * len(out))
