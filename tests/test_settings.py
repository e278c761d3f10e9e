"""Settings file: round trip, atomic and locked writes, corrupt and unknown
content, validation messages, the `mlx-dflash settings` command."""

import json
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import pytest

from mlx_dflash.settings.store import SettingsStore, atomic_write, remove_stale_temps
from mlx_dflash.settings.schema import GlobalSettings, ModelSettings, SettingsError
from mlx_dflash.settings.schema import parse_value, verify_modes
from tiers import fast_first


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    empty = tmp_path / "embedded"
    empty.mkdir()
    monkeypatch.setattr("mlx_dflash.models.discovery.models_dir", lambda: empty)
    return SettingsStore()


@pytest.mark.slow
def test_home_env_and_defaults(store, tmp_path):
    assert store.path == tmp_path / "home" / "settings.json"
    assert not store.path.exists()
    assert store.model("any/model") == ModelSettings()
    assert store.globals() == GlobalSettings()


def test_round_trip(store, tmp_path):
    store.set_model("org/a", block_size=4, temperature=0.7, **{"dflash.enabled": False, "drafter.quant_bits": 4})
    store.set_model("org/a", system_prompt="be brief", top_k=20)
    store.set_model("b", verify_mode="off", max_context=1024, drafter=str(tmp_path / "nowhere"))
    store.set_global(port=9001, model_dirs=[str(tmp_path / "m")], default_model="org/a", api_key="k")
    fresh = SettingsStore(store.path)
    a = fresh.model("org/a")
    assert (a.block_size, a.temperature, a.dflash_enabled, a.drafter_quant_bits, a.system_prompt, a.top_k) == \
        (4, 0.7, False, 4, "be brief", 20)
    assert a.top_p == ModelSettings().top_p  # unset keys keep their defaults
    assert fresh.model("b").verify_mode == "off" and fresh.model("b").max_context == 1024
    g = fresh.globals()
    assert (g.port, g.model_dirs, g.default_model, g.api_key) == (9001, [str(tmp_path / "m")], "org/a", "k")
    raw = json.loads(store.path.read_text())
    assert raw["version"] == 1
    # only what the user set is stored, under the user-facing names
    assert set(raw["models"]["org/a"]) == {"block_size", "temperature", "dflash.enabled", "drafter.quant_bits",
                                           "system_prompt", "top_k"}
    fresh.reset_model("org/a", "top_k")
    assert "top_k" not in SettingsStore(store.path).explicit("org/a")
    fresh.reset_model("org/a")
    assert SettingsStore(store.path).model("org/a") == ModelSettings()
    fresh.reset_global("port")
    assert SettingsStore(store.path).globals().port == GlobalSettings().port


def test_generation_kwargs_fit_stream_generate():
    from dataclasses import fields

    from mlx_dflash import DecodeConfig
    from mlx_dflash.policy.registry import VERIFY_MODES

    kw = ModelSettings(block_size=3, temperature=0.5).generation_kwargs()
    assert set(kw) <= {f.name for f in fields(DecodeConfig)}  # what stream_generate takes
    assert DecodeConfig(**kw).block_size == 3
    assert kw["block_size"] == 3 and kw["temperature"] == 0.5 and kw["verify_mode"] == "dflash"
    assert ModelSettings(dflash_enabled=False).generation_kwargs()["verify_mode"] == "off"
    adaptive = ModelSettings(verify_mode="adaptive").generation_kwargs()["verify_mode"]
    assert adaptive == ("adaptive" if "adaptive" in VERIFY_MODES else "dflash")
    assert "adaptive" in verify_modes()


def test_interrupted_write_keeps_old_file(store, monkeypatch):
    store.set_model("m", top_k=3)
    before = store.path.read_text()

    def boom(*a):
        raise OSError("disk full")

    for target in ("os.fsync", "os.replace"):
        with monkeypatch.context() as m:
            m.setattr(target, boom)
            with pytest.raises(SettingsError, match="disk full.*nothing was changed"):  # one line, no traceback
                store.set_model("m", top_k=9)
        assert store.path.read_text() == before
        assert store.model("m").top_k == 3
        assert [p.name for p in store.path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_atomic_write_interrupted_midway(tmp_path, monkeypatch):
    p = tmp_path / "f.json"
    p.write_text("old")

    class Half:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, s):
            self.f.write(s[: len(s) // 2])
            raise KeyboardInterrupt  # killed halfway through

    real = os.fdopen
    monkeypatch.setattr("os.fdopen", lambda *a, **k: Half(real(*a, **k)))
    with pytest.raises(KeyboardInterrupt):
        atomic_write(p, "new content")
    assert p.read_text() == "old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["f.json"]


BAD_FILES = {
    "truncated JSON": (b'{"version": 1, "models": {"m": {"top_k": 3}', "invalid JSON at line 1"),
    "UTF-16": ('{"version": 1, "global": {"port": 9000}}'.encode("utf-16"), "UTF-16"),
    "not UTF-8": (b'{"version": 1, "global": {"host": "\xff\xfe\x80"}}', "not UTF-8"),
    "huge integer": (b'{"version": 1, "global": {"port": ' + b"9" * 5000 + b"}}", "unreadable JSON"),
    "nested deep": (b'{"version": 1, "models": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    "a list": (b"[1, 2]", "expected an object"),
    "version text": (b'{"version": "one"}', "version 'one' is not a number"),
    "models a list": (b'{"models": []}', "expected an object"),
}


@pytest.mark.parametrize("name", fast_first(BAD_FILES))
def test_unreadable_file_is_copied_aside_and_defaults_apply(store, capsys, name):
    data, why = BAD_FILES[name]
    store.path.parent.mkdir(parents=True)
    store.path.write_bytes(data)
    assert store.model("m") == ModelSettings() and store.globals() == GlobalSettings()
    backups = list(store.path.parent.glob("settings.json.corrupt-*"))
    assert len(backups) == 1 and backups[0].read_bytes() == data  # nothing lost
    assert store.path.read_bytes() == data  # left in place: an editor may still be writing it
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and why in err and str(store.path) in err and str(backups[0]) in err
    store.set_model("m", top_k=5)  # and the store works on
    assert SettingsStore(store.path).model("m").top_k == 5
    assert capsys.readouterr().err == ""


def _edit_in_place(path: Path, text: str, pause: float):
    """An editor's save: truncate, write half, pause, write the rest (same inode)."""
    with open(path, "r+", encoding="utf-8") as f:
        f.truncate(0)
        f.write(text[: len(text) // 2])
        f.flush()
        time.sleep(pause)
        f.write(text[len(text) // 2:])


def test_a_read_during_an_editors_save_loses_nothing(store, capsys):
    store.set_model("m", top_k=3)
    assert store.model("m").top_k == 3
    text = json.dumps({"version": 1, "models": {"m": {"top_k": 7}}}, indent=2)
    t = threading.Thread(target=_edit_in_place, args=(store.path, text, 0.3))
    t.start()
    time.sleep(0.1)
    assert store.model("m").top_k == 7  # read mid-save: waited for the file to settle
    t.join()
    assert store.path.read_text() == text
    assert list(store.path.parent.glob("settings.json.corrupt-*")) == [] and capsys.readouterr().err == ""


def test_a_running_process_keeps_its_last_good_settings(store, capsys, monkeypatch):
    monkeypatch.setattr("mlx_dflash.settings.store.SETTLE", 0.05)
    store.set_model("m", top_k=4)
    assert store.model("m").top_k == 4
    store.path.write_text('{"version": 1, "models": {"m": {"top_k": 9')  # saved broken
    for _ in range(3):
        assert store.model("m").top_k == 4  # the last good settings, not the defaults
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "still using the settings read before" in err  # named once
    assert store.path.read_text().endswith("9")  # left for the user to fix
    store.path.write_text('{"version": 1, "models": {"m": {"top_k": 9}}}')  # fixed: seen at once
    assert store.model("m").top_k == 9
    assert len(list(store.path.parent.glob("settings.json.corrupt-*"))) == 1


def test_reads_are_cached_until_the_file_changes(store, monkeypatch):
    store.set_model("m", top_k=4)
    old = time.time() - 10  # a file not changed for a while is not parsed again
    os.utime(store.path, (old, old))
    assert store.model("m").top_k == 4
    calls = []
    real = SettingsStore._problem
    monkeypatch.setattr(SettingsStore, "_problem", lambda self, data: calls.append(1) or real(self, data))
    for _ in range(5):
        assert store.model("m").top_k == 4
    assert calls == []
    store.path.write_text('{"version": 1, "models": {"m": {"top_k": 5}}}')  # same size, new mtime
    assert store.model("m").top_k == 5 and calls == [1]


def test_stale_temp_files_of_ours_are_removed_at_start(tmp_path):
    old = time.time() - 120
    ours = [tmp_path / ".settings.json.abc12345.tmp", tmp_path / ".20260101-x.json.k2j4h5l6.tmp"]
    fresh = tmp_path / ".settings.json.zzzz9999.tmp"  # a writer may be using it now
    others = [tmp_path / "notes.tmp", tmp_path / "settings.json.corrupt-1", tmp_path / ".hidden.tmp"]
    for p in (*ours, fresh, *others):
        p.write_text("x")
    for p in (*ours, *others):
        os.utime(p, (old, old))
    assert remove_stale_temps(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (fresh, *others))
    (tmp_path / ".b.json.qqqqqqqq.tmp").write_text("x")
    os.utime(tmp_path / ".b.json.qqqqqqqq.tmp", (old, old))
    SettingsStore(tmp_path / "settings.json")  # a store cleans its folder when it starts
    assert not (tmp_path / ".b.json.qqqqqqqq.tmp").exists()


def test_a_folder_in_place_of_the_file_is_moved_aside(store, capsys):
    (store.path / "x").mkdir(parents=True)
    assert store.globals() == GlobalSettings()
    assert "a folder, not a file" in capsys.readouterr().err
    assert [p.is_dir() for p in store.path.parent.glob("settings.json.corrupt-*")] == [True]
    store.set_global(port=8001)
    assert SettingsStore(store.path).globals().port == 8001


@pytest.mark.slow
def test_second_bad_file_gets_its_own_backup(store):
    store.path.parent.mkdir(parents=True)
    store.path.write_text("{")
    store.globals()
    store.path.write_text("[")  # corrupt again, within the same second: a second backup
    store.set_model("m", top_k=6)
    assert sorted(p.read_text() for p in store.path.parent.glob("settings.json.corrupt-*")) == ["[", "{"]
    assert store.model("m").top_k == 6


@pytest.mark.parametrize("entry", [{"global": {"port": 10 ** 400}}, {"models": {"m": {"temperature": 10 ** 400}}},
                                   {"models": {"m": {"top_p": 1e400}}}, {"models": {"m": {"block_size": 10 ** 30,
                                                                                      "max_tokens": -10 ** 30}}}])
def test_huge_numbers_fall_back_to_defaults(store, capsys, entry):
    store.path.parent.mkdir(parents=True)
    store.path.write_text(json.dumps({"version": 1, **entry}).replace("Infinity", "1e400"))
    assert store.globals() == GlobalSettings()
    assert store.model("m").temperature == 0.0 and store.model("m").max_tokens == ModelSettings().max_tokens
    assert "Traceback" not in capsys.readouterr().err


def test_settings_do_not_import_the_manager():
    """One-way: manager -> settings. The checks that need model files come in as a checker."""
    import ast

    import mlx_dflash.settings.store as S

    tree = ast.parse(Path(S.__file__).read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in mods if m and ("manager" in m or "discovery" in m)}, mods


def test_unknown_and_bad_keys_warn_and_survive(store, capsys):
    store.path.parent.mkdir(parents=True)
    store.path.write_text(json.dumps({
        "version": 1, "extra": {"x": 1},
        "global": {"port": 8100, "theme": "dark"},
        "models": {"m": {"top_k": 7, "speed": "fast", "block_size": "many", "temperature": 2}},
    }))
    s = store.model("m")
    assert s.top_k == 7 and s.temperature == 2.0
    assert s.block_size == ModelSettings().block_size  # bad value: default, not a crash
    assert store.globals().port == 8100
    err = capsys.readouterr().err
    assert "speed" in err and "block_size" in err and "extra" in err and "theme" in err
    store.model("m")
    assert capsys.readouterr().err == ""  # warned once per store, not on every read
    store.set_model("m", top_p=0.9)
    raw = json.loads(store.path.read_text())
    assert raw["models"]["m"]["speed"] == "fast" and raw["global"]["theme"] == "dark" and raw["extra"] == {"x": 1}


def test_invalid_value_in_file_falls_back_to_defaults(store, capsys):
    store.path.parent.mkdir(parents=True)
    store.path.write_text(json.dumps({"version": 1, "models": {"m": {"verify_mode": "turbo", "top_k": 4}}}))
    assert store.model("m") == ModelSettings()
    assert "turbo" in capsys.readouterr().err


VALIDATION = [
    ({"verify_mode": "turbo"}, "unknown verify mode 'turbo'; valid: " + ", ".join(verify_modes())),
    ({"block_size": 0}, "block_size must be >= 1"),
    ({"block_size": "x"}, "block_size must be an integer"),
    ({"drafter_quant_bits": 3}, "drafter.quant_bits must be none, 4 or 8"),
    ({"drafter_quant_group_size": 48}, "drafter.quant_group_size must be 32, 64 or 128"),
    ({"drafter_activation_dtype": "int8"}, "unknown drafter.activation_dtype 'int8'"),
    ({"temperature": -1}, "temperature must be >= 0"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"top_k": -2}, "top_k must be >= 0"),
    ({"min_p": 1.5}, "min_p must be in [0, 1)"),
    ({"min_p": 1.0}, "min_p must be in [0, 1)"),  # generation refuses it, so settings do too
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_context": 0}, "max_context must be >= 1"),
    ({"dflash_enabled": "maybe"}, "dflash.enabled must be true or false"),
    ({"block_size": None}, "block_size cannot be empty"),
    ({"speed": 3}, "unknown model setting 'speed'; valid: dflash.enabled, drafter, guard, block_size"),
    ({"dtype": "int4"}, "unknown dtype 'int4'; valid: auto, float32, bfloat16, float16"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
]


@pytest.mark.parametrize("changes,message", VALIDATION)
def test_validation_messages(store, changes, message):
    store.set_model("m", top_k=1)
    before = store.path.read_text()
    with pytest.raises(SettingsError) as e:
        store.set_model("m", **changes)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert store.path.read_text() == before  # nothing written


@pytest.mark.parametrize("changes,message", [
    ({"port": 0}, "port must be in 1..65535"),
    ({"port": "http"}, "port must be an integer"),
    ({"host": ""}, "host cannot be empty"),
    ({"colour": "red"}, "unknown global setting 'colour'"),
    ({"max_batch": 0}, "max_batch must be auto or in 1..64"),
    ({"max_batch": "65"}, "max_batch must be auto or in 1..64"),
    ({"max_batch": "many"}, "max_batch must be auto or an integer"),
    ({"max_batch": 2.5}, "max_batch must be int"),
])
def test_global_validation_messages(store, changes, message):
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(".", r"\.")):
        store.set_global(**changes)


def test_max_batch_is_auto_by_default_and_takes_auto_or_an_integer(store):
    assert store.globals().max_batch == "auto"
    assert store.set_global(max_batch="8").max_batch == 8 and store.globals().max_batch == 8
    assert store.set_global(max_batch=" Auto ").max_batch == "auto" and store.globals().max_batch == "auto"
    assert store.set_global(max_batch=64).max_batch == 64
    assert parse_value("max_batch", "auto") == "auto" and parse_value("max_batch", "1") == 1


def test_parse_value():
    assert parse_value("dflash_enabled", "off") is False and parse_value("dflash_enabled", "Yes") is True
    assert parse_value("block_size", " 4 ") == 4 and parse_value("temperature", "0.5") == 0.5
    assert parse_value("drafter_quant_bits", "none") is None and parse_value("drafter", "null") is None
    assert parse_value("model_dirs", "/a, /b") == ["/a", "/b"]
    assert parse_value("system_prompt", "hi there") == "hi there"


def test_lock_timeout_is_one_line(store):
    from filelock import FileLock

    store.set_model("m", top_k=1)
    slow = SettingsStore(store.path, lock_timeout=0.05)
    with FileLock(str(store.path) + ".lock"):
        with pytest.raises(SettingsError, match="locked by another process"):
            slow.set_model("m", top_k=2)
    assert slow.model("m").top_k == 1


def _writer(path, who, n):
    store = SettingsStore(path)
    for i in range(n):
        store.set_model(f"{who}-{i}", top_k=i + 1)  # a new key each time: any lost update shows
        store.set_model(who, max_tokens=i + 1)


@pytest.mark.slow
def test_two_processes_lose_nothing(tmp_path):
    path = tmp_path / "settings.json"
    n = 25
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(path), w, n)) for w in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    raw = json.loads(path.read_text())["models"]
    for w in ("a", "b"):
        assert raw[w] == {"max_tokens": n}
        assert all(raw[f"{w}-{i}"] == {"top_k": i + 1} for i in range(n))
    assert len(raw) == 2 * n + 2


def _cli(*argv):
    from app.cli import main

    return main(list(argv))


def test_settings_cli(store, capsys):
    assert _cli("settings", "set", "org/m", "block_size", "3") == 0
    assert _cli("settings", "set", "org/m", "dflash.enabled", "off") == 0
    assert _cli("settings", "set", "port", "8123") == 0
    capsys.readouterr()
    assert _cli("settings", "get", "org/m", "block_size") == 0
    assert capsys.readouterr().out.strip() == "3"
    assert _cli("settings", "get", "port") == 0
    assert capsys.readouterr().out.strip() == "8123"
    assert _cli("settings", "get", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["models"]["org/m"] == {"block_size": 3, "dflash.enabled": False} and out["global"]["port"] == 8123
    assert _cli("settings", "reset", "org/m", "block_size") == 0
    assert store.model("org/m").block_size == ModelSettings().block_size and not store.model("org/m").dflash_enabled
    # user errors: one line, exit 2, nothing changed
    before = store.path.read_text()
    for argv in (("settings", "set", "org/m", "verify_mode", "turbo"), ("settings", "set", "block_size", "4"),
                 ("settings", "set", "org/m", "nope", "1"), ("settings", "reset")):
        capsys.readouterr()
        assert _cli(*argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err
    assert store.path.read_text() == before
    assert _cli("settings", "reset", "--yes") == 0
    assert json.loads(store.path.read_text())["models"] == {}


@pytest.mark.slow
def test_settings_cli_recovers_from_any_file(store, capsys):
    store.path.parent.mkdir(parents=True)
    store.path.write_bytes(b"[" * 50_000)
    assert _cli("settings", "set", "port", "8123") == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(store.path) in err and "settings.json.corrupt-" in err
    assert [p.read_bytes() for p in Path(store.path.parent).glob("settings.json.corrupt-*")] == [b"[" * 50_000]
    assert store.globals().port == 8123


@pytest.mark.parametrize("argv,hint", [
    (("settings", "set", "portt", "1"), "did you mean 'port'"),
    (("settings", "set", "org/m", "blok_size", "3"), "did you mean 'block_size'"),
    (("settings", "get", "org/m", "temprature"), "did you mean 'temperature'"),
    (("settings", "set", "org/m", "temperature", "nan"), "temperature must be a finite number"),
])
def test_settings_cli_suggests(store, capsys, argv, hint):
    assert _cli(*argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and hint in err, err
    assert not store.path.exists()


def test_settings_cli_masks_the_api_key(store, capsys):
    key = "sk-verysecret-1234"
    assert _cli("settings", "set", "api_key", key) == 0
    for argv in (("settings", "get"), ("settings", "get", "--json"), ("settings", "get", "api_key")):
        assert _cli(*argv) == 0
    out = capsys.readouterr().out
    assert key not in out and "****1234" in out
    assert store.globals().api_key == key  # stored as given


@pytest.mark.slow
def test_models_list_into_a_closed_pipe_ends_quietly(store):
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    cmd = f"'{sys.executable}' -m app.cli settings get --json | head -c 1 >/dev/null; echo rc=${{PIPESTATUS[0]}}"
    big = {f"org/m{i}": {"top_k": i + 1} for i in range(3000)}  # more than a pipe buffer of output
    store.path.parent.mkdir(parents=True, exist_ok=True)
    store.path.write_text(json.dumps({"version": 1, "global": {}, "models": big}))
    r = subprocess.run(["bash", "-c", cmd], cwd=root, capture_output=True, text=True, timeout=300)
    assert "rc=0" in r.stdout and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr
