"""Where a fixed-width cycle's time goes, ours and the reference's (issue 36 item 6).

Runs both loops over the same prompts (the set-up of bench.py) in two modes:
- `lazy` (as they run): per cycle the wall time, the time spent building the
  drafter's and the verify's lazy graphs, and (ours) the time blocked in the
  cycle's readback; the rest is the loop's own host work;
- `barrier`: an mx.eval after the draft graph and after the verify graph, so each
  forward's device time shows alone (the loop then runs serialized: its wall is
  not the lazy loop's).
Also the node count of one cycle's graphs (mx.export_to_dot; arrays incl. weights).

    MLX_DFLASH_DTYPE=float32 MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 \\
      PYTHONPATH=. /work/benchenv/refloop/bin/python bench/reference_loop/profile_cycle.py
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import re
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path

import mlx_dflash  # noqa: F401  (run from the checkout: PYTHONPATH=.)
import mlx.core as mx

from mlx_dflash.engine.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("reference_loop_bench", Path(__file__).with_name("bench.py"))
B = importlib.util.module_from_spec(_spec)  # bench/reference_loop/bench.py: its loaders and loops
_spec.loader.exec_module(B)

T = defaultdict(float)  # seconds by phase, this run
MODE = {"barrier": False, "dot": None}


def ops(*outs) -> Counter:
    s = io.StringIO()
    mx.export_to_dot(s, *outs)
    return Counter(re.findall(r'label ="?([A-Za-z_]+)', s.getvalue()))


def timed(name, fn, sync=None):
    def wrap(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        T[name + "_build"] += time.perf_counter() - t
        if MODE["barrier"] and sync is not None:
            t = time.perf_counter()
            mx.eval(sync(out))
            T[name + "_device"] += time.perf_counter() - t
        return out
    return wrap


def instrument_ours():
    E = Engine
    E.propose = timed("draft", E.propose, lambda out: out[1])
    E.verify = timed("verify", E.verify, lambda out: [x for x in out[0] if x is not None])
    rb = E.readback

    def readback(self, res, n):
        if MODE["dot"] is not None and not MODE["dot"]:
            MODE["dot"].update(ops(*(res if isinstance(res, list) else [res])))
        t = time.perf_counter()
        out = rb(self, res, n)
        T["readback_wait"] += time.perf_counter() - t
        return out
    E.readback = readback


def instrument_ref(ref, model, rdraft):
    rdraft.propose = timed("draft", rdraft.propose, lambda out: out[0])
    cls = type(model)
    call = cls.__call__

    def fwd(self, inputs, cache=None, **k):
        L = inputs.shape[1]
        t = time.perf_counter()
        out = call(self, inputs, cache, **k)
        if L > 1 and L <= 16 and getattr(self, "_in_ref", False):
            T["verify_build"] += time.perf_counter() - t
            if MODE["barrier"]:
                t = time.perf_counter()
                mx.eval(out, *self._hidden_states)
                T["verify_device"] += time.perf_counter() - t
        return out
    cls.__call__ = fwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="gsm8k-dev")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--widths", default="5,8")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    import dflash.model_mlx as ref
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    model, tok, drafter = B.load(str(ROOT / "models/target"), str(ROOT / "models/dflash2"))
    tok = tok if isinstance(tok, TokenizerWrapper) else TokenizerWrapper(tok)
    target = B.Target(model)
    ref.snapshot_download = lambda path, **kw: path
    rdraft = ref.load_draft(str(ROOT / "models/dflash2"))
    B.cast(rdraft, B.param_dtype(model))
    from app.bench.prompts import load_prompts

    prompts = load_prompts(a.prompts, tok, a.num_prompts)
    instrument_ours()
    instrument_ref(ref, model, rdraft)
    model._in_ref = True  # (our Target runs through its own view, not this object's __call__)

    def one(who, p, w):
        T.clear()
        if who == "ref":
            ids, dt, cyc = B.run_ref(ref, model, rdraft, tok, p, w, a.max_tokens)
        else:
            ids, dt, cyc = B.run_ours(model, tok, drafter, target, p, w, a.max_tokens)
        return dt, cyc, dict(T)

    widths = [int(x) for x in a.widths.split(",")]
    for w in widths:  # warm-up
        for who in ("ref", "ours"):
            one(who, prompts[0]["prompt"], w)
    print("| width | loop | mode | wall ms/cycle | draft build | verify build | readback wait | draft device | "
          "verify device | rest (host) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for w in widths:
        for barrier in (False, True):
            MODE["barrier"] = barrier
            acc = {who: defaultdict(list) for who in ("ref", "ours")}
            for rnd in range(a.rounds):
                for i, p in enumerate(prompts):
                    order = ("ref", "ours") if (rnd + i) % 2 == 0 else ("ours", "ref")
                    for who in order:
                        dt, cyc, t = one(who, p["prompt"], w)
                        acc[who]["wall"].append(dt / cyc)
                        for k in ("draft_build", "verify_build", "readback_wait", "draft_device", "verify_device"):
                            acc[who][k].append(t.get(k, 0.0) / cyc)
            for who in ("ref", "ours"):
                m = {k: statistics.median(v) * 1e3 for k, v in acc[who].items()}
                rest = m["wall"] - m["draft_build"] - m["verify_build"] - m["readback_wait"] - \
                    m["draft_device"] - m["verify_device"]
                print(f"| {w} | {who} | {'barrier' if barrier else 'lazy'} | {m['wall']:.2f} | {m['draft_build']:.2f} | "
                      f"{m['verify_build']:.2f} | {m['readback_wait']:.2f} | {m['draft_device']:.2f} | "
                      f"{m['verify_device']:.2f} | {rest:.2f} |")
    MODE["barrier"] = False
    MODE["dot"] = Counter()
    B.run_ours(model, tok, drafter, target, prompts[0]["prompt"], widths[0], 8)
    print(f"ours: one cycle's graph (drafts + verify + acceptance), w={widths[0]}: {sum(MODE['dot'].values())} nodes; "
          f"{MODE['dot'].most_common(12)}")


if __name__ == "__main__":
    main()
