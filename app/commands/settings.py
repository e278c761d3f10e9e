"""`mlx-dflash settings get|set|reset [MODEL] [KEY] [VALUE]`.

    settings get                      everything
    settings get port                 a global setting
    settings get MODEL [KEY]          a model's settings (defaults included)
    settings set port 8080            a global setting
    settings set MODEL KEY VALUE      a model setting ("none" clears an optional one)
    settings reset [MODEL] [KEY]      back to defaults (everything: --yes)
    settings path                     where the file is
"""

from __future__ import annotations

import json


def add_parser(sub):
    p = sub.add_parser("settings", help="per-model and global settings", description=__doc__.split("\n\n")[1],
                       formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["get", "set", "reset", "path"])
    p.add_argument("args", nargs="*", metavar="MODEL|KEY|VALUE")
    p.add_argument("--json", action="store_true", help="get: print JSON")
    p.add_argument("--yes", "-y", action="store_true", help="reset: confirm resetting everything")


def _is_global(store, name: str) -> bool:
    from mlx_dflash.settings.schema import GLOBAL_KEYS, SettingsError

    if name not in GLOBAL_KEYS:
        return False
    try:  # a model may be named like a global key; its settings win
        return name not in store.models()
    except SettingsError:  # corrupt file: a global key is meant
        return True


def _model_view(store, model_id: str) -> dict:
    from mlx_dflash.settings.schema import MODEL_KEYS

    s = store.model(model_id)
    return {k: getattr(s, f) for k, f in MODEL_KEYS.items()}


SECRET_KEYS = ("api_key",)


def mask(value):
    """A secret as shown: never whole (it would land in terminal scrollback and logs)."""
    if not value:
        return value
    return "****" + (value[-4:] if len(value) >= 12 else "")


def _globals_shown(g) -> dict:
    from dataclasses import asdict

    return {k: mask(v) if k in SECRET_KEYS else v for k, v in asdict(g).items()}


def _print(value, as_json: bool, notes=None) -> None:
    notes = notes or {}
    if isinstance(value, dict) and not as_json:
        for k, v in value.items():
            print(f"{k} = {json.dumps(v)}" + (f"  # {notes[k]}" if k in notes else ""))
    else:
        print(json.dumps(value, indent=2 if isinstance(value, dict) else None)
              + (f"  # {notes['']}" if "" in notes and not as_json else ""))


def resolved_notes(store, model_id: str, view: dict) -> dict:
    """What the `auto` values of a model's settings resolve to on this machine
    (key -> one line): the drafter's precision, and the compute dtype once measured."""
    from mlx_dflash.models import dtype_choice
    from mlx_dflash.models.discovery import discover
    from mlx_dflash.models.drafter_precision import quant_label, resolve_quant_bits
    from mlx_dflash.models.model_names import find
    from mlx_dflash.platform.hub import HubError

    notes = {}
    if view.get("drafter.quant_bits") == "auto":
        bits, why = resolve_quant_bits("auto")
        notes["drafter.quant_bits"] = f"{quant_label(bits)} here ({why})"
    if view.get("dtype") == "auto":
        try:
            setting, src = dtype_choice.requested("auto")
        except ValueError as e:
            notes["dtype"] = str(e)
            return notes
        if setting != "auto":
            notes["dtype"] = f"{setting} (from {src})"
        elif dtype_choice.backend() != "cpu":
            notes["dtype"] = "the checkpoint's (Metal)"
        else:
            try:
                e = find(model_id, discover(store), store)
            except HubError:
                e = None
            hit = dtype_choice.cached(e.path) if e is not None else None
            notes["dtype"] = (f"{hit['name']} here ({hit['why']})" if hit else
                              "the faster of the checkpoint's and float32, measured at the first load here")
    return notes


def _get(store, a, as_json) -> int:
    from mlx_dflash.settings.schema import (
        SettingsError,  # a ValueError: the CLI prints one line, exits 2
        model_field,
    )

    if len(a) > 2:
        raise SettingsError("usage: mlx-dflash settings get [MODEL] [KEY]")
    if not a:
        out = {"file": str(store.path), "global": _globals_shown(store.globals()),
               "models": {m: store.explicit(m) for m in store.models()}}
        if as_json:
            print(json.dumps(out, indent=2))
        else:
            print(f"# {store.path}")
            _print(out["global"], False)
            for m, kv in out["models"].items():
                print(f"[{m}]")
                _print(kv, False)
        return 0
    if len(a) == 1 and _is_global(store, a[0]):
        _print(_globals_shown(store.globals())[a[0]], as_json)
        return 0
    if len(a) == 2:
        model_field(a[1])  # unknown key -> one-line error listing the valid ones
    model_id, kind = _model(store, a[0])
    if kind is None and model_id not in store.models():  # no such model, setting, or saved settings
        raise SettingsError(_unknown_name(store, a[0]))
    view = _model_view(store, model_id)
    if len(a) == 1:
        _print(view, as_json, None if as_json else resolved_notes(store, model_id, view))
        return 0
    from mlx_dflash.settings.schema import MODEL_KEYS

    key = a[1] if a[1] in MODEL_KEYS else next(k for k, f in MODEL_KEYS.items() if f == a[1])
    note = None if as_json else resolved_notes(store, model_id, {key: view[key]}).get(key)
    _print(view[key], as_json, {"": note} if note else None)
    return 0


def _model(store, name: str):
    """(the listed id of the model `name` refers to, its kind label), or (name, None)
    when no such model is installed (settings may precede a download)."""
    from mlx_dflash.models.discovery import discover
    from mlx_dflash.models.model_names import find
    from mlx_dflash.platform.hub import HubError

    try:
        e = find(name, discover(store), store)
    except HubError:
        e = None
    return (e.id, e.kind_label) if e is not None else (name, None)


def _unknown_name(store, word: str) -> str:
    """`settings get WORD` where WORD is no setting, no model here and no model with saved settings."""
    from mlx_dflash.models.discovery import discover
    from mlx_dflash.settings.schema import GLOBAL_KEYS, did_you_mean

    near = did_you_mean(word, [*GLOBAL_KEYS, *(e.id for e in discover(store)), *store.models()])
    return (f"'{word}' is no setting and no model here{near}; `mlx-dflash settings get` shows them all, "
            "`mlx-dflash models list` lists the models")


def _unknown_key(word: str) -> str:
    from mlx_dflash.settings.schema import GLOBAL_KEYS, MODEL_KEYS, did_you_mean

    return f"unknown setting '{word}'{did_you_mean(word, [*GLOBAL_KEYS, *MODEL_KEYS])}"


def _set(store, a) -> int:
    from mlx_dflash.settings.schema import (
        MODEL_KEYS,
        SettingsError,  # a ValueError: the CLI prints one line, exits 2
        model_field,
        parse_value,
    )

    if len(a) == 2 and _is_global(store, a[0]):
        g = store.set_global(**{a[0]: parse_value(a[0], a[1])})
        print(f"{a[0]} = {json.dumps(_globals_shown(g)[a[0]])}")
        return 0
    if len(a) == 2 and a[0] in MODEL_KEYS:
        raise SettingsError(f"'{a[0]}' is a model setting; name the model: mlx-dflash settings set MODEL {a[0]} {a[1]}")
    if len(a) == 1 and _is_global(store, a[0]):
        raise SettingsError(f"the value is missing: mlx-dflash settings set {a[0]} VALUE")
    if len(a) == 2 and (a[1] in MODEL_KEYS or a[1] in MODEL_KEYS.values()):
        raise SettingsError(f"the value is missing: mlx-dflash settings set {a[0]} {a[1]} VALUE")
    if len(a) == 2:
        raise SettingsError(f"{_unknown_key(a[0])}; usage: settings set GLOBAL_KEY VALUE or settings set MODEL KEY VALUE")
    if len(a) != 3:
        raise SettingsError("usage: mlx-dflash settings set MODEL KEY VALUE  (or: settings set GLOBAL_KEY VALUE)")
    model_id, key, text = a
    name = model_field(key)
    model_id, kind = _model(store, model_id)
    if kind not in (None, "target"):
        raise SettingsError(f"'{model_id}' is a {kind}; settings apply to target models")
    s = store.set_model(model_id, **{name: parse_value(name, text)})
    shown = key if key in MODEL_KEYS else next(k for k, f in MODEL_KEYS.items() if f == name)
    print(f"{model_id}: {shown} = {json.dumps(getattr(s, name))}")
    if kind is None:
        print(f"note: no model '{model_id}' is installed; the setting applies once it is "
              "(see `mlx-dflash models list`)")
    return 0


def _reset(store, a, yes) -> int:
    from mlx_dflash.settings.schema import SettingsError  # a ValueError: the CLI prints one line, exits 2

    if not a:
        if not yes:
            raise SettingsError(f"this resets every setting in {store.path}; add --yes to confirm")
        store.reset_all()
        print(f"all settings reset ({store.path})")
        return 0
    if len(a) == 1 and _is_global(store, a[0]):
        store.reset_global(a[0])
        print(f"{a[0]} reset")
        return 0
    if len(a) > 2:
        raise SettingsError("usage: mlx-dflash settings reset [MODEL] [KEY]")
    store.reset_model(_model(store, a[0])[0], a[1] if len(a) == 2 else None)
    print(f"{a[0]}: {a[1] + ' reset' if len(a) == 2 else 'all settings reset'}")
    return 0


def _store(action: str):
    """The settings file; what writes it checks against the model files too
    (models.settings_checks, which loads mlx). Reading needs neither."""
    if action in ("get", "path"):
        from mlx_dflash.settings.store import SettingsStore

        return SettingsStore()
    from mlx_dflash.models.settings_checks import settings_store

    return settings_store()


def run(args) -> int:
    store = _store(args.action)
    if args.action == "path":
        print(store.path)
        return 0
    if args.action == "get":
        return _get(store, args.args, args.json)
    if args.action == "set":
        return _set(store, args.args)
    return _reset(store, args.args, args.yes)
