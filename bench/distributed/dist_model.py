"""A cost model of DFlash on a target split over two Macs (bench/distributed.md):
per token, plain decoding pays one target forward plus its collectives; DFlash
pays one verify of w rows plus its collectives plus one draft, spread over tau
tokens. Memory-bound decoding: a forward costs the bytes it reads over the
memory bandwidth (an MoE verify reads the experts any of its w rows routes to);
a collective costs latency + bytes / link bandwidth.

    PYTHONPATH=. python bench/distributed/dist_model.py > bench/distributed/model.md

Every input is an assumption named below (override on the command line); the
link latencies are the ones to replace with `per_collective_s` from
`mlx-dflash generate --json` on the real pair of machines."""

import argparse
from dataclasses import dataclass

BYTES_PER_PARAM = 0.5625  # 4-bit weights with bf16 scales and biases per 64 (mlx-lm's default quantization)
ACT_BYTES = 2  # bf16 activations on the wire


@dataclass
class Model:
    name: str
    total_b: float  # parameters (billions)
    active_b: float  # parameters read per token
    layers: int
    hidden: int
    vocab: int
    experts: int = 0  # routed experts per layer (0: dense)
    top_k: int = 0
    expert_share: float = 0.0  # share of the active parameters in routed experts


# approximate, from the public configs
MODELS = [
    Model("Qwen3-32B (dense)", 32.8, 32.8, 64, 5120, 151936),
    Model("Llama-3.3-70B (dense)", 70.6, 70.6, 80, 8192, 128256),
    Model("Qwen3-235B-A22B (MoE)", 235, 22, 94, 4096, 151936, 128, 8, 0.75),
    Model("Qwen3.5-397B-A17B (MoE)", 397, 17, 60, 4096, 248320, 512, 10, 0.7),
    Model("DeepSeek-V3 671B-A37B (MoE)", 671, 37, 61, 7168, 129280, 256, 8, 0.55),
]


@dataclass
class Link:
    name: str
    latency_s: float  # one message
    bandwidth: float  # bytes / s


LINKS = [
    Link("Thunderbolt 5, JACCL (RDMA)", 10e-6, 6e9),
    Link("Thunderbolt 5, ring (TCP)", 50e-6, 4e9),
    Link("10 GbE, ring (TCP)", 60e-6, 1.1e9),
]


def distinct_experts(e: int, k: int, w: int) -> float:
    """Expected routed experts a block of w rows touches (independent routing)."""
    return e * (1 - (1 - k / e) ** w)


def forward_s(m: Model, w: int, bw: float, ranks: int, split: str) -> float:
    """Compute time of one target forward over w rows (memory-bound)."""
    act = m.active_b * 1e9 * BYTES_PER_PARAM
    if m.experts:
        dense = act * (1 - m.expert_share)
        act = dense + act * m.expert_share * distinct_experts(m.experts, m.top_k, w) / m.top_k
    return act / bw / (ranks if split == "tensor" else 1)  # pipeline stages run one after the other


def allreduce_s(link: Link, nbytes: float) -> float:
    """Ring all-reduce over two ranks: two messages of half the bytes."""
    return 2 * (link.latency_s + nbytes / 2 / link.bandwidth)


def comm_s(m: Model, w: int, link: Link, split: str, taps: int = 0) -> float:
    row = w * m.hidden * ACT_BYTES
    if split == "tensor":
        return 2 * m.layers * allreduce_s(link, row)
    out = 2 * (link.latency_s + row / link.bandwidth)  # the stage hand-over and the final gather
    if taps:
        out += allreduce_s(link, row * taps)  # the drafter's taps from both stages
    return out


def draft_s(m: Model, bw: float, layers: int = 5) -> float:
    """A replicated 5-layer bf16 drafter of the target's width, plus the target's (4-bit) head."""
    return (layers * 12 * m.hidden ** 2 * 2 + m.vocab * m.hidden * BYTES_PER_PARAM) / bw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bandwidth", type=float, default=600e9, help="achieved memory bandwidth per Mac, bytes/s "
                    "(M3 Ultra: 819 GB/s peak)")
    ap.add_argument("--tau", type=float, nargs=2, default=[3.2, 4.0], metavar=("TAU5", "TAU8"),
                    help="tokens per cycle at widths 5 and 8 (acceptance: task and drafter dependent)")
    ap.add_argument("--taps", type=int, default=5)
    a = ap.parse_args()
    taus = {5: a.tau[0], 8: a.tau[1]}
    print(f"memory bandwidth {a.bandwidth / 1e9:.0f} GB/s per Mac; {BYTES_PER_PARAM} bytes/param (4-bit); "
          f"tau {taus[5]} at w=5, {taus[8]} at w=8; drafter 5 bf16 layers of the target's width; "
          f"{a.taps} taps\n")
    print("| model | link | split | plain tok/s | comm share (plain) | DFlash w=5 tok/s | w=8 tok/s | "
          "best speedup | with the guard | comm per verify w=8 (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in MODELS:
        for link in LINKS:
            for split in ("tensor", "pipeline"):
                bw = a.bandwidth
                plain = forward_s(m, 1, bw, 2, split) + comm_s(m, 1, link, split)
                share = comm_s(m, 1, link, split) / plain
                tps = {}
                for w in (5, 8):
                    cyc = forward_s(m, w, bw, 2, split) + comm_s(m, w, link, split, a.taps) + draft_s(m, bw)
                    tps[w] = taus[w] / cyc
                best = max(tps.values()) * plain
                print(f"| {m.name} | {link.name} | {split} | {1 / plain:.1f} | {share:.0%} | {tps[5]:.1f} | "
                      f"{tps[8]:.1f} | {best:.2f}x | {max(1.0, best):.2f}x | {comm_s(m, 8, link, split, a.taps) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
