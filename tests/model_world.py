"""A world of models for the model-manager tests (the `world` fixture in
tests/conftest.py): embedded models, user folders and a fake Hugging Face cache
in the real hub layout, made from the small random test pairs."""

import json
import os
import shutil
from pathlib import Path


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


def make_world(tmp_path, monkeypatch, pairs) -> dict:
    """Embedded: target + dflash2 (block 8) + draft-ar; folders: a flat target, a
    DFlash 1 drafter, a drafter for a wider model; HF cache: a target, a DFlash 2
    drafter, a tiny draft model, a dataset and a repo without weights."""
    from mlx_dflash.models.settings_checks import settings_store

    v2, v1 = pairs(version=2, block_size=8), pairs(version=1)
    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    emb = tmp_path / "embedded"
    copy_model(v2 / "target", emb / "target")
    copy_model(v2 / "drafter", emb / "dflash2")
    copy_model(v2 / "target", emb / "draft-ar", mlx_dflash={"role": "draft"})
    monkeypatch.setattr("mlx_dflash.models.discovery.models_dir", lambda: emb)
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
    from mlx_dflash.models.discovery import discover

    return {e.id: e for e in discover(store)}
