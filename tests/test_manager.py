"""Model manager: discovery over embedded models, user folders and a fake
Hugging Face cache; pairing by config; settings checks that need model files;
load_model (drafter choice, quantization, the activation-dtype guard); rm/pull;
the `mlx-dflash models` command."""

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_dflash import generate
from mlx_dflash.hub import HubError
from mlx_dflash.manager import (acceptance_warning, discover, list_targets, load_model, pair_problem, param_bytes,
                                pull, remove, resolve, safe_activation_dtype, set_activation_dtype, settings_store,
                                weights_problem)
from mlx_dflash.settings import ModelSettings, SettingsError, SettingsStore
from mlx_dflash.target import Target


def copy_model(src, dst, **cfg_changes):
    shutil.copytree(src, dst)
    cfg = json.loads((Path(dst) / "config.json").read_text())
    for k, v in cfg_changes.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k].update(v)
        else:
            cfg[k] = v
    (Path(dst) / "config.json").write_text(json.dumps(cfg))
    return Path(dst)


def hf_add(cache: Path, repo_id: str, src: Path, rev: str = "0123456789abcdef0123456789abcdef01234567",
           kind: str = "models"):
    """A repo in the real hub layout: blobs/, snapshots/<rev>/ symlinks, refs/main."""
    repo = cache / f"{kind}--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(Path(src).iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copyfile(f, blob)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return repo


def files_size(p: Path) -> int:
    return sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file())


@pytest.fixture
def world(tmp_path, monkeypatch, pairs):
    """Embedded: target + dflash2 (block 8) + draft-ar; folders: a flat target, a
    DFlash 1 drafter, a drafter for a wider model; HF cache: a target, a DFlash 2
    drafter, a tiny draft model, a dataset and a repo without weights."""
    v2, v1 = pairs(version=2, block_size=8), pairs(version=1)
    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    emb = tmp_path / "embedded"
    copy_model(v2 / "target", emb / "target")
    copy_model(v2 / "drafter", emb / "dflash2")
    copy_model(v2 / "target", emb / "draft-ar", mlx_dflash={"role": "draft"})
    monkeypatch.setattr("mlx_dflash.loader.models_dir", lambda: emb)
    mdirs = tmp_path / "models"
    copy_model(v1 / "target", mdirs / "flat-target")
    copy_model(v1 / "drafter", mdirs / "org" / "v1-drafter")
    copy_model(v1 / "drafter", mdirs / "org" / "wide-drafter", hidden_size=128)
    hf_add(cache, "hforg/chat", v1 / "target")
    hf_add(cache, "hforg/chat-DFlash", v2 / "drafter")
    hf_add(cache, "hforg/tiny-draft", v1 / "target")
    hf_add(cache, "x/dataset", v1 / "target", kind="datasets")
    readme = tmp_path / "readme"
    readme.mkdir()
    (readme / "README.md").write_text("hi")
    hf_add(cache, "hforg/no-weights", readme)
    store = settings_store()  # with the checks that need model files
    store.set_global(model_dirs=[str(mdirs)])
    return dict(store=store, emb=emb, mdirs=mdirs, cache=cache, v1=v1, v2=v2)


def by_id(store):
    return {e.id: e for e in discover(store)}


def test_discovery(world):
    es = by_id(world["store"])
    assert {i: (e.kind, e.source) for i, e in es.items()} == {
        "embedded/target": ("target", "embedded"),
        "embedded/dflash2": ("dflash2", "embedded"),
        "embedded/draft-ar": ("draft", "embedded"),
        "flat-target": ("target", "folder"),
        "org/v1-drafter": ("dflash1", "folder"),
        "org/wide-drafter": ("dflash1", "folder"),
        "hforg/chat": ("target", "hf-cache"),
        "hforg/chat-DFlash": ("dflash2", "hf-cache"),
        "hforg/tiny-draft": ("draft", "hf-cache"),
    }
    assert es["flat-target"].size_bytes == files_size(world["mdirs"] / "flat-target")
    assert es["hforg/chat"].size_bytes == files_size(world["cache"] / "models--hforg--chat" / "blobs")
    assert es["embedded/dflash2"].block_size == 8 and es["org/v1-drafter"].block_size == 16
    assert es["hforg/chat"].path.parent.name == "snapshots"


def test_estimated_memory_counts_weights_and_kv(world):
    store = world["store"]
    t = by_id(store)["embedded/target"]
    cfg = t.config
    weights = sum(v.nbytes for v in mx.load(str(t.path / "model.safetensors")).values())
    # on this (CPU) backend weights load as float32, as stored by make_test_pair
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    assert t.est_memory_bytes == weights + kv_per_token * ModelSettings().max_context
    store.set_model("embedded/target", max_context=100)
    assert by_id(store)["embedded/target"].est_memory_bytes == weights + kv_per_token * 100


def test_list_targets_hides_drafters(world):
    ids = [e.id for e in list_targets(world["store"])]
    assert ids == ["embedded/target", "flat-target", "hforg/chat"]


def test_pairing(world):
    es = by_id(world["store"])
    # DFlash 2 before DFlash 1; the drafter for a wider model is left out
    for t in ("embedded/target", "flat-target", "hforg/chat"):
        assert es[t].compatible_drafters == ["embedded/dflash2", "hforg/chat-DFlash", "org/v1-drafter"]
    tcfg, dcfg = es["embedded/target"].config, es["org/v1-drafter"].config
    assert pair_problem(tcfg, dcfg) is None
    h = tcfg["hidden_size"]
    assert pair_problem(tcfg, {**dcfg, "hidden_size": 2 * h}) == f"drafter hidden size {2 * h} != target hidden size {h}"
    assert pair_problem(tcfg, {**dcfg, "vocab_size": 7}) == f"drafter vocabulary 7 != target vocabulary {tcfg['vocab_size']}"
    n = tcfg["num_hidden_layers"]
    taps = {**dcfg, "dflash_config": {**dcfg["dflash_config"], "target_layer_ids": [0, n]}}
    assert pair_problem(tcfg, taps) == f"drafter taps target layers [{n}] but the target has only {n} layers"
    assert pair_problem(tcfg, {**dcfg, "num_target_layers": n + 2}) == \
        f"drafter was trained for a {n + 2}-layer target; this one has {n}"
    assert "not a DFlash drafter" in pair_problem(tcfg, tcfg)


def test_resolve(world, tmp_path):
    store = world["store"]
    assert resolve(None, store).id == "embedded/target"
    store.set_global(default_model="hforg/chat")
    assert resolve(None, store).id == "hforg/chat"
    by_path = resolve(str(world["mdirs"] / "flat-target"), store)
    assert by_path.id == "flat-target"
    other = copy_model(world["v1"] / "target", tmp_path / "elsewhere" / "m")
    e = resolve(str(other), store)
    assert e.kind == "target" and e.path == other and e.compatible_drafters[0] == "embedded/dflash2"
    with pytest.raises(SettingsError, match=r"unknown model 'some/repo'; download it with `mlx-dflash models pull some/repo`"):
        resolve("some/repo", store)
    with pytest.raises(SettingsError, match=r"unknown model 'nothing'; see `mlx-dflash models list`"):
        resolve("nothing", store)
    shutil.rmtree(world["emb"] / "target")
    with pytest.raises(HubError, match="embedded default model is missing"):
        resolve("embedded/target", store)


def test_one_name_everywhere(world, tmp_path):
    """A listed id in any case, the hub cache's folder name, ORG/NAME for a folder
    listed as NAME and the reverse, a path: the same model for resolve,
    load_model and mlx_dflash.load."""
    import mlx_dflash

    store = world["store"]
    for name, want in [("EMBEDDED/Target", "embedded/target"), ("models--hforg--chat", "hforg/chat"),
                       ("someorg/flat-target", "flat-target"), ("chat", "hforg/chat"), ("Chat", "hforg/chat"),
                       ("v1-drafter", "org/v1-drafter"), (str(world["mdirs"] / "flat-target"), "flat-target"),
                       ("hforg/chat-dflash", "hforg/chat-DFlash")]:
        assert resolve(name, store).id == want, name
    copy_model(world["v1"] / "target", world["mdirs"] / "otherorg" / "chat")
    with pytest.raises(SettingsError, match="'chat' could be otherorg/chat or hforg/chat; use one of these ids"):
        resolve("chat", store)
    assert resolve("otherorg/chat", store).id == "otherorg/chat"
    m, tok, d = mlx_dflash.load("hforg/chat", "embedded/dflash2")  # names from `models list`, offline
    assert d is not None and d.version == 2
    lm = load_model("HFORG/CHAT", store, drafter="v1-drafter")
    assert lm.id == "hforg/chat" and lm.drafter_id == "org/v1-drafter"
    plain = load_model("hforg/chat", store, dflash=False)
    assert plain.drafter is None and plain.generation_kwargs()["verify_mode"] == "off"
    with pytest.raises(SettingsError, match="unknown drafter 'nope'"):
        load_model("hforg/chat", store, drafter="nope")
    with pytest.raises(SettingsError, match="unknown model 'no/such'.*models pull no/such"):
        resolve("no/such", store)
    with pytest.raises(SettingsError, match="unknown model 'flat-targt' \\(did you mean 'flat-target'\\?\\)"):
        mlx_dflash.load("flat-targt")


@pytest.mark.parametrize("damage,msg", [
    ("truncate", "model.safetensors is truncated"),
    ("header", "model.safetensors is truncated or corrupt"),
    ("config-json", "config.json is not valid JSON"),
    ("config-list", "config.json is not a JSON object"),
    ("config-fields", "config.json does not fit its model type"),
])
def test_damaged_model_folder_is_one_line_naming_the_file(world, damage, msg):
    import mlx_dflash

    store = world["store"]
    d = world["mdirs"] / "flat-target"
    w, cfg = d / "model.safetensors", d / "config.json"
    if damage == "truncate":
        with open(w, "r+b") as f:
            f.truncate(w.stat().st_size * 2 // 3)
    elif damage == "header":
        w.write_bytes(b"\xff" * 64)
    elif damage == "config-json":
        cfg.write_text(cfg.read_text()[:-20])
    elif damage == "config-list":
        cfg.write_text("[1]")
    else:
        c = json.loads(cfg.read_text())
        del c["hidden_size"], c["num_hidden_layers"]
        cfg.write_text(json.dumps(c))
    for load in (lambda: load_model(str(d), store), lambda: mlx_dflash.load(str(d))):
        with pytest.raises(HubError) as e:
            load()
        assert msg in str(e.value) and "\n" not in str(e.value) and str(d) in str(e.value)
    if damage in ("truncate", "header"):
        assert msg in weights_problem(d)
    assert weights_problem(world["v1"] / "target") is None


def test_acceptance_warning_rule():
    from mlx_dflash.generate import GenerationStats

    s = GenerationStats(mode="dflash", cycles=60, drafted=240, accepted=2)
    why = acceptance_warning(s, "org/d")
    assert "drafter 'org/d' accepted 2 of 240" in why and "\n" not in why
    assert acceptance_warning(GenerationStats(mode="dflash", cycles=60, drafted=240, accepted=40), "d") is None
    assert acceptance_warning(GenerationStats(mode="dflash", cycles=4, drafted=16, accepted=0), "d") is None  # too early
    assert acceptance_warning(GenerationStats(mode="off", cycles=60, drafted=0, accepted=0), None) is None


def test_unknown_drafter_or_default_model_is_refused_when_set(world):
    store = world["store"]
    for changes, msg in [({"drafter": "no/such-drafter"}, "unknown drafter 'no/such-drafter'; download it with "
                                                          "`mlx-dflash models pull no/such-drafter`"),
                         ({"drafter": "v1-draftr"}, "unknown drafter 'v1-draftr'")]:
        with pytest.raises(SettingsError) as e:
            store.set_model("embedded/target", **changes)
        assert msg in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SettingsError, match="unknown model 'no/such'; download it"):
        store.set_global(default_model="no/such")
    with pytest.raises(SettingsError, match="default_model: 'embedded/dflash2' is a DFlash 2 drafter"):
        store.set_global(default_model="embedded/dflash2")
    assert store.globals().default_model is None and not store.explicit("embedded/target")
    store.set_model("embedded/target", drafter="v1-drafter")  # a loose spelling resolves
    store.set_global(default_model="hforg/chat")
    assert resolve(None, store).id == "hforg/chat"


def test_settings_checks_against_model_files(world):
    store = world["store"]
    with pytest.raises(SettingsError) as e:
        store.set_model("embedded/target", block_size=9)
    assert str(e.value) == "block_size 9 is above the trained block size 8 of drafter 'embedded/dflash2'; use 1..8"
    with pytest.raises(SettingsError) as e:
        store.set_model("embedded/target", drafter="org/wide-drafter")
    assert str(e.value) == ("drafter 'org/wide-drafter' is incompatible with 'embedded/target': "
                            f"drafter hidden size 128 != target hidden size {by_id(store)['embedded/target'].config['hidden_size']}")
    with pytest.raises(SettingsError, match=r"drafter 'flat-target' is incompatible: not a DFlash drafter"):
        store.set_model("embedded/target", drafter="flat-target")
    with pytest.raises(SettingsError, match="'embedded/dflash2' is a DFlash 2 drafter; settings apply to target models"):
        store.set_model("embedded/dflash2", drafter="org/v1-drafter")
    assert not store.explicit("embedded/target")  # nothing was written
    # a drafter trained on wider blocks allows more; switching back is refused
    store.set_model("embedded/target", drafter="org/v1-drafter", block_size=12)
    with pytest.raises(SettingsError, match="block_size 12 is above the trained block size 8"):
        store.set_model("embedded/target", drafter="embedded/dflash2")
    # a default block size fits any drafter (load_model fits it), so no error here
    store.set_model("flat-target", drafter="embedded/dflash2")


def _greedy(lm, prompt, **kw):
    args = {**lm.generation_kwargs(), "max_tokens": 24, **kw}
    return generate(lm.model, lm.tokenizer, prompt, lm.drafter, **args)


def test_load_model_picks_drafter_and_stays_lossless(world):
    store = world["store"]
    lm = load_model(None, store)
    assert lm.id == "embedded/target" and lm.drafter_id == "embedded/dflash2" and lm.drafter.version == 2
    assert lm.settings.block_size == 5 and lm.notices == []
    plain = _greedy(lm, "def main():", verify_mode="off")
    assert _greedy(lm, "def main():").token_ids == plain.token_ids
    store.set_model("embedded/target", drafter="org/v1-drafter", block_size=7)
    lm1 = load_model("embedded/target", store)
    assert lm1.drafter_id == "org/v1-drafter" and lm1.drafter.version == 1
    r = _greedy(lm1, "def main():")
    assert r.token_ids == plain.token_ids and r.stats.block_size == 7
    store.set_model("embedded/target", **{"dflash.enabled": False})
    off = load_model("embedded/target", store)
    assert off.drafter is None and off.generation_kwargs()["verify_mode"] == "off"
    with pytest.raises(SettingsError, match="'embedded/dflash2' is a DFlash 2 drafter, not a chat model"):
        load_model("embedded/dflash2", store)


def test_load_model_fits_block_size_from_a_hand_edited_file(world):
    store = world["store"]
    raw = json.loads(store.path.read_text())
    raw["models"]["embedded/target"] = {"block_size": 12}
    store.path.write_text(json.dumps(raw))
    lm = load_model("embedded/target", store)
    assert lm.settings.block_size == 8 and "above the drafter's trained block size 8" in lm.notices[0]
    assert _greedy(lm, "x = 1").stats.block_size == 8


def _draft_hidden(lm, feats):
    """The drafter's output on a fixed block and fixed context features."""
    t = Target(lm.model)
    d = lm.drafter
    block = mx.array([[5] + [d.config.mask_token_id] * 4])
    out = d(t.embed(block), feats, d.make_cache())
    mx.eval(out)
    return out.astype(mx.float32)


def _feats(lm, scale=1.0):
    c = lm.drafter.config
    return mx.random.normal((1, 6, len(c.target_layer_ids) * c.hidden_size), key=mx.random.key(0)) * scale


def _cos(a, b):
    a, b = a.reshape(-1), b.reshape(-1)
    return (a @ b / (mx.linalg.norm(a) * mx.linalg.norm(b))).item()


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32)])
def test_quantized_drafter(world, bits, group):
    store = world["store"]
    ref = load_model("embedded/target", store)
    store.set_model("embedded/target", **{"drafter.quant_bits": bits, "drafter.quant_group_size": group})
    q = load_model("embedded/target", store)
    from mlx.nn import QuantizedLinear

    assert isinstance(q.drafter.layers[0].mlp.up_proj, QuantizedLinear)
    assert q.drafter.layers[0].mlp.up_proj.bits == bits
    # weights shrink at least as the bit width does against float32 (scales included)
    assert param_bytes(q.drafter) < param_bytes(ref.drafter) * (bits + 8) / 32
    f = _feats(ref)
    assert _cos(_draft_hidden(q, f), _draft_hidden(ref, f)) > (0.9 if bits == 4 else 0.99)
    plain = _greedy(ref, "import os", verify_mode="off")
    assert _greedy(q, "import os").token_ids == plain.token_ids  # still lossless


def test_activation_dtype_guard_rule():
    cpu = mx.default_device() == mx.cpu or not mx.metal.is_available()
    for target in (mx.bfloat16, mx.float32):
        dt, why = safe_activation_dtype("float16", target)
        assert dt == target and "overflow" in why and "\n" not in why
    assert safe_activation_dtype("auto", mx.bfloat16) == (mx.bfloat16, None)
    assert safe_activation_dtype("float32", mx.bfloat16) == (mx.float32, None)
    assert safe_activation_dtype("bfloat16", mx.float32) == (mx.bfloat16, None)
    dt, why = safe_activation_dtype("float16", mx.float16)
    assert (dt, why is None) == (mx.float16, not cpu)


def test_activation_dtype_guard_keeps_drafts_alive(world):
    """Target features beyond float16's range (bf16 targets produce them) turn a
    float16 drafter's output into inf/NaN: no draft is ever accepted. The guard
    keeps the target's precision instead."""
    store = world["store"]
    ref = load_model("embedded/target", store)
    big = _feats(ref, scale=1e5)
    want = _draft_hidden(ref, big)
    assert mx.isfinite(want).all().item()

    unsafe = load_model("embedded/target", store)
    set_activation_dtype(unsafe.drafter, mx.float16)  # bypasses the guard
    assert not mx.isfinite(_draft_hidden(unsafe, big)).all().item()  # the failure being guarded against

    store.set_model("embedded/target", **{"drafter.activation_dtype": "float16", "drafter.quant_bits": 4})
    guarded = load_model("embedded/target", store)
    assert any("float16" in n and "overflow" in n for n in guarded.notices)
    got = _draft_hidden(guarded, big)
    assert mx.isfinite(got).all().item() and _cos(got, want) > 0.9
    plain = _greedy(ref, "for i in", verify_mode="off")
    assert _greedy(guarded, "for i in").token_ids == plain.token_ids


def test_compute_dtype_setting(world, monkeypatch):
    """`dtype` (setting, or load_model's argument over it) is the target's compute
    dtype; the memory estimate follows it."""
    monkeypatch.delenv("MLX_DFLASH_DTYPE", raising=False)
    store = world["store"]
    full = by_id(store)["flat-target"].est_memory_bytes  # the test pair is stored in float32
    store.set_model("flat-target", dtype="bfloat16")
    assert by_id(store)["flat-target"].est_memory_bytes == full // 2
    lm = load_model("flat-target", store)
    assert lm.model.model.norm.weight.dtype == mx.bfloat16 and lm.settings.dtype == "bfloat16"
    over = load_model("flat-target", store, dtype="float32")
    assert over.model.model.norm.weight.dtype == mx.float32
    with pytest.raises(SettingsError, match="unknown dtype 'f8'"):
        store.set_model("flat-target", dtype="f8")


def test_activation_dtype_is_applied(world):
    store = world["store"]
    store.set_model("embedded/target", **{"drafter.activation_dtype": "bfloat16"})
    lm = load_model("embedded/target", store)
    assert lm.drafter.norm.weight.dtype == mx.bfloat16 and lm.notices == []
    f = _feats(lm)
    t = Target(lm.model)
    h = lm.drafter(t.embed(mx.array([[5, lm.drafter.config.mask_token_id]])), f, lm.drafter.make_cache())
    assert h.dtype == mx.bfloat16
    assert _greedy(lm, "print(").token_ids == _greedy(lm, "print(", verify_mode="off").token_ids


def test_remove(world):
    store = world["store"]
    assert remove("hforg/chat", store) > 0
    assert not (world["cache"] / "models--hforg--chat").exists()
    assert remove("org/v1-drafter", store) > 0
    assert not (world["mdirs"] / "org" / "v1-drafter").exists() and (world["mdirs"] / "org").exists()
    assert remove("org/wide-drafter", store) > 0
    assert not (world["mdirs"] / "org").exists()  # the emptied org folder goes too
    ids = set(by_id(store))
    assert not ids & {"hforg/chat", "org/v1-drafter", "org/wide-drafter"} and "hforg/chat-DFlash" in ids
    with pytest.raises(SettingsError, match="embedded model .* cannot be removed"):
        remove("embedded/dflash2", store)
    assert (world["emb"] / "dflash2" / "config.json").exists()


def test_pull_offline_and_bad_ids(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError) as e:
        pull("org/model")
    assert "HF_HUB_OFFLINE" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(HubError, match="not a Hugging Face repo id"):
        pull("not-a-repo")


def _cli(*argv):
    from app.cli import main

    return main(list(argv))


def test_models_cli(world, capsys):
    store = world["store"]
    assert _cli("models", "list", "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed == [e.to_dict() for e in discover(store)]
    assert _cli("models", "list", "--targets", "--json") == 0
    assert [e["id"] for e in json.loads(capsys.readouterr().out)] == ["embedded/target", "flat-target", "hforg/chat"]
    assert _cli("models", "list") == 0
    table = capsys.readouterr().out
    assert "embedded/target *" in table and "DFlash 2 drafter" in table
    store.set_model("hforg/chat", block_size=4)
    assert _cli("models", "show", "hforg/chat", "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert info["settings"]["block_size"] == 4 and info["settings_set"] == ["block_size"]
    assert info["drafter_in_use"] == "embedded/dflash2"
    assert _cli("models", "show", "hforg/chat-DFlash", "--json") == 0
    assert json.loads(capsys.readouterr().out)["compatible_targets"] == ["embedded/target", "flat-target", "hforg/chat"]
    for argv in (("models", "rm", "hforg/chat"), ("models", "rm", "embedded/target"),
                 ("models", "show", "no/such"), ("models", "pull", "org/x"),
                 ("settings", "set", "hforg/tiny-draft", "top_k", "3"),
                 ("settings", "set", "embedded/target", "block_size", "9")):
        assert _cli(*argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err
    assert (world["cache"] / "models--hforg--chat").exists()
    assert _cli("models", "rm", "hforg/chat", "--yes") == 0
    assert not (world["cache"] / "models--hforg--chat").exists()


@pytest.mark.parametrize("bad", [{"num_hidden_layers": None}, {"num_key_value_heads": "two"}, {"hidden_size": "x", "head_dim": None},
                                 {"dflash_config": {"block_size": "x"}}])
def test_wrongly_typed_config_skips_that_folder_only(world, capsys, bad):
    """A config.json with a value of the wrong type took every listing down with a
    TypeError (the server answered 503 to /v1/models): now that one folder is
    skipped with a notice naming it, and every other model is still listed."""
    src = world["v1"] / ("drafter" if "dflash_config" in bad else "target")
    copy_model(src, world["mdirs"] / "broken", **bad)
    es = by_id(world["store"])
    assert "broken" not in es and "flat-target" in es and "embedded/target" in es
    assert "broken" in capsys.readouterr().err
