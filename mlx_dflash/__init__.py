"""mlx-dflash: lossless DFlash / DFlash 2 speculative decoding on MLX."""

from .fastblas import use_fast_blas

use_fast_blas()  # must precede the first `import mlx` (see fastblas.py)

from .generate import GenerationResponse, GenerationResult, PromptCache, generate, stream_generate  # noqa: E402
from .manager import load  # noqa: E402  (loader.load, taking any model name `models list` prints)

__version__ = "0.1.0"
__all__ = ["load", "generate", "stream_generate", "GenerationResponse", "GenerationResult", "PromptCache"]
