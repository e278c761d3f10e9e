"""The settings checks that need model files (the drafter exists and fits the
target, the block size fits the drafter, the default model is a target), given
to the settings store as its checker: the dependency runs one way, to settings."""

from __future__ import annotations

from ..drafting.drafter_config import DrafterConfig, DrafterError
from ..platform.hub import HubError
from ..settings.schema import ModelSettings, SettingsError
from ..settings.store import SettingsStore
from .discovery import discover, pair_problem
from .model_names import drafter_ref, find, resolve
from ..policy.registry import fit_block_size


def check_settings(model_id: str, s: ModelSettings, store: SettingsStore, explicit_block: bool = True) -> None:
    """Checks that need the model files: the drafter is a DFlash drafter found here
    that fits the target, and the block size does not exceed the drafter's trained
    one. An unknown target passes (settings may precede a download); load_model re-checks."""
    entries = discover(store)
    try:
        target = find(model_id, entries, store)
    except HubError:
        target = None
    if target is not None and target.kind != "target":
        raise SettingsError(f"'{model_id}' is a {target.kind_label}; settings apply to target models")
    if s.drafter:
        did, _, cfg = drafter_ref(s.drafter, entries, store)
        try:
            dc = DrafterConfig.from_dict(cfg)
        except DrafterError as e:
            raise SettingsError(f"drafter '{did}' is incompatible: {e}") from None
        if target is not None:
            why = pair_problem(target.config, cfg)
            if why:
                raise SettingsError(f"drafter '{did}' is incompatible with '{model_id}': {why}")
        block = dc.block_size
    elif target is not None and target.compatible_drafters:
        did = target.compatible_drafters[0]
        block = next(e.block_size for e in entries if e.id == did)
    else:
        return
    try:
        fit_block_size(s.block_size, block, explicit_block)
    except ValueError as e:
        raise SettingsError(f"block_size: {e} (drafter '{did}')") from None


class FileChecks:
    """The settings checks that need model files, for SettingsStore(checker=...)."""

    def model(self, store, model_id: str, new: ModelSettings, explicit_block: bool) -> None:
        check_settings(model_id, new, store, explicit_block)

    def globals(self, store, new, changed: set) -> None:
        if "default_model" in changed and new.default_model is not None:
            e = resolve(new.default_model, store)  # unknown: one line with the command that downloads it
            if e.kind != "target":
                raise SettingsError(f"default_model: '{e.id}' is a {e.kind_label}; pick a target "
                                    "from `mlx-dflash models list --targets`")


def settings_store(path=None, **kw) -> SettingsStore:
    """The settings file with every check, model files included (what the CLI, the
    chat and the server write through)."""
    return SettingsStore(path, checker=FileChecks(), **kw)
