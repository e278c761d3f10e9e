"""`mlx-dflash doctor`: backend, BLAS in use, kernel path, and the measured
verify-cost curve c(w) = t(w tokens) / t(1 token)."""

from __future__ import annotations

import json
import platform
import time

WIDTHS = (1, 2, 4, 8, 16)


def add_parser(sub):
    p = sub.add_parser("doctor", help="check the backend, BLAS and verify cost on this machine")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="skip the verify-cost measurement")
    p.add_argument("--context", type=int, default=256, help="tokens of context for c(w)")


def probe_model():
    """A ~30M-parameter Qwen3 (random weights: cost does not depend on them)."""
    import mlx.core as mx
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6,
                           vocab_size=8192, max_position_embeddings=4096, rope_theta=1e6,
                           tie_word_embeddings=True)
    mx.random.seed(0)
    m = qwen3.Model(args)
    mx.eval(m.parameters())
    return m


def verify_cost(model=None, context: int = 256, widths=WIDTHS, reps: int = 15) -> dict:
    """Median forward time at each width over `context` cached tokens, relative to w = 1."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    model = model or probe_model()
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(context)[None] % 1000, cache=cache))

    def t(w):
        ts = []
        for _ in range(reps):
            x = mx.arange(w)[None]
            t0 = time.perf_counter()
            mx.eval(model(x, cache=cache))
            ts.append(time.perf_counter() - t0)
            trim_prompt_cache(cache, w)
        return sorted(ts)[len(ts) // 2]

    t(1)  # warm up
    times = {w: t(w) for w in widths}
    return {"ms": {w: times[w] * 1e3 for w in widths}, "ratio": {w: times[w] / times[1] for w in widths}}


def report(quick: bool = False, context: int = 256) -> dict:
    import mlx.core as mx

    from mlx_dflash import fastblas

    try:
        from mlx_dflash.conv import kernel_backend

        kernel = kernel_backend()
    except ImportError:
        kernel = "unavailable"
    backend = "metal" if mx.metal.is_available() else ("cuda" if getattr(mx, "cuda", None) and mx.cuda.is_available() else "cpu")
    out = {
        "mlx": mx.__version__,
        "platform": f"{platform.system()} {platform.machine()}",
        "backend": backend,
        "device": str(mx.default_device()),
        "blas": fastblas.STATE["blas"],
        "blas_note": fastblas.STATE["error"],
        "sgemm_gflops": round(fastblas.gemm_gflops(), 1),
        "fused_kernels": kernel in ("metal", "cuda"),
        "conv_kernel": kernel,
    }
    if not quick:
        vc = verify_cost(context=context)
        out["verify_cost"] = {str(w): round(r, 3) for w, r in vc["ratio"].items()}
        out["verify_ms"] = {str(w): round(v, 2) for w, v in vc["ms"].items()}
        out["verify_context"] = context
    return out


def run(args):
    r = report(args.quick, args.context)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"MLX {r['mlx']} on {r['platform']}, backend {r['backend']} ({r['device']})")
    print(f"BLAS: {r['blas']}  [{r['sgemm_gflops']} GFLOP/s sgemm]" + (f"  note: {r['blas_note']}" if r["blas_note"] else ""))
    print(f"DFlash 2 conv: {r['conv_kernel']}" + (" (fused kernel)" if r["fused_kernels"] else " (MLX ops, compiled)"))
    if "verify_cost" in r:
        print(f"verify cost c(w) at {r['verify_context']} tokens of context, ~30M-parameter Qwen3:")
        for w, c in r["verify_cost"].items():
            print(f"  w={w:>2}  c={c:5.2f}  ({r['verify_ms'][w]:.1f} ms)")
    return 0
