import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Test modules (assertion-rewritten) and the package are compiled once and kept in
# __pycache__ (git ignores it) even where PYTHONDONTWRITEBYTECODE is set: compiling
# them again is most of what collecting the suite costs.
sys.dont_write_bytecode = False
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
if "MLX_DFLASH_HOME" not in os.environ:  # measured costs and settings go to a scratch home, not the user's
    import tempfile

    os.environ["MLX_DFLASH_HOME"] = tempfile.mkdtemp(prefix="mlx-dflash-tests-")

# Importing mlx_dflash builds and measures nothing (and imports no mlx): where the
# fast BLAS is not prepared yet (once per machine, as the CLI's first start does),
# prepare it in a child, then load it here before anything imports mlx.
from mlx_dflash.platform import fastblas  # noqa: E402

if not fastblas.ready():
    import subprocess

    subprocess.run([sys.executable, "-c", "from mlx_dflash.platform import fastblas; fastblas.prepare()"], cwd=ROOT,
                   check=False)
    fastblas.use_fast_blas()

import pytest  # noqa: E402

from mlx_dflash.engine import calibrate  # noqa: E402


@pytest.fixture
def fresh_costs(tmp_path, monkeypatch):
    """Cost curves go to a temporary cache dir, measured afresh per test (test_adaptive, test_guard*)."""
    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path))
    monkeypatch.setattr(calibrate, "DEFAULT", calibrate.Calibration())


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """A byte-level BPE tokenizer of 512 ids, the vocabulary of the tiny family models."""
    from make_test_pair import write_tokenizer
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, 512)
    return load_tokenizer(d)


@pytest.fixture(scope="session")
def pairs(tmp_path_factory):
    """Small random target + drafter pairs per family, made by make_test_pair."""
    from make_test_pair import make_drafter, make_target

    made = {}

    def get(family="qwen3", version=1, hidden=64, layers=3, vocab=512, seed=0, draft_layers=1, block_size=16):
        key = (family, version, hidden, layers, vocab, seed, draft_layers, block_size)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{family}-v{version}")
            t = make_target(out / "target", family, hidden, layers, vocab, seed)
            make_drafter(out / "drafter", t["config"], t["special_ids"]["<|mask|>"], version=version,
                         layers=draft_layers, block_size=block_size, seed=seed)
            made[key] = out
        return made[key]

    return get


@pytest.fixture
def chat_backend(pairs, tmp_path, monkeypatch):
    """The chat app's model manager with a small random pair registered as a model
    folder in a scratch MLX_DFLASH_HOME (tests/chat_pilot.py drives the app on it)."""
    from chat_pilot import FolderBackend

    from mlx_dflash.settings.store import SettingsStore

    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))  # no models from the user's cache
    store = SettingsStore()
    store.set_global(model_dirs=[str(pairs())])
    return FolderBackend(store)


@pytest.fixture
def world(tmp_path, monkeypatch, pairs):
    """The model-manager tests' world of models (tests/model_world.py)."""
    from model_world import make_world

    return make_world(tmp_path, monkeypatch, pairs)


@pytest.fixture(scope="module")
def serve_models(pairs, tmp_path_factory):
    """(model folder, settings home) for `mlx-dflash serve` processes (tests/serve_process.py)."""
    from serve_process import make_serve_models

    return make_serve_models(pairs, tmp_path_factory)
