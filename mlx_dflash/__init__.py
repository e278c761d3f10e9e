"""mlx-dflash: lossless DFlash / DFlash 2 speculative decoding on MLX."""

from .platform.fastblas import use_fast_blas

use_fast_blas()  # must precede the first `import mlx` (see fastblas.py)

from .cache.prompt_cache import PromptCache  # noqa: E402
from .engine.decode_config import DecodeConfig  # noqa: E402
from .engine.decoder import Decoder  # noqa: E402
from .engine.generate import GenerationResult, generate, stream_generate  # noqa: E402
from .engine.stats import GenerationResponse, GenerationStats  # noqa: E402
from .models.manager import load  # noqa: E402  (loader.load, taking any model name `models list` prints)

__version__ = "0.1.0"
__all__ = ["load", "generate", "stream_generate", "Decoder", "DecodeConfig", "GenerationResponse", "GenerationResult",
           "GenerationStats", "PromptCache"]
