"""mlx-dflash: lossless DFlash / DFlash 2 speculative decoding on MLX.

The public API is resolved on first use (PEP 562), so `import mlx_dflash` stays
cheap: the CLI's `--help` and `settings` import neither mlx nor mlx-lm."""

from importlib import import_module

from .platform.fastblas import use_fast_blas

use_fast_blas()  # must precede the first `import mlx` (see fastblas.py); every import of mlx goes through here

__version__ = "0.1.0"

# public name -> the module (under mlx_dflash) that defines it
_PUBLIC = {
    "load": "models.manager",  # loader.load, taking any model name `models list` prints
    "generate": "engine.generate",
    "stream_generate": "engine.generate",
    "GenerationResult": "engine.generate",
    "Decoder": "engine.decoder",
    "DecodeConfig": "engine.decode_config",
    "GenerationResponse": "engine.stats",
    "GenerationStats": "engine.stats",
    "PromptCache": "cache.prompt_cache",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'mlx_dflash' has no attribute '{name}'")
    value = getattr(import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value  # once: later lookups do not come back here
    return value


def __dir__():
    return sorted({*globals(), *_PUBLIC})
