"""Model manager: discovery over embedded models, user folders and a fake
Hugging Face cache; pairing by config; one name everywhere; settings checks that
need model files; rm/pull; the `mlx-dflash models` command (loading:
tests/test_manager_load.py; the `world` of models: tests/model_world.py)."""

import json
import shutil

import mlx.core as mx
import pytest
from model_world import by_id, copy_model, files_size

from mlx_dflash.platform.hub import HubError
from mlx_dflash.models.manager import acceptance_warning, load_model, pull, remove
from mlx_dflash.models.discovery import discover, pair_problem
from mlx_dflash.models.model_names import resolve
from mlx_dflash.models.discovery import list_targets, weights_problem
from mlx_dflash.settings.schema import ModelSettings, SettingsError


@pytest.mark.slow
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


@pytest.mark.slow
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
    from mlx_dflash.engine.stats import GenerationStats

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
    assert str(e.value) == ("block_size: block size 9 is above the drafter's trained block size 8; use 1..8 "
                            "(drafter 'embedded/dflash2')")
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
    with pytest.raises(SettingsError, match="block size 12 is above the drafter's trained block size 8"):
        store.set_model("embedded/target", drafter="embedded/dflash2")
    # a default block size fits any drafter (load_model fits it), so no error here
    store.set_model("flat-target", drafter="embedded/dflash2")


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


@pytest.mark.slow
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
