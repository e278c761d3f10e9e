"""The prompt store's disk tier (mlx_dflash.cache.disk): prefixes that outlive the
process, shared blocks, every cache kind, and every fault (killed writer,
truncated or corrupt files, a full disk, a read-only folder, another version),
each served with exactly the tokens of a cold run."""

import errno
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, QuantizedKVCache, RotatingKVCache

from mlx_dflash import generate, load
from mlx_dflash.cache import disk_format
from mlx_dflash.cache.disk import DiskTier
from mlx_dflash.cache.disk_folder import folders
from mlx_dflash.cache.identity import digest, identity
from mlx_dflash.cache.prompt_store import PromptStore
from mlx_dflash.target.adapter import Target
from pair_server import N, SYSTEM, W, DiskCatalog, prompt
from tiers import fast_first

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parent.parent
BLOCK = 32  # small blocks: short prompts span several


@pytest.fixture(scope="module")
def pair(pairs):
    d = pairs()
    return load(str(d / "target"), str(d / "drafter"))


def store_of(model, tok, drafter, root, budget=1 << 30, mem=1 << 30):
    """A fresh store over the disk folder `root`: what a new process has."""
    return PromptStore(mem, DiskTier(root, identity(model, tok, drafter), budget, block=BLOCK))


def run(store, model, tok, drafter, ids, **kw):
    """What the server's worker does: take, generate, give back. (result, matched, origin)."""
    target = Target(model)
    with_drafter = drafter is not None and kw.get("verify_mode") != "off"
    pc, n = store.take(target, ids, drafter, with_drafter)
    origin = dict(pc.origin) if pc.origin else None
    r = generate(model, tok, ids, drafter, max_tokens=N, prompt_cache=pc, **kw)
    assert r.stats.reused_tokens == n  # the engine kept what the store matched
    store.put(pc, target)
    assert store.close(timeout=60)
    return r, n, origin


def cold(model, tok, drafter, ids, **kw):
    return generate(model, tok, ids, drafter, max_tokens=N, **kw).token_ids


def files(root, sub):
    return sorted(p for p in Path(root).rglob(f"{sub}/*") if p.is_file() and not p.name.startswith("."))


# -- what survives a restart ---------------------------------------------------------------

def test_a_restart_serves_the_prompt_from_disk(pair, tmp_path):
    model, tok, drafter = pair
    a = prompt(tok, "How do I list files?")
    r1, n1, _ = run(store_of(*pair, tmp_path), *pair, a, block_size=W)
    assert n1 == 0 and r1.token_ids == cold(*pair, a, block_size=W)
    again = store_of(*pair, tmp_path)  # a new process
    r2, n2, origin = run(again, *pair, a, block_size=W)
    assert n2 == len(a) - 1 and origin["tier"] == "disk" and origin["bytes"] > 0
    assert r2.token_ids == r1.token_ids and r2.stats.prompt_cache["tier"] == "disk"
    # the conversation goes on in a third process: its whole first turn is on disk
    cont = prompt(tok, "How do I list files?", r1.text, "And hidden ones?")
    r3, n3, origin = run(store_of(*pair, tmp_path), *pair, cont, block_size=W)
    assert origin["tier"] == "disk" and n3 >= len(a) - 16  # all but the drafter-context lag
    assert r3.token_ids == cold(*pair, cont, block_size=W)
    s = again.summary()["disk"]
    assert s["hits"] == 1 and s["loaded_tokens"] == len(a) - 1 and s["bytes_read"] > 0 and s["load_time"] > 0


def test_the_server_engine_is_out_of_mlx_before_the_process_exits(pair, tmp_path):
    """Shutting down, the server waits until no thread is inside MLX (Python's
    exit with one there aborts the process, rc -6): the engine's thread has
    handed back a row its client left and parked (it never ends: an MLX thread
    ending at exit aborts too), and the prompt store has written that row's
    prefix to disk, where a new process finds it."""
    from types import SimpleNamespace

    from app.server.engines import LocalEngine
    from mlx_dflash import DecodeConfig

    model, tok, drafter = pair
    eng = LocalEngine(SimpleNamespace(model=model, tokenizer=tok, drafter=drafter, id="tiny"), max_batch=2,
                      store=store_of(*pair, tmp_path))
    a = prompt(tok, "How do I list files?")
    stream = eng.stream(a, DecodeConfig(max_tokens=200))
    next(stream), next(stream)
    stream.close()  # the client left: its row is cancelled, handed back and stored
    assert eng.quiesce(120) and eng.parked.is_set()
    _, n, origin = run(store_of(*pair, tmp_path), *pair, a, block_size=W)  # a new process
    assert origin["tier"] == "disk" and n >= len(a) - BLOCK


@pytest.mark.slow
def test_a_new_session_finds_its_instructions_in_shared_blocks(pair, tmp_path):
    """Two conversations with one system prompt: its blocks are stored once, and
    after a restart a third conversation (a new first message) starts from them."""
    model, tok, drafter = pair
    a, b, c = (prompt(tok, q) for q in ("How do I list files?", "What is a tuple?", "Explain sets."))
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared > 3 * BLOCK
    for ids in (a, b):
        run(store_of(*pair, tmp_path), *pair, ids, block_size=W)
    entries, blocks = files(tmp_path, "entries"), files(tmp_path, "blocks")
    full = lambda ids: (len(ids) + N) // BLOCK  # noqa: E731  (full blocks of an entry, roughly)
    assert len(entries) == 2 and len(blocks) < full(a) + full(b) - shared // BLOCK + 2
    r, n, origin = run(store_of(*pair, tmp_path), *pair, c, block_size=W)
    assert origin["tier"] == "disk" and shared - 16 <= n <= shared
    assert r.token_ids == cold(*pair, c, block_size=W)


def test_nothing_is_reused_across_models_dtypes_drafters_or_templates(pair, pairs):
    model, tok, drafter = pair
    base = digest(identity(model, tok, drafter))
    m2, t2, d2 = load(str(pairs() / "target"), str(pairs() / "drafter"))
    assert digest(identity(m2, t2, d2)) == base  # the same files loaded again: the same folder
    other = pairs(seed=1)
    m3, t3, d3 = load(str(other / "target"), str(other / "drafter"))
    assert digest(identity(m3, tok, drafter)) != base  # another checkpoint of one architecture
    assert digest(identity(model, tok, d3)) != base  # another drafter
    assert digest(identity(model, tok, None)) != base  # none
    m2.set_dtype(mx.float16)
    assert digest(identity(m2, tok, drafter)) != base  # another dtype
    t2._tokenizer.chat_template = "{{ messages }}"
    assert digest(identity(model, t2, drafter)) != base  # another chat template


# -- every cache kind -----------------------------------------------------------------------

def _tiny(family, tmp_path, with_drafter):
    from make_test_pair import make_drafter
    from tiny_families import build, config

    model = build(family)
    cfg = config(family)
    d = make_drafter(tmp_path / "d", cfg.get("text_config", cfg), 3, block_size=8) if with_drafter else None
    return model, d


@pytest.mark.parametrize("case", fast_first(["quantized_kv", "unbounded_drafter", "gemma3_text", "qwen3_5", "lfm2",
                                             "qwen3_5_drafter"]))
def test_every_cache_kind_comes_back_exactly(pair, tmp_path, case):
    """Quantized KV, the drafter's unbounded context, a wrapped sliding window,
    recurrent states (gated delta, short conv), a hybrid with a drafter: an entry
    written by one process continues in another exactly like a cold run."""
    _, tok, _ = pair
    kw = dict(block_size=W)
    if case in ("quantized_kv", "unbounded_drafter"):
        model, _, drafter = pair
        kw.update(dict(kv_bits=8, kv_group_size=32, quantized_kv_start=40) if case == "quantized_kv"
                  else dict(drafter_window=None))
        ids = prompt(tok, "Size me.")
    else:
        model, drafter = _tiny(case.split("_drafter")[0], tmp_path, case.endswith("drafter"))
        ids = [(i * 37 + 11) % 500 + 4 for i in range(90)]
        if drafter is None:
            kw = {}
    root = tmp_path / "cache"
    first = store_of(model, tok, drafter, root)
    r, _, _ = run(first, model, tok, drafter, ids, **kw)
    [(ent, _)] = first.entries.values()
    kinds = {type(c) for c in ent.target}
    want = {"quantized_kv": QuantizedKVCache, "gemma3_text": RotatingKVCache, "qwen3_5": ArraysCache,
            "lfm2": ArraysCache, "qwen3_5_drafter": ArraysCache}.get(case)
    assert want is None or want in kinds
    cont = list(ent.tokens) + [5, 6, 7]  # the whole entry starts this one
    r2, n, origin = run(store_of(model, tok, drafter, root), model, tok, drafter, cont, **kw)
    assert origin["tier"] == "disk" and n == len(ent.tokens)
    assert r2.token_ids == cold(model, tok, drafter, cont, **kw)
    if drafter is not None:
        assert r2.stats.mode == "dflash" and r2.stats.drafted > 0


@pytest.mark.slow
def test_a_recurrent_entry_serves_only_prompts_it_starts(pair, tmp_path):
    _, tok, _ = pair
    model, _ = _tiny("qwen3_5", tmp_path, False)
    ids = [(i * 37 + 11) % 500 + 4 for i in range(60)]
    run(store_of(model, tok, None, tmp_path / "c"), model, tok, None, ids)
    branch = ids[:40] + [7, 8, 9]  # cannot be cut back to 40 tokens
    s = store_of(model, tok, None, tmp_path / "c")
    assert s.branch_point(Target(model), branch) == 40  # (the worker checkpoints there)
    r, n, _ = run(s, model, tok, None, branch)
    assert n == 0 and r.token_ids == cold(model, tok, None, branch)


# -- the budget -----------------------------------------------------------------------------

@pytest.mark.slow
def test_the_disk_budget_keeps_the_least_recently_used_out(pair, tmp_path):
    model, tok, drafter = pair
    prompts = [prompt(tok, q, system=f"System {i}. " * 30) for i, q in enumerate(("One?", "Two?", "Three?"))]
    run(store_of(*pair, tmp_path), *pair, prompts[0], block_size=W)
    one = sum(p.stat().st_size for p in Path(tmp_path).rglob("*.safetensors"))
    budget = int(one * 1.6)
    for ids in prompts[1:]:
        run(store_of(*pair, tmp_path, budget=budget), *pair, ids, block_size=W)
    left = list(Path(tmp_path).rglob("*.safetensors"))
    assert sum(p.stat().st_size for p in left) <= budget and len(files(tmp_path, "entries")) == 1
    s = store_of(*pair, tmp_path, budget=budget)
    r, n, origin = run(s, *pair, prompts[2], block_size=W)  # the newest stayed
    assert origin["tier"] == "disk" and n == len(prompts[2]) - 1
    r, n, _ = run(store_of(*pair, tmp_path, budget=budget), *pair, prompts[0], block_size=W)
    assert n < len(prompts[0]) // 4 and r.token_ids == cold(*pair, prompts[0], block_size=W)  # (the template's start)


# -- faults ---------------------------------------------------------------------------------

def _entry(tmp_path):
    [p] = files(tmp_path, "entries")
    return p


def _data_start(p: Path) -> int:
    return 8 + struct.unpack("<Q", p.read_bytes()[:8])[0]


@pytest.mark.parametrize("fault", fast_first(["truncated", "corrupt", "corrupt_block", "missing_block", "other_format",
                                              "not_a_file"]))
def test_a_broken_file_is_dropped_and_the_prompt_prefilled(pair, tmp_path, capsys, fault):
    model, tok, drafter = pair
    ids = prompt(tok, "How do I list files?")
    want = cold(*pair, ids, block_size=W)
    run(store_of(*pair, tmp_path), *pair, ids, block_size=W)
    p = _entry(tmp_path)
    data = bytearray(p.read_bytes())
    if fault == "truncated":
        p.write_bytes(data[: len(data) // 2])
    elif fault == "corrupt":  # a flipped byte in the middle of the arrays
        i = _data_start(p) + (len(data) - _data_start(p)) // 2
        data[i] ^= 0xFF
        p.write_bytes(data)
    elif fault in ("corrupt_block", "missing_block"):
        b = files(tmp_path, "blocks")[0]
        if fault == "missing_block":
            b.unlink()
        else:
            raw = bytearray(b.read_bytes())
            raw[-3] ^= 0xFF
            b.write_bytes(raw)
    elif fault == "other_format":  # the same name, written by a later mlx-dflash
        n = struct.unpack("<Q", bytes(data[:8]))[0]
        h = json.loads(bytes(data[8:8 + n]))
        meta = json.loads(h["__metadata__"]["0.dflash"])
        meta["format"] = 99
        h["__metadata__"]["0.dflash"] = json.dumps(meta)
        hb = json.dumps(h).encode()
        hb += b" " * (-len(hb) % 8)
        p.write_bytes(struct.pack("<Q", len(hb)) + hb + bytes(data[8 + n:]))
    else:
        p.write_bytes(b"\x00garbage")
    capsys.readouterr()
    s = store_of(*pair, tmp_path)
    target = Target(model)
    pc, n = s.take(target, ids, drafter, True)
    assert n == 0 and pc.target is None  # detected: a fresh prefill
    r = generate(model, tok, ids, drafter, max_tokens=N, block_size=W, prompt_cache=pc)
    assert r.token_ids == want
    err = [line for line in capsys.readouterr().err.splitlines() if "prompt cache" in line]
    assert len(err) == 1 and "dropped" in err[0], err
    assert not p.exists() and s.summary()["disk"]["dropped"] >= 1
    s.put(pc, target)  # written again, whole
    assert s.close(60)
    r, n, origin = run(store_of(*pair, tmp_path), *pair, ids, block_size=W)
    assert origin["tier"] == "disk" and r.token_ids == want


def _enospc_save(path, caches, metadata=None):
    with open(path, "wb") as f:
        f.write(b"x" * 100)
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.slow
def test_a_full_disk_is_skipped_with_one_line(pair, tmp_path, capsys, monkeypatch):
    model, tok, drafter = pair
    ids = prompt(tok, "How do I list files?")
    monkeypatch.setattr(disk_format, "save_prompt_cache", _enospc_save)
    s = store_of(*pair, tmp_path)
    r, _, _ = run(s, *pair, ids, block_size=W)
    err = [line for line in capsys.readouterr().err.splitlines() if "prompt cache" in line]
    assert len(err) == 1 and "No space left on device" in err[0]
    assert not [p for p in Path(tmp_path).rglob("*") if p.is_file() and p.name not in (".lock", "identity.json")]
    assert s.summary()["disk"]["write_errors"] == 1 and len(s) == 1  # still in memory
    r2, n, origin = run(s, *pair, ids, block_size=W)  # from memory
    assert origin["tier"] == "memory" and r2.token_ids == r.token_ids == cold(*pair, ids, block_size=W)


@pytest.fixture
def small_fs(tmp_path):
    """A real 1 MiB filesystem (tmpfs; needs root: skipped without)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small filesystem here ({r.stderr.decode().strip()})")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_a_real_full_disk(pair, small_fs, capsys):
    """On a real 1 MiB filesystem: entries that do not fit are skipped with one
    line and leave no temp file; `settings set` says one line; the cost cache
    leaves no 0-byte temp file and says so."""
    model, tok, drafter = pair
    ids = prompt(tok, "How do I list files?", system=SYSTEM * 6)  # more than 1 MiB of K/V and features
    s = store_of(*pair, small_fs / "prompts")
    r, _, _ = run(s, *pair, ids, block_size=W)
    err = [line for line in capsys.readouterr().err.splitlines() if "prompt cache" in line]
    assert len(err) == 1 and "No space left on device" in err[0]
    assert not [p for p in small_fs.rglob("*.tmp*")]
    r2, n, _ = run(store_of(*pair, small_fs / "prompts"), *pair, ids, block_size=W)
    assert r2.token_ids == r.token_ids == cold(*pair, ids, block_size=W)
    # fill it up: settings and measured costs
    try:
        with open(small_fs / "filler", "wb", buffering=0) as f:
            while True:
                f.write(b"x" * 4096)
    except OSError:
        pass
    env = {**os.environ, "MLX_DFLASH_HOME": str(small_fs / "home")}
    out = subprocess.run([sys.executable, "-m", "app.cli", "settings", "set", "port", "8001"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "No space left on device" in out.stderr and "Traceback" not in out.stderr
    from mlx_dflash.policy import costs

    capsys.readouterr()
    with pytest.raises(OSError):
        costs._write(small_fs / "calibration" / "costs-x.json", {"k": 1}, {"costs": "x" * 8192})
    assert not list((small_fs / "calibration").glob("*.tmp"))
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_read_only_cache_dir_still_serves_what_it_holds(pair, small_fs, capsys):
    model, tok, drafter = pair
    a, b = prompt(tok, "How do I list files?"), prompt(tok, "What is a tuple?")
    run(store_of(*pair, small_fs / "p"), *pair, a, block_size=W)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    capsys.readouterr()
    s = store_of(*pair, small_fs / "p")
    r, n, origin = run(s, *pair, a, block_size=W)  # read: fine
    assert origin["tier"] == "disk" and r.token_ids == cold(*pair, a, block_size=W)
    r, n, _ = run(s, *pair, b, block_size=W)  # a new entry cannot be written: one line, then quiet
    run(s, *pair, prompt(tok, "Explain sets."), block_size=W)
    err = [line for line in capsys.readouterr().err.splitlines() if "prompt cache" in line]
    assert len(err) == 1 and "Read-only file system" in err[0], err
    assert r.token_ids == cold(*pair, b, block_size=W) and s.summary()["disk"]["readonly"]


KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    sys.path[:0] = [{tests!r}]
    from mlx_dflash import load, generate
    from mlx_dflash.cache import disk
    from pair_server import prompt
    from test_prompt_disk import store_of, run
    model, tok, drafter = load({folder!r} + "/target", {folder!r} + "/drafter")
    real = os.replace
    def replace(src, dst):
        if "/entries/" in str(dst):  # blocks are in place, the entry half-written: killed now
            os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst)
    disk.os.replace = replace  # (the os module: every rename in the process)
    run(store_of(model, tok, drafter, {root!r}), model, tok, drafter, prompt(tok, "How do I list files?"),
        block_size=4)
""")


@pytest.mark.slow
def test_a_writer_killed_mid_write_loses_nothing(pair, pairs, tmp_path):
    model, tok, drafter = pair
    root = tmp_path / "cache"
    code = KILLED_WRITER.format(tests=str(ROOT / "tests"), folder=str(pairs()), root=str(root))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == -9, p.stderr
    assert not files(root, "entries") and [x for x in root.rglob(".*.tmp*")] and files(root, "blocks")
    ids = prompt(tok, "How do I list files?")
    s = store_of(*pair, root)
    r, n, _ = run(s, *pair, ids, block_size=W)  # nothing half-written is read; the next write cleans up
    assert n == 0 and r.token_ids == cold(*pair, ids, block_size=W)
    assert not [x for x in root.rglob(".*.tmp*")] and len(files(root, "entries")) == 1
    r, n, origin = run(store_of(*pair, root), *pair, ids, block_size=W)
    assert origin["tier"] == "disk" and r.token_ids == cold(*pair, ids, block_size=W)


CONCURRENT = textwrap.dedent("""
    import sys
    sys.path[:0] = [{tests!r}]
    from mlx_dflash import load
    from pair_server import prompt
    from test_prompt_disk import store_of, run
    model, tok, drafter = load({folder!r} + "/target", {folder!r} + "/drafter")
    for q in {questions!r}:
        run(store_of(model, tok, drafter, {root!r}), model, tok, drafter, prompt(tok, q), block_size=4)
""")


@pytest.mark.slow
def test_several_processes_share_one_folder(pair, pairs, tmp_path):
    model, tok, drafter = pair
    root = tmp_path / "cache"
    qs = ["How do I list files?", "What is a tuple?", "Explain sets.", "And dicts?"]
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT.format(
        tests=str(ROOT / "tests"), folder=str(pairs()), root=str(root), questions=qs[i:] + qs[:i])],
        cwd=ROOT, stderr=subprocess.PIPE, text=True) for i in range(3)]
    for p in procs:
        assert p.wait(timeout=600) == 0, p.stderr.read()
        assert "dropped" not in p.stderr.read()
    assert len(files(root, "entries")) == len(qs)
    for q in qs:
        ids = prompt(tok, q)
        r, n, origin = run(store_of(*pair, root), *pair, ids, block_size=W)
        assert origin["tier"] == "disk" and n == len(ids) - 1 and r.token_ids == cold(*pair, ids, block_size=W)
    assert not [x for x in root.rglob(".*.tmp*")]


# -- every entry point ----------------------------------------------------------------------

@pytest.mark.slow
def test_generate_and_the_cache_command(pairs, tmp_path):
    env = {**os.environ, "MLX_DFLASH_HOME": str(tmp_path / "home")}

    def cli(*args):
        p = subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout

    gen = ["generate", "--model", str(pairs() / "target"), "--drafter", str(pairs() / "drafter"), "--prompt",
           "Tell me about lists. " * 20, "--max-tokens", "8", "--json"]
    first, second = json.loads(cli(*gen)), json.loads(cli(*gen))
    assert first["stats"]["prompt_cache"] is None and second["stats"]["prompt_cache"]["tier"] == "disk"
    assert second["stats"]["reused_tokens"] == second["stats"]["prompt_tokens"] - 1
    assert second["text"] == first["text"]
    du = json.loads(cli("cache", "du", "--json"))
    [row] = json.loads(cli("cache", "list", "--json"))
    assert du["bytes"] == row["bytes"] > 0 and du["entries"] == 1 and row["identity"]["name"]
    assert "1 " in cli("cache", "list").splitlines()[1]
    assert "removed" in cli("cache", "clear")
    assert json.loads(cli("cache", "du", "--json"))["bytes"] == 0 and folders(Path(du["folder"])) == []


def test_the_chat_status_says_disk():
    from app.chat.widgets import summary_line

    s = {"generation_tokens": 3, "prompt_tokens": 100, "reused_tokens": 99,
         "prompt_cache": {"tier": "disk", "load_ms": 120.0, "tokens": 99}}
    assert "cached 99/100 from disk in 0.12 s" in summary_line(s)
    assert "from disk" not in summary_line(dict(s, prompt_cache={"tier": "memory"}))


@pytest.mark.slow
def test_a_restarted_server_answers_from_disk(pairs, tmp_path, monkeypatch):
    import openai
    from scripted import LocalServer

    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about lists."}]

    def ask():
        with LocalServer(DiskCatalog(pairs()), model="pair") as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
            r = c.chat.completions.create(model="pair", temperature=0, messages=msgs)
            srv.worker.store.close(60)
            import httpx

            return r, httpx.get(srv.url + "/metrics").json()

    cold_r, _ = ask()
    warm_r, metrics = ask()  # a new server process's worth of state: only the disk is shared
    d = warm_r.model_dump()["dflash"]
    assert d["prompt_cache"]["tier"] == "disk" and d["prompt_cache"]["load_ms"] > 0
    assert warm_r.usage.prompt_tokens_details.cached_tokens == warm_r.usage.prompt_tokens - 1
    assert warm_r.choices[0].message.content == cold_r.choices[0].message.content
    disk = metrics["models"]["pair"]["prompt_cache"]["disk"]
    assert disk["hits"] == 1 and disk["bytes_read"] > 0 and disk["load_time"] > 0


@pytest.mark.slow
def test_prompts_cached_by_another_version_are_skipped_with_one_line(pair, tmp_path, capsys):
    model, tok, drafter = pair
    ids = prompt(tok, "How do I list files?")
    old = dict(identity(model, tok, drafter), mlx_dflash="0.0.1")  # the same model, an older mlx-dflash
    s = PromptStore(1 << 30, DiskTier(tmp_path, old, 1 << 30, block=BLOCK))
    run(s, *pair, ids, block_size=W)
    capsys.readouterr()
    r, n, _ = run(store_of(*pair, tmp_path), *pair, ids, block_size=W)
    err = [line for line in capsys.readouterr().err.splitlines() if "prompt cache" in line]
    assert n == 0 and r.token_ids == cold(*pair, ids, block_size=W)
    assert len(err) == 1 and "another version" in err[0] and "mlx-dflash 0.0.1" in err[0], err
    rows = folders(tmp_path)
    assert {r["identity"]["mlx_dflash"] for r in rows} == {"0.0.1", identity(model, tok, drafter)["mlx_dflash"]}
