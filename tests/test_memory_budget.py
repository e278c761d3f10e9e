"""mlx_dflash.cache.memory: what a request costs (measured per model, every cache
kind) and the server's one memory budget: admit, wait, spill, refuse in one line."""

import threading
import time

import mlx.core as mx
import pytest
from pair_server import DiskCatalog

from mlx_dflash import generate, load
from mlx_dflash.cache import memory
from mlx_dflash.cache.memory import Footprint, MemoryBudget, Refused, footprint
from mlx_dflash.cache.prompt_cache import PromptCache
from mlx_dflash.cache.prompt_store import cache_bytes

pytestmark = pytest.mark.timeout(600)
MB = 1 << 20


@pytest.fixture(scope="module")
def pair(pairs):
    d = pairs()
    return load(str(d / "target"), str(d / "drafter"))


def test_the_footprint_is_the_caches_and_bounds_what_a_request_takes(pair):
    model, tok, drafter = pair
    fp = footprint(model, drafter)
    a = model.args
    item = model.model.embed_tokens.weight.dtype.size
    assert fp.per_token == a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim * item
    assert fp.fixed == 0 and fp.feature == len(drafter.config.target_layer_ids) * a.hidden_size * item
    for n in (300, 1500):
        ids = [(i * 37) % 500 + 4 for i in range(n)]
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        pc = PromptCache()
        generate(model, tok, ids, drafter, max_tokens=32, prompt_cache=pc, drafter_window=None)
        peak = mx.get_peak_memory() - before
        proj = fp.project(n, 32, window=None)
        assert cache_bytes(pc) <= proj and peak <= proj <= 4 * peak, (n, peak, proj)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3_text"])
def test_states_that_do_not_grow_are_fixed(family):
    from tiny_families import build

    fp = footprint(build(family))
    assert fp.fixed > 0 and fp.per_token > 0  # recurrent state / a full sliding window; the global layers grow


class FakeStore:
    def __init__(self, nbytes):
        self.nbytes, self.disk, self.spilled = nbytes, None, []

    def spill(self, n):
        freed = min(n, self.nbytes)
        self.nbytes -= freed
        self.spilled.append(freed)
        return freed


def budget(limit_mb, store=None, wait_s=5.0):
    fp = Footprint(per_token=MB, fixed=0, feature=0, drafter_row=0, transient=0)
    return MemoryBudget(limit_mb * MB, fp, base=100 * MB, store=lambda: store, wait_s=wait_s)


def test_admit_release_and_the_store_spills_before_anything_waits():
    store = FakeStore(300 * MB)
    b = budget(1024, store)  # 1 GiB: base 100 MiB, slack 64 MiB, store 300 MiB
    b.admit("a", b.project(200, 200))  # 400 MiB: fits beside the store
    assert store.spilled == [] and b.summary()["running"] == 1
    b.admit("b", 300 * MB)  # only with the store spilled to disk (what it needs, no more)
    assert store.spilled == [140 * MB] and store.nbytes == 160 * MB
    assert b.committed() <= b.limit
    b.release("a")
    b.release("a")  # twice: no-op
    assert b.summary()["running"] == 1 and b.summary()["reserved"] == 300 * MB


def test_a_request_that_cannot_fit_now_waits_for_others():
    b = budget(1024, FakeStore(0))
    b.admit("a", 700 * MB)
    got = []
    t = threading.Thread(target=lambda: (b.admit("b", 500 * MB), got.append(time.monotonic())))
    t.start()
    time.sleep(0.3)
    assert not got  # waiting
    released = time.monotonic()
    b.release("a")
    t.join(5)
    assert got and got[0] >= released and b.summary()["waited"] >= 1


def test_refusals_are_one_line_and_say_why():
    b = budget(1024, FakeStore(0), wait_s=0.2)
    with pytest.raises(Refused) as e:  # can never fit: 413 at once
        b.admit("huge", 2000 * MB, " (1900 prompt tokens + max_tokens 100)")
    assert e.value.status == 413 and "\n" not in e.value.message
    assert "lower max_tokens" in e.value.message and "memory_budget_gb" in e.value.message
    b.admit("a", 700 * MB)
    with pytest.raises(Refused) as e:  # could fit, but not within the wait: 429
        b.admit("b", 500 * MB)
    assert e.value.status == 429 and "retry later" in e.value.message
    assert b.summary()["refused_413"] == b.summary()["refused_429"] == 1


def test_a_finished_request_that_overfills_the_store_spills_it():
    store = FakeStore(0)
    b = budget(1024, store)
    b.admit("a", 500 * MB)
    store.nbytes = 900 * MB  # its cache went to the store
    b.release("a")
    assert b.committed() <= b.limit and store.spilled


def test_the_server_refuses_what_cannot_fit_in_one_line(pairs, tmp_path, monkeypatch):
    import httpx
    from scripted import LocalServer

    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(memory, "rss", lambda: 100 * MB)  # this test process's other memory is not the server's
    cat = DiskCatalog(pairs())
    cat.g.memory_budget_gb = 0.2
    with LocalServer(cat, model="pair") as srv:
        def ask(text):
            return httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
                "model": "pair", "messages": [{"role": "user", "content": text}], "max_tokens": 8})

        ok = ask("Tell me about lists.")
        big = ask("lists and dicts " * 300)  # ~2.7k tokens: its prefill's attention scores alone exceed the room
        m = httpx.get(srv.url + "/metrics").json()["memory"]
    assert ok.status_code == 200
    assert big.status_code == 413 and "\n" not in big.json()["error"]["message"]
    assert big.json()["error"]["code"] == "memory_budget" and "memory_budget_gb" in big.json()["error"]["message"]
    assert m["limit"] == int(0.2e9) and m["refused_413"] == 1 and m["running"] == 0 and m["peak"] <= m["limit"]


def test_the_store_holds_only_the_room_running_requests_leave():
    from mlx_dflash.cache.prompt_store import PromptStore

    store = PromptStore(1 << 30)
    b = budget(1024, store)
    b.admit("a", 700 * MB)
    assert store.room == (1024 - 100 - 64 - 700) * MB  # what admission leaves it
    b.release("a")
    assert store.room == (1024 - 100 - 64) * MB
