"""Drafter resolution: `--model TARGET` alone finds its drafter (registry.py)."""

import json
import shutil

import pytest

from mlx_dflash.models import discovery
from mlx_dflash.models.loader import load
from mlx_dflash.models.registry import Found, base_name, find_drafter, known_drafters

QWEN8 = "z-lab/Qwen3-8B-DFlash-b16"


@pytest.mark.parametrize("ref,want", [
    ("Qwen/Qwen3-8B", "qwen3-8b"),
    ("mlx-community/Qwen3-8B-4bit", "qwen3-8b"),
    ("mlx-community/Qwen3-8B-MLX-8bit", "qwen3-8b"),
    ("mlx-community/Meta-Llama-3.1-8B-Instruct-4bit", "llama-3.1-8b-instruct"),
    ("mlx-community/gpt-oss-20b-MXFP4-Q8", "gpt-oss-20b"),
    ("/models/Qwen3.6-27B-bf16/", "qwen3.6-27b"),
    ("/cache/hub/models--mlx-community--Qwen3-4B-8bit/snapshots/abc", "qwen3-4b"),
])
def test_base_name(ref, want):
    assert base_name(ref) == want


def test_registry_maps_targets_and_their_conversions():
    for t in ("Qwen/Qwen3-8B", "mlx-community/Qwen3-8B-4bit", "mlx-community/Qwen3-8B-8bit"):
        assert known_drafters(t) == [QWEN8]
    assert known_drafters("meta-llama/Llama-3.1-8B-Instruct") == ["z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"]
    assert known_drafters("openai/gpt-oss-120b") == ["z-lab/gpt-oss-120b-DFlash"]
    assert known_drafters("google/gemma-4-31B-it") == ["z-lab/gemma-4-31B-it-DFlash"]
    assert known_drafters("Qwen/Qwen3.5-9B") == ["z-lab/Qwen3.5-9B-DFlash"]
    assert known_drafters("someone/unknown-7b") == []


def test_model_card_base_model_counts(tmp_path):
    t = tmp_path / "my-own-quant"
    t.mkdir()
    (t / "README.md").write_text("---\nlibrary_name: mlx\nbase_model:\n- Qwen/Qwen3-4B\ntags:\n- mlx\n---\n# hi\n")
    assert known_drafters(str(t), t) == ["z-lab/Qwen3-4B-DFlash-b16"]


TARGET_CFG = {"model_type": "qwen3", "hidden_size": 64, "vocab_size": 512, "num_hidden_layers": 4}


def _drafter_cfg(version=1, **extra):
    cfg = {"architectures": ["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"], "hidden_size": 64,
           "vocab_size": 512, "num_target_layers": 4, "dflash_config": {"mask_token_id": 3}}
    cfg.update(extra)
    return cfg


def _put(folder, cfg):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_local_scan_cache_and_named_drafters(tmp_path):
    target = _put(tmp_path / "Qwen3-8B-4bit", TARGET_CFG)
    cache = tmp_path / "hub"
    snap = _put(cache / "models--z-lab--Qwen3-8B-DFlash-b16" / "snapshots" / "abc", _drafter_cfg())
    f = find_drafter("mlx-community/Qwen3-8B-4bit", target, TARGET_CFG, roots=[cache])
    assert f.path == snap and f.repo == QWEN8
    # a drafter whose config names the target, in a models folder; DFlash 2 is preferred over 1
    models = tmp_path / "models"
    _put(models / "d1", _drafter_cfg(1, target_model="Qwen/Qwen3-8B"))
    d2 = _put(models / "d2", _drafter_cfg(2, target_model="Qwen/Qwen3-8B"))
    _put(models / "other", _drafter_cfg(2, target_model="Qwen/Qwen3-4B"))
    assert find_drafter("x/Qwen3-8B-4bit", target, TARGET_CFG, roots=[models]).path == d2
    # the registry drafter in the cache ranks first
    assert find_drafter("x/Qwen3-8B-4bit", target, TARGET_CFG, roots=[models, cache]).path == snap
    # shapes that do not fit are never picked; then only the registry repo remains (not here)
    wide = dict(TARGET_CFG, hidden_size=128)
    f = find_drafter("x/Qwen3-8B-4bit", target, wide, roots=[models, cache])
    assert f == Found(None, QWEN8, f.why)
    assert find_drafter("x/unknown", target, wide, roots=[models, cache]) is None


def _tiny_target(pairs, tmp_path, name):
    d = pairs("qwen3", version=2, hidden=64, layers=4, vocab=512)
    t = tmp_path / name
    shutil.copytree(d / "target", t)
    return d, t


@pytest.mark.slow
def test_load_finds_the_drafter_by_itself(pairs, tmp_path, monkeypatch):
    d, t = _tiny_target(pairs, tmp_path, "Qwen3-8B-4bit")
    models = tmp_path / "models"
    shutil.copytree(d / "drafter", models / "my-drafter")
    cfg = json.loads((models / "my-drafter" / "config.json").read_text())
    cfg["target_model"] = "Qwen/Qwen3-8B"
    (models / "my-drafter" / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("MLX_DFLASH_MODELS_DIR", str(models))
    _, _, dr = load(str(t))
    assert dr is not None and dr.version == 2
    assert load(str(t), auto_drafter=False)[2] is None
    # an explicit drafter always wins
    other = pairs("qwen3", version=1, hidden=64, layers=4, vocab=512)
    assert load(str(t), str(other / "drafter"))[2].version == 1


def test_missing_drafter_offline_is_one_line(pairs, tmp_path, monkeypatch, capsys):
    _, t = _tiny_target(pairs, tmp_path, "Qwen3-4B")
    monkeypatch.setenv("MLX_DFLASH_MODELS_DIR", str(tmp_path / "none"))
    monkeypatch.setattr(discovery, "hf_cache_dir", lambda: tmp_path / "empty-cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    m, tok, dr = load(str(t))
    assert dr is None and m is not None
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "z-lab/Qwen3-4B-DFlash-b16" in err and "mlx-dflash models pull" in err


def test_pull_fetches_the_target_and_its_drafter(tmp_path, monkeypatch):
    from mlx_dflash.models import manager
    from mlx_dflash.platform.hub import HubError

    got = []

    def fake_pull(repo, progress=True):
        got.append(repo)
        p = tmp_path / repo.replace("/", "--")
        p.mkdir(parents=True, exist_ok=True)
        (p / "config.json").write_text(json.dumps(_drafter_cfg() if "DFlash" in repo else TARGET_CFG))
        return p

    monkeypatch.setattr(manager, "pull", fake_pull)
    path, repo, dpath, problem = manager.pull_with_drafter("mlx-community/Qwen3-8B-4bit")
    assert got == ["mlx-community/Qwen3-8B-4bit", QWEN8] and repo == QWEN8 and dpath is not None
    got.clear()
    assert manager.pull_with_drafter(QWEN8)[1] is None and got == [QWEN8]  # a drafter: nothing more

    def failing(repo, progress=True):
        if "DFlash" in repo:
            raise HubError(f"cannot download '{repo}': no network")
        return fake_pull(repo)

    monkeypatch.setattr(manager, "pull", failing)
    path, repo, dpath, problem = manager.pull_with_drafter("Qwen/Qwen3-8B")
    assert dpath is None and "no network" in problem and path.exists()


def test_settings_model_dirs_are_scanned(tmp_path, monkeypatch):
    from mlx_dflash.settings.store import SettingsStore

    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLX_DFLASH_MODELS_DIR", raising=False)
    mine = tmp_path / "my-models"
    d = _put(mine / "qwen8-drafter", _drafter_cfg(2, target_model="Qwen/Qwen3-8B"))
    target = _put(tmp_path / "Qwen3-8B-8bit", TARGET_CFG)
    monkeypatch.setattr(discovery, "hf_cache_dir", lambda: tmp_path / "empty-cache")
    assert find_drafter("Qwen3-8B-8bit", target, TARGET_CFG).path is None  # only the registry's repo
    SettingsStore().set_global(model_dirs=[str(mine)])
    assert find_drafter("Qwen3-8B-8bit", target, TARGET_CFG).path == d
