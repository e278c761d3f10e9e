"""mlx_dflash.cache.prompt_store: several cached prefixes across conversations, with
the test pair (tiny random target + DFlash drafter) through the real engine.
A warm run must give exactly the tokens of a cold one; the budget only costs speed."""

import mlx.core as mx
import pytest
from pair_server import N, SYSTEM, W, PairCatalog, prompt

from mlx_dflash import generate
from mlx_dflash import load
from mlx_dflash.cache.prompt_store import PromptStore, cache_bytes, tokens_of
from mlx_dflash.target.adapter import Target

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pair(pairs):
    d = pairs()
    model, tok, drafter = load(str(d / "target"), str(d / "drafter"))
    return model, tok, drafter


def run(store, pair, ids):
    """What the server's worker does: take a private cache, generate, give it back."""
    model, tok, drafter = pair
    target = Target(model)
    pc, n = store.take(target, ids, drafter, True)
    r = generate(model, tok, ids, drafter, max_tokens=N, block_size=W, prompt_cache=pc)
    assert r.stats.reused_tokens == n  # the engine kept what the store matched
    store.put(pc, target)
    return r


def cold(pair, ids):
    model, tok, drafter = pair
    return generate(model, tok, ids, drafter, max_tokens=N, block_size=W)


@pytest.mark.slow
def test_second_conversation_reuses_the_system_prompt(pair):
    tok = pair[1]
    store = PromptStore(1 << 30)
    a, b = prompt(tok, "How do I list files?"), prompt(tok, "What is a tuple?")
    first = run(store, pair, a)
    assert first.stats.reused_tokens == 0 and first.token_ids == cold(pair, a).token_ids
    second = run(store, pair, b)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert 0 < second.stats.reused_tokens <= shared
    assert second.stats.reused_tokens >= shared - 16  # all but the drafter-context lag
    assert second.token_ids == cold(pair, b).token_ids
    assert second.stats.mode == "dflash"


@pytest.mark.slow
def test_branches_and_continuations_match_cold_runs(pair):
    tok = pair[1]
    store = PromptStore(1 << 30)
    convs = {"a": ["Explain lists."], "b": ["Explain dicts."], "c": ["Explain sets."]}
    for rnd in range(2):
        for k, turns in convs.items():
            ids = prompt(tok, *turns)
            r = run(store, pair, ids)
            assert r.token_ids == cold(pair, ids).token_ids, (k, rnd)
            if rnd:  # a continuation: its whole earlier prompt was cached
                assert r.stats.reused_tokens > len(prompt(tok, *turns[:1])) - 16
            turns += [r.text, f"And more about {k}?"]
    assert store.stats.hits >= 5 and store.nbytes <= store.budget


def test_entries_are_independent_copies(pair):
    tok = pair[1]
    store = PromptStore(1 << 30)
    a = prompt(tok, "One question.")
    run(store, pair, a)
    [(pc, _)] = store.entries.values()
    before_tokens = list(pc.tokens)
    before = [mx.array(c.keys) for c in pc.target] + [mx.array(c.keys) for c in pc.drafter]
    mx.eval(before)
    b = prompt(tok, "A different one.")  # a partial match: served from a copy
    target = Target(pair[0])
    copy, n = store.take(target, b, pair[2], True)
    assert 0 < n < len(pc.tokens) and copy is not pc and copy.target[0] is not pc.target[0]
    generate(pair[0], tok, b, pair[2], max_tokens=N, block_size=W, prompt_cache=copy)
    after = [c.keys for c in pc.target] + [c.keys for c in pc.drafter]
    assert pc.tokens == before_tokens
    assert all(mx.array_equal(x, y).item() for x, y in zip(before, after))
    assert run(store, pair, a).token_ids == cold(pair, a).token_ids


@pytest.mark.slow
def test_small_budget_evicts_and_loses_nothing_but_speed(pair):
    tok = pair[1]
    probe = PromptStore(1 << 30)
    run(probe, pair, prompt(tok, "Size me."))
    one = cache_bytes(next(iter(probe.entries.values()))[0])
    store = PromptStore(int(one * 1.5))  # room for one entry
    prompts = [prompt(tok, q) for q in ("First?", "Second?", "Third?")]
    for ids in prompts + prompts:
        assert run(store, pair, ids).token_ids == cold(pair, ids).token_ids
        assert store.nbytes <= store.budget and len(store) == 1
    assert store.stats.evictions > 0
    none = PromptStore(0)  # a zero budget keeps nothing
    for ids in prompts:
        r = run(none, pair, ids)
        assert r.stats.reused_tokens == 0 and r.token_ids == cold(pair, ids).token_ids
    assert len(none) == 0 and tokens_of(none) == []


def test_longest_prefix_wins_and_prefix_entries_merge(pair):
    tok = pair[1]
    store = PromptStore(1 << 30)
    short = prompt(tok, "Hi.", system="Short system.")
    other = prompt(tok, "Hi.")
    run(store, pair, other)
    run(store, pair, short)
    assert len(store) == 2
    target = Target(pair[0])
    key, n = store.match(target, other + [5, 6], pair[2], True)
    ent = store.entries[key][0]
    assert ent.tokens[: len(other)] == other and n >= len(other)  # the entry sharing the most
    # a continuation of all the entry can give takes it over (no copy) and comes back longer
    cont = ent.tokens[: store.usable(ent, pair[2], True)] + [5, 6]
    pc, n = store.take(target, cont, pair[2], True)
    assert pc is ent and len(store) == 1
    generate(pair[0], tok, cont, pair[2], max_tokens=N, block_size=W, prompt_cache=pc)
    store.put(pc, target)
    assert len(store) == 2 and max(len(t) for t in tokens_of(store)) > len(cont)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "lfm2"])
def test_hybrid_target_reuses_only_full_prefixes(pair, family):
    """Recurrent layers cannot drop tokens after the fact: an entry serves a new
    prompt only when all its tokens start it, and then exactly like a cold run."""
    from tiny_families import build

    model, tok = build(family), pair[1]
    target = Target(model)
    store = PromptStore(1 << 30)
    a = [(i * 37 + 11) % 500 + 4 for i in range(40)]

    def go(ids):
        pc, n = store.take(target, ids, None, False)
        r = generate(model, tok, ids, None, max_tokens=N, prompt_cache=pc)
        assert r.stats.reused_tokens == n
        store.put(pc, target)
        return r, generate(model, tok, ids, None, max_tokens=N)

    first, cold_a = go(a)
    assert first.token_ids == cold_a.token_ids
    [(ent, _)] = store.entries.values()
    branch = a[:30] + [7, 8, 9]  # shares 30 tokens, but the entry cannot be cut back to them
    r, c = go(branch)
    assert r.stats.reused_tokens == 0 and r.token_ids == c.token_ids
    cont = list(ent.tokens) + [5, 6, 7]  # the whole entry starts this one
    r, c = go(cont)
    assert r.stats.reused_tokens == len(cont) - 3 and r.token_ids == c.token_ids


def ask_server(catalog, questions):
    """Each question (after the SYSTEM prompt) through HTTP to a server on `catalog`,
    greedy: (the responses, the server's worker)."""
    import openai
    from scripted import LocalServer

    with LocalServer(catalog, model="pair") as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        return [c.chat.completions.create(model="pair", temperature=0, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in questions], srv.worker


@pytest.mark.server
@pytest.mark.slow
def test_server_small_budget_same_text_as_big(pairs):
    """Through HTTP: a budget that holds one conversation gives the same text as
    one that holds all of them; it only reuses less."""
    def serve(budget):
        rs, worker = ask_server(PairCatalog(pairs(), budget),
                                ("Tell me about lists.", "Tell me about dicts.", "Tell me about lists.", "And sets?"))
        return [(r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens) for r in rs], worker.store

    big, store = serve(1 << 30)
    one = max(b for _, b in store.entries.values())
    small, store = serve(int(one * 1.5))  # room for about one conversation
    assert store.stats.evictions > 0 and len(store) == 1
    assert [t for t, _ in small] == [t for t, _ in big]
    assert all(n > 0 for _, n in big[1:])  # the shared system prompt, at least
    assert big[2][1] > small[2][1]  # the repeated question is all cached only with room for it


def test_hybrid_target_with_drafter(pair, tmp_path):
    """DFlash on a recurrent hybrid (qwen3_5): the drafter's context (rows and
    pending features) covers the whole entry, so a continuation reuses all of it."""
    from make_test_pair import make_drafter
    from tiny_families import build, config

    model, tok = build("qwen3_5"), pair[1]
    cfg = config("qwen3_5")
    drafter = make_drafter(tmp_path, cfg.get("text_config", cfg), 3, block_size=8)
    target = Target(model)
    store = PromptStore(1 << 30)

    def go(ids):
        pc, n = store.take(target, ids, drafter, True)
        r = generate(model, tok, ids, drafter, max_tokens=N, block_size=W, prompt_cache=pc)
        store.put(pc, target)
        assert r.stats.mode == "dflash" and r.stats.reused_tokens == n
        assert r.token_ids == generate(model, tok, ids, drafter, max_tokens=N, block_size=W).token_ids
        return n

    a = [(i * 37 + 11) % 500 + 4 for i in range(40)]
    assert go(a) == 0
    [(ent, _)] = store.entries.values()
    cont = list(ent.tokens) + [5, 6, 7]
    assert go(a[:30] + [7, 8]) == 0  # a branch: the recurrent state cannot go back to token 30
    assert go(cont) == len(cont) - 3


class HybridCatalog(PairCatalog):
    """A tiny recurrent hybrid (qwen3_5) with a DFlash drafter, the test pair's tokenizer."""

    def __init__(self, folder, tmp):
        super().__init__(folder, 1 << 30)
        self.tmp = tmp

    def load(self, model_id):
        from types import SimpleNamespace

        from make_test_pair import make_drafter
        from tiny_families import build, config

        _, tok, _ = load(str(self.folder / "target"))
        cfg = config("qwen3_5")
        drafter = make_drafter(self.tmp, cfg.get("text_config", cfg), 3, block_size=8)
        return SimpleNamespace(id="pair", model=build("qwen3_5"), tokenizer=tok, drafter=drafter,
                               settings=self.settings_)


@pytest.mark.server
@pytest.mark.slow
def test_server_hybrid_branch_checkpoint(pairs, tmp_path):
    """Recurrent targets cannot cut a cached conversation back to a shared system
    prompt: the second conversation caches the branch point, the third starts there."""
    rs, worker = ask_server(HybridCatalog(pairs(), tmp_path),
                            ("First question?", "Second question?", "Third question?", "Second question?"))
    out = [(r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens,
            r.model_dump()["dflash"]["mode"]) for r in rs]
    lm = worker.lm
    tok = lm.tokenizer
    p1, p2, p3 = (prompt(tok, q) for q in ("First question?", "Second question?", "Third question?"))
    common = lambda a, b: next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # noqa: E731
    branch = common(p1, p2)  # the system prompt and the start of the user turn
    assert branch > 100
    assert [n for _, n, _, _ in out[:2]] == [0, 0]  # nothing reusable yet: the 2nd caches the branch point
    assert out[2][1] == min(branch, common(p3, p2)) and out[3][1] >= branch
    assert all(m == "dflash" for *_, m in out)
    for (text, *_), q in zip(out, ("First question?", "Second question?", "Third question?", "Second question?")):
        ids = prompt(tok, q)
        cold = generate(lm.model, tok, ids, lm.drafter, max_tokens=N, block_size=W)
        assert text == cold.text
