"""Reconstruction error of quantize -> dequantize_reference, per width, RTN vs HQQ, on real experts.

    python -m edgemoe.quant.report CHECKPOINT_DIR [--group-sizes none,64] [--max-experts N]
    python -m edgemoe.quant.report --synthetic       # Mixtral-shaped heavy-tailed random weights
    python -m edgemoe.quant.report CHECKPOINT_DIR --narrowed   # + 2-bit copies narrowed from 4 and 8 bits

Reads the checkpoint's expert weights one tensor at a time (safetensors, lazily) under either naming
(Mixtral `...experts.{e}.w1/w2/w3.weight`, Qwen/OLMoE `...experts.{e}.gate/up/down_proj.weight`).
Errors are pooled over all tensors: relative L2 = sqrt(sum (w - w')^2 / sum w^2), relative L1 =
sum |w - w'| / sum |w|. Prints a markdown table (docs/quantization.md).
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import torch

from .tensor import dequantize_reference, narrow, quantize

EXPERT_NAME = re.compile(r"\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def expert_tensors(checkpoint: Path, max_experts: int | None):
    """Yields (name, float32 tensor) for each expert weight, at most max_experts tensors."""
    from safetensors import safe_open

    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint={checkpoint}: no *.safetensors files")
    count = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in sorted(k for k in f.keys() if EXPERT_NAME.search(k)):
                if max_experts is not None and count >= max_experts:
                    return
                count += 1
                yield name, f.get_tensor(name).float()


def synthetic_tensors():
    """One Mixtral-shaped [14336, 4096] weight: Student-t (3 dof) entries, heavy-tailed like experts."""
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(14336, 4096, generator=g)
    chi2 = torch.randn(3, 14336, 4096, generator=g).pow(2).sum(0)
    yield "synthetic_t3_14336x4096", (normal / (chi2 / 3).sqrt() * 0.01)


def measure(tensors, widths, group_sizes, methods):
    """{(bits, group_size, method): [sq_err, sq_ref, abs_err, abs_ref, seconds]} pooled over tensors.
    A width (b, from_bits) is the from_bits quantization narrowed to b bits (edgemoe.quant.narrow)."""
    acc: dict = {}
    n = 0
    for _, w in tensors:
        n += 1
        for bits in widths:
            for group_size in group_sizes:
                for method in methods:
                    t0 = time.perf_counter()
                    back = dequantize_reference(_quantized(w, bits, group_size, method))
                    dt = time.perf_counter() - t0
                    err = back - w
                    sums = [float(err.pow(2).sum()), float(w.pow(2).sum()), float(err.abs().sum()),
                            float(w.abs().sum()), dt]
                    prev = acc.setdefault((bits, group_size, method), [0.0] * 5)
                    acc[(bits, group_size, method)] = [a + b for a, b in zip(prev, sums)]
    return acc, n


def _quantized(w, bits, group_size, method):
    if isinstance(bits, tuple):
        return narrow(quantize(w, bits[1], group_size, method), bits[0])
    return quantize(w, bits, group_size, method)


def _width_text(bits) -> str:
    return f"{bits[0]} (narrowed from {bits[1]})" if isinstance(bits, tuple) else str(bits)


def table(acc) -> str:
    lines = ["| bits | group | method | rel. L2 error | rel. L1 error | HQQ gain (L2) | time (s) |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for (bits, group_size, method), (se, sr, ae, ar, dt) in sorted(acc.items(), key=lambda kv: (
            _width_text(kv[0][0]), kv[0][1] or 0, kv[0][2] != "rtn")):
        l2 = (se / sr) ** 0.5
        gain = ""
        if method == "hqq":
            rtn = acc[(bits, group_size, "rtn")]
            gain = f"{(rtn[0] / rtn[1]) ** 0.5 / l2:.2f}x"
        lines.append(f"| {_width_text(bits)} | {group_size or 'row'} | {method} | {l2:.4f} | {ae / ar:.4f} | {gain} | {dt:.1f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", nargs="?", type=Path)
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--group-sizes", default="none,64")
    ap.add_argument("--max-experts", type=int, default=None, help="at most this many expert tensors")
    ap.add_argument("--narrowed", action="store_true", help="also 2-bit copies narrowed from 4 and 8 bits")
    args = ap.parse_args()
    if (args.checkpoint is None) == (not args.synthetic):
        ap.error("give a CHECKPOINT_DIR or --synthetic (one of them)")
    groups = [None if g == "none" else int(g) for g in args.group_sizes.split(",")]
    tensors = synthetic_tensors() if args.synthetic else expert_tensors(args.checkpoint, args.max_experts)
    widths = (2, 4, 8) + (((2, 4), (2, 8)) if args.narrowed else ())
    acc, n = measure(tensors, widths, groups, ("rtn", "hqq"))
    print(f"{n} expert tensors from {'synthetic' if args.synthetic else args.checkpoint}\n")
    print(table(acc))


if __name__ == "__main__":
    main()
