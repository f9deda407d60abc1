#!/usr/bin/env python3
"""Predicted DFlash speedup over plain decoding of a target sharded over R Macs.

One decode forward of T tokens on R Macs costs its compute share plus its collective waits:

    tensor parallel:   t(T) = roofline(T) / R + (2 * layers + 1) * allsum(R)
    pipeline:          t(T) = roofline(T) + R * hop          (stages run one after another)
    roofline(T)        = max(weight bytes read / bandwidth, 2 * active params * T / flops)
    allsum(R)          = 2 * (R - 1) * hop   (ring: reduce-scatter then all-gather)
                         hop                  (RDMA mesh: every rank sends to every other at once)

Plain decoding pays t(1) per token. A DFlash step drafts on every rank (the drafter whole,
with the target's LM head; no collective) and verifies B tokens in one sharded forward, and
commits tau tokens: speedup = tau * t(1) / (t_draft + t(B)). For an MoE target, B tokens read
the experts they route to: E * (1 - (1 - k/E)^B) of E per layer, k per token.

    python benchmarks/distributed_cost.py               # the table in docs/distributed.md
    python benchmarks/distributed_cost.py --check 0.004 --layers 5 --tau 3.5 --block 8 \\
        --plain-ms 3 --draft-ms 4 --verify-ms 5          # one local measurement, predicted
"""

from __future__ import annotations

import argparse

GB = 1e9
# Published inputs (sources in docs/distributed.md).
HOP_S = {"ring (TCP over Thunderbolt)": 300e-6, "RDMA (JACCL over Thunderbolt 5)": 5e-6}
MAC = {"name": "M4 Max", "bandwidth": 546 * GB, "flops": 17e12}  # bandwidth: Apple; FLOP/s: reported, FP32
EFFICIENCY = 0.8  # share of the published bandwidth and FLOP/s a decode forward reaches (assumed)
LAYER_OVERHEAD_S = 50e-6  # fixed cost of one layer's kernels in a forward, whatever its size (assumed)
BYTES_PER_PARAM = 0.5625  # 4-bit weights with a bf16 scale and bias per 64 (mlx-lm's default)

# Shapes from the models' config.json (Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B) and the DFlash drafter
# (spec section 2: 5 layers of the target's width, the target's LM head).
SHAPES = {
    "Qwen3-8B": dict(layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=12288, vocab=151936,
                     experts=0, active=0, drafter_mlp=12288),
    "Qwen3-30B-A3B": dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, mlp=768, vocab=151936,
                          experts=128, active=8, drafter_mlp=6144),  # the drafter's dense MLP: assumed
}
DRAFTER_LAYERS = 5
TAUS = (3.0, 6.5)  # tau at block 16: chat-like, and DFlash Qwen3-8B-b16 on GSM8K (spec section 8)
BLOCK = 16


def layer_params(s: dict) -> tuple:
    """(attention params, params of one MLP or one expert) of one layer."""
    attn = s["hidden"] * s["head_dim"] * (2 * s["heads"] + 2 * s["kv_heads"])
    return attn, 3 * s["hidden"] * s["mlp"]


def roofline(s: dict, tokens: int, layers: int) -> float:
    """Seconds for ``tokens`` tokens through ``layers`` layers and the LM head on one Mac."""
    attn, mlp = layer_params(s)
    overhead = layers * LAYER_OVERHEAD_S
    if s["experts"]:
        touched = s["experts"] * (1 - (1 - s["active"] / s["experts"]) ** tokens)
        read, used = attn + touched * mlp, attn + s["active"] * mlp
    else:
        read = used = attn + mlp
    head = s["hidden"] * s["vocab"]
    bytes_read = (layers * read + head) * BYTES_PER_PARAM
    flops = 2 * tokens * (layers * used + head)
    return overhead + max(bytes_read / (MAC["bandwidth"] * EFFICIENCY), flops / (MAC["flops"] * EFFICIENCY))


def forward(s: dict, tokens: int, ranks: int, link: str, sharding: str) -> float:
    """Seconds of one target forward of ``tokens`` tokens over ``ranks`` Macs joined by ``link``."""
    compute, hop = roofline(s, tokens, s["layers"]), HOP_S.get(link, 0.0)
    if ranks == 1:
        return compute
    if sharding == "pipeline":
        return compute + ranks * hop
    allsum = hop if link.startswith("RDMA") else 2 * (ranks - 1) * hop
    return compute / ranks + (2 * s["layers"] + 1) * allsum


def speedup(s: dict, ranks: int, link: str, sharding: str, tau: float, block: int = BLOCK) -> tuple:
    """(plain tokens/s, DFlash tokens/s, their ratio)."""
    plain = forward(s, 1, ranks, link, sharding)
    drafter = dict(s, experts=0, mlp=s["drafter_mlp"])
    step = roofline(drafter, block, DRAFTER_LAYERS) + forward(s, block, ranks, link, sharding)
    return 1 / plain, tau / step, tau * plain / step


def table() -> None:
    print(f"| target | Macs | link | sharding | plain tok/s | " +
          " | ".join(f"DFlash tau {t} tok/s (x)" for t in TAUS) + " |")
    print("|---|---:|---|---|---:|" + "---:|" * len(TAUS))
    for name, s in SHAPES.items():
        for ranks in (1, 2, 4):
            for link in HOP_S if ranks > 1 else ["-"]:
                for sharding in ("tensor", "pipeline") if ranks > 1 else ["-"]:
                    cells = [speedup(s, ranks, link, sharding, tau) for tau in TAUS]
                    print(f"| {name} | {ranks} | {link} | {sharding} | {cells[0][0]:.1f} | " +
                          " | ".join(f"{c[1]:.1f} ({c[2]:.2f}x)" for c in cells) + " |")


def check(args) -> None:
    """The same model on one measured local run: plain = plain_ms + collectives, step = draft + verify + collectives."""
    waits = (2 * args.layers + 1) * args.check
    plain = args.plain_ms / 1e3 + waits
    step = (args.draft_ms + args.verify_ms) / 1e3 + waits
    print(f"predicted DFlash / plain on {args.ranks} ranks: {args.tau * plain / step:.2f}x "
          f"(plain {1 / plain:.1f} tok/s, all-sum {args.check * 1e3:.2f} ms x {2 * args.layers + 1} per forward)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", type=float, metavar="SECONDS", help="measured seconds per all-sum (local check)")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tau", type=float, default=3.0)
    ap.add_argument("--plain-ms", type=float, default=1.0, help="one plain forward's compute, unsharded")
    ap.add_argument("--draft-ms", type=float, default=1.0)
    ap.add_argument("--verify-ms", type=float, default=1.0, help="one verify forward's compute, unsharded")
    args = ap.parse_args()
    check(args) if args.check else table()


if __name__ == "__main__":
    main()
