"""Benchmark edgemoe's CPU kernels against this machine's memory read bandwidth.

    python tools/bench_kernels.py [--json results.json] [--parts qmatmul,expert,crossover,int,layer,prompt]
                                  [--mixtral-only] [--bundled DIR] [--repeats N]

Measures, in one run:
1. memory read bandwidth: a numba parallel sum over 1 GiB of float32 (and torch's sum, for comparison);
2. per width (2/4/8) and token count (1, 2, 4, 8, 16): qmatmul's effective bandwidth (bytes of packed
   codes + scales + zeros read per second) on 14336x4096 (Mixtral's expert) and on the bundled model's
   expert shapes, beside torch bf16 F.linear on the dequantized weight;
3. per width, the token count where dequantize (bf16) + torch F.linear overtakes qmatmul;
4. the fused SwiGLU expert against its three GEMVs;
5. ("int") the integer path next to the float path on Mixtral's shape, per width, at 1 and 2 threads:
   qmatmul_int at 1, 2, 4, 8 tokens and swiglu_expert_int at 1 token, on each integer path this CPU
   runs (the portable one at 1 token only), against qmatmul / swiglu_expert in the same run;
6. ("layer") one MoE layer's active experts at 1 token, on each integer path, at 1 and 2 threads:
   one swiglu_experts_int call for the layer against one swiglu_expert_int call per expert, on the
   fine-grained shape (D 1024, I 384, 8 active: bench-qwen3moe) and Mixtral-shaped ones (2 active);
   "layer_hot" repeats the layer call on one copy (in cache): the kernel's decoding ceiling.
7. ("prompt") one MoE layer's experts at a prompt's token counts (16, 48, 128 tokens an expert), one
   swiglu_experts_int call, on each integer path, on every core, in GMAC/s (multiply-adds of the three
   matrices a second): bench-qwen3moe's 64 experts (I 384, D 1024), the DeepSeek-V2-shaped bench
   checkpoint's 64 (I 352: rows with bytes past their last whole block) and bench-mixtral's 8 (I 3584).

Weights are "cold": each timed call reads a different copy of the packed weight, from a set of copies
larger than 2x the last-level cache, so bandwidth means DRAM bandwidth. "hot" rows (1 token only)
repeat one copy, which the 260 MB L3 of this machine holds: their gap to the cold rows separates the
memory limit from the decoding (instruction) limit. "1thr" rows run on one thread; "l2_1thr" runs
one thread on a 256-row weight that stays in L2, the decoding ceiling of one core (it includes the
~10 us Python call overhead, about 10% at this size).
Times are medians over --repeats calls after 2 warm-up calls.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch
import torch.nn.functional as F

from edgemoe.kernels import (dequantize, int_paths, qmatmul, qmatmul_int, set_threads, swiglu_expert,
                             swiglu_expert_int)
from edgemoe.kernels.cpu import parallel_sum
from edgemoe.kernels.ops import expert_layout, swiglu_experts_int
from edgemoe.quant import QuantizedTensor, quantize

MIXTRAL = (14336, 4096)  # expert hidden I, hidden D
LAYERS = [((384, 1024), 8), ((3584, 1024), 2), (MIXTRAL, 2)]   # (I, D), active experts a token
PROMPT_LAYERS = [((384, 1024), 64), ((352, 1024), 64), ((3584, 1024), 8)]   # (I, D), experts of a layer
PROMPT_TOKENS = (16, 48, 128)   # tokens an expert
TOKENS = (1, 2, 4, 8, 16)
INT_TOKENS = (1, 2, 4, 8)
CROSSOVER_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
COLD_BYTES = 1 << 30  # working set of the rotated copies: 4x this machine's 260 MB L3
MAX_COPIES = 2048  # small (bundled) shapes: 2048 copies stay under the L3 size, so they run cached
L2_ROWS = 256  # a weight of 256 x 4096 codes (<= 1 MiB) stays in one core's 2 MiB L2: decoding speed
BUNDLED = Path(__file__).resolve().parent.parent / "edgemoe" / "bundled" / "shakespeare-moe"


def progress(*what):
    print(time.strftime("%H:%M:%S"), *what, file=sys.stderr, flush=True)


def median_time(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(repeats: int) -> dict[str, float]:
    a = np.random.default_rng(0).random((COLD_BYTES // 4 // 4096, 4096), dtype=np.float32)
    t = torch.from_numpy(a)
    return {"numba_sum_gbps": a.nbytes / median_time(lambda: parallel_sum(a), repeats) / 1e9,
            "torch_sum_gbps": a.nbytes / median_time(lambda: t.sum(), repeats) / 1e9}


def copies(qts: list[QuantizedTensor]) -> list[list[QuantizedTensor]]:
    """Enough copies of a group of tensors (read together) to exceed COLD_BYTES, 2 to MAX_COPIES."""
    nbytes = sum(qt.nbytes for qt in qts)
    n = min(MAX_COPIES, max(2, -(-COLD_BYTES // nbytes)))
    return [[QuantizedTensor(qt.bits, qt.group_size, qt.shape, qt.packed.copy(), qt.scale.copy(),
                             qt.zero.copy()) for qt in qts] for _ in range(n)]


def rotating(fn, sets):
    """A no-argument call that runs fn on the next set of copies each time."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(sets)
        return fn(*sets[state["i"]])

    return call


def record(kernel, bits, tokens, shape, nbytes, seconds, bandwidth, **extra):
    gbps = nbytes / seconds / 1e9
    return {"kernel": kernel, "bits": bits, "tokens": tokens, "rows": shape[0], "cols": shape[1],
            "gbps": round(gbps, 2), "bandwidth_gbps": round(bandwidth, 2),
            "pct_of_bandwidth": round(100 * gbps / bandwidth, 1), "ms": round(seconds * 1e3, 4), **extra}


def bench_qmatmul(shape, bits, bandwidth, repeats, with_hot):
    progress("qmatmul", shape, f"int{bits}")
    rows, cols = shape
    qt = quantize(torch.randn(rows, cols) * 0.02, bits)
    sets = copies([qt])
    out = []
    for tokens in TOKENS:
        x = np.random.default_rng(tokens).standard_normal((tokens, cols), dtype=np.float32)
        t = median_time(rotating(lambda q: qmatmul(x, q), sets), repeats)
        out.append(record("qmatmul", bits, tokens, shape, qt.nbytes, t, bandwidth))
    if with_hot:
        x = np.random.default_rng(1).standard_normal((1, cols), dtype=np.float32)
        t = median_time(lambda: qmatmul(x, qt), repeats)
        out.append(record("qmatmul_hot", bits, 1, shape, qt.nbytes, t, bandwidth))
        t = after_torch_time(lambda q: qmatmul(x, q), sets, repeats)
        out.append(record("qmatmul_after_torch", bits, 1, shape, qt.nbytes, t, bandwidth))
        l2 = quantize(torch.randn(L2_ROWS, cols) * 0.02, bits)
        set_threads(1)
        try:
            t = median_time(rotating(lambda q: qmatmul(x, q), sets), repeats)
            out.append(record("qmatmul_1thr", bits, 1, shape, qt.nbytes, t, bandwidth))
            t = median_time(lambda: qmatmul(x, l2), repeats * 10)
            out.append(record("qmatmul_l2_1thr", bits, 1, (L2_ROWS, cols), l2.nbytes, t, bandwidth))
        finally:
            set_threads()
    return out


def after_torch_time(fn, sets, repeats: int) -> float:
    """Median time of fn alone when each call directly follows a torch op (torch's OpenMP threads
    may still be spinning on the cores the numba kernel needs)."""
    a, b = torch.randn(64, 1024), torch.randn(1024, 1024)
    times = []
    for i in range(repeats + 2):
        torch.mm(a, b)
        t0 = time.perf_counter()
        fn(*sets[i % len(sets)])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def bench_torch_linear(shape, bandwidth, repeats):
    """torch bf16 F.linear on an (already dequantized) bf16 weight, cold like the others."""
    progress("torch bf16 linear", shape)
    rows, cols = shape
    n = max(2, -(-COLD_BYTES // (rows * cols * 2)))
    ws = [torch.randn(rows, cols).to(torch.bfloat16) for _ in range(n)]
    out = []
    for tokens in TOKENS:
        x = torch.randn(tokens, cols).to(torch.bfloat16)
        t = median_time(rotating(lambda w: F.linear(x, w), [[w] for w in ws]), repeats)
        out.append(record("torch_bf16_linear", 16, tokens, shape, rows * cols * 2, t, bandwidth))
    return out


def crossover(bits, bandwidth, repeats):
    """qmatmul vs dequantize(bf16) + F.linear on Mixtral's shape, for growing token counts."""
    progress("crossover", f"int{bits}")
    rows, cols = MIXTRAL
    qt = quantize(torch.randn(rows, cols) * 0.02, bits)
    sets = copies([qt])
    out, first = [], None
    for tokens in CROSSOVER_TOKENS:
        x = np.random.default_rng(tokens).standard_normal((tokens, cols), dtype=np.float32)
        xb = torch.from_numpy(x).to(torch.bfloat16)
        t_fused = median_time(rotating(lambda q: qmatmul(x, q), sets), repeats)
        t_deq = median_time(rotating(lambda q: F.linear(xb, dequantize(q, torch.bfloat16)), sets), repeats)
        out.append(record("qmatmul", bits, tokens, MIXTRAL, qt.nbytes, t_fused, bandwidth, series="crossover"))
        out.append(record("dequant_bf16+linear", bits, tokens, MIXTRAL, qt.nbytes, t_deq, bandwidth,
                          series="crossover"))
        if first is None and t_deq < t_fused:
            first = tokens
    return out, first


def bench_expert(shape, bits, bandwidth, repeats):
    """swiglu_expert vs qmatmul(gate) + qmatmul(up) + qmatmul(down) at 1..16 tokens."""
    progress("swiglu expert", shape, f"int{bits}")
    inner, dim = shape
    experts = [quantize(torch.randn(*s) * 0.02, bits) for s in ((inner, dim), (inner, dim), (dim, inner))]
    nbytes = sum(qt.nbytes for qt in experts)
    sets = copies(experts)
    out = []
    for tokens in TOKENS:
        x = np.random.default_rng(tokens).standard_normal((tokens, dim), dtype=np.float32)
        t = median_time(rotating(lambda g, u, d: swiglu_expert(x, g, u, d), sets), repeats)
        out.append(record("swiglu_expert", bits, tokens, shape, nbytes, t, bandwidth))
    x = np.random.default_rng(1).standard_normal((1, dim), dtype=np.float32)
    h = np.random.default_rng(2).standard_normal((1, inner), dtype=np.float32)

    def three(g, u, d):
        qmatmul(x, g), qmatmul(x, u), qmatmul(h, d)

    t = median_time(rotating(three, sets), repeats)
    out.append(record("three_gemvs", bits, 1, shape, nbytes, t, bandwidth))
    return out


def bench_int(bits, bandwidth, repeats):
    """Float and integer paths side by side on Mixtral's shape, at 1 and 2 threads (same copies)."""
    progress("integer path", f"int{bits}")
    rows, cols = MIXTRAL
    qt = quantize(torch.randn(rows, cols) * 0.02, bits)
    sets = copies([qt])
    experts = [quantize(torch.randn(*s) * 0.02, bits) for s in ((rows, cols), (rows, cols), (cols, rows))]
    expert_sets = copies(experts)
    nbytes = sum(q.nbytes for q in experts)
    out = []
    for threads in (1, 2):
        set_threads(threads)
        try:
            for tokens in INT_TOKENS:
                x = np.random.default_rng(tokens).standard_normal((tokens, cols), dtype=np.float32)
                kernels = [("qmatmul", lambda q: qmatmul(x, q))]
                kernels += [(f"qmatmul_int_{p}", lambda q, p=p: qmatmul_int(x, q, p))
                            for p in int_paths() if tokens == 1 or p != "portable"]
                for name, fn in kernels:
                    t = median_time(rotating(fn, sets), repeats)
                    out.append(record(name, bits, tokens, MIXTRAL, qt.nbytes, t, bandwidth, threads=threads,
                                      series="int"))
            x = np.random.default_rng(1).standard_normal((1, cols), dtype=np.float32)
            if threads == 1:  # the decoding ceiling of one core: a weight that stays in its L2
                l2 = quantize(torch.randn(L2_ROWS // 2, cols) * 0.02, bits)  # 512 KiB L2 on Zen 3
                for name, fn in [("qmatmul", qmatmul)] + [(f"qmatmul_int_{p}", lambda x, q, p=p: qmatmul_int(x, q, p))
                                                          for p in int_paths()]:
                    t = median_time(lambda: fn(x, l2), repeats * 10)
                    out.append(record(f"{name}_l2", bits, 1, l2.shape, l2.nbytes, t, bandwidth, threads=1, series="int"))
            kernels = [("swiglu_expert", lambda g, u, d: swiglu_expert(x, g, u, d))]
            kernels += [(f"swiglu_int_{p}", lambda g, u, d, p=p: swiglu_expert_int(x, g, u, d, p)) for p in int_paths()]
            for name, fn in kernels:
                t = median_time(rotating(fn, expert_sets), repeats)
                out.append(record(name, bits, 1, MIXTRAL, nbytes, t, bandwidth, threads=threads, series="int"))
        finally:
            set_threads()
    return out


def bench_layer(shape, active, bits, bandwidth, repeats):
    """A layer's active experts at 1 token: one call for the layer, or one call per expert."""
    progress("layer kernel", shape, active, f"int{bits}")
    inner, dim = shape
    experts = [quantize(torch.randn(*s) * 0.02, bits) for _ in range(active)
               for s in ((inner, dim), (inner, dim), (dim, inner))]
    sets = copies(experts)
    layouts = [np.stack([expert_layout(*group[3 * a:3 * a + 3]) for a in range(active)]) for group in sets]
    nbytes = sum(q.nbytes for q in experts)
    x = np.random.default_rng(1).standard_normal((1, dim), dtype=np.float32)
    pairs, starts = np.repeat(x, active, 0), np.arange(active + 1, dtype=np.int64)
    out = []
    for threads in (1, 2):
        set_threads(threads)
        try:
            for p in int_paths():
                layer = rotating(lambda i, p=p: swiglu_experts_int(pairs, layouts[i], starts, p),
                                 [(i,) for i in range(len(sets))])
                each = rotating(lambda *qts, p=p: [swiglu_expert_int(x, *qts[3 * a:3 * a + 3], path=p)
                                                   for a in range(active)], sets)
                hot = lambda p=p: swiglu_experts_int(pairs, layouts[0], starts, p)   # one copy, in cache
                for name, fn in ((f"layer_{p}", layer), (f"layer_hot_{p}", hot), (f"per_expert_{p}", each)):
                    t = median_time(fn, repeats)
                    out.append(record(name, bits, 1, shape, nbytes, t, bandwidth, threads=threads,
                                      active=active, series="layer"))
        finally:
            set_threads()
    return out


def bench_prompt_layer(shape, nexperts, bits, bandwidth, repeats):
    """Every expert of a layer with each of PROMPT_TOKENS tokens, in one call (weights cached: a
    prompt's experts are read once and reused across its tokens)."""
    progress("prompt layer", shape, nexperts, f"int{bits}")
    inner, dim = shape
    experts = [[quantize(torch.randn(*s) * 0.02, bits) for s in ((inner, dim), (inner, dim), (dim, inner))]
               for _ in range(nexperts)]
    layouts = np.stack([expert_layout(*e) for e in experts])
    nbytes = sum(q.nbytes for e in experts for q in e)
    out = []
    for tokens in PROMPT_TOKENS:
        pairs = np.random.default_rng(1).standard_normal((nexperts * tokens, dim), dtype=np.float32)
        starts = np.arange(nexperts + 1, dtype=np.int64) * tokens
        for p in int_paths():
            t = median_time(lambda p=p: swiglu_experts_int(pairs, layouts, starts, p), repeats)
            gmacs = nexperts * tokens * 3 * inner * dim / t / 1e9
            out.append(record(f"prompt_{p}", bits, tokens, shape, nbytes, t, bandwidth,
                              experts=nexperts, gmac_per_s=round(gmacs, 1), series="prompt"))
    return out


def prompt_note(records) -> str:
    """One line per layer shape, width and path: its GMAC/s at each of PROMPT_TOKENS."""
    rates: dict[tuple, list[float]] = {}
    for r in records:   # in PROMPT_TOKENS' order within each (shape, width, path)
        key = (r["rows"], r["cols"], r["experts"], r["bits"], r["kernel"])
        rates.setdefault(key, []).append(r["gmac_per_s"])
    lines = [f"  {rows}x{cols} x{experts} int{bits} {kernel}: " + "/".join(map(str, values))
             for (rows, cols, experts, bits, kernel), values in rates.items()]
    return ("a layer's experts at a prompt's tokens, GMAC/s (at " + "/".join(map(str, PROMPT_TOKENS))
            + " tokens an expert):\n" + "\n".join(lines))


def bundled_shape(path: Path):
    config = path / "config.json"
    if not config.exists():
        return None
    cfg = json.loads(config.read_text())
    return cfg["intermediate_size"], cfg["hidden_size"]


def machine() -> dict:
    wide = (numba.config.CPU_FEATURES or "").endswith("-prefer-256-bit")
    return {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "vector_bits": 512 if wide else "LLVM default (256 on this CPU)",
            "cpu": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0)),
            "loadavg": os.getloadavg(), "numba": numba.__version__, "torch": torch.__version__,
            "numpy": np.__version__, "threading_layer": numba.threading_layer(),
            "numba_threads": numba.get_num_threads(), "torch_threads": torch.get_num_threads()}


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def print_table(records):
    print(f"{'kernel':<24}{'bits':>5}{'tokens':>7}{'rows':>7}{'cols':>7}{'thr':>4}{'ms':>10}{'GB/s':>8}{'% bw':>7}")
    for r in records:
        print(f"{r['kernel']:<24}{r['bits']:>5}{r['tokens']:>7}{r['rows']:>7}{r['cols']:>7}{r.get('threads', ''):>4}"
              f"{r['ms']:>10.3f}{r['gbps']:>8.1f}{r['pct_of_bandwidth']:>7.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the records as a JSON list to this file ('-': stdout)")
    ap.add_argument("--bundled", type=Path, default=BUNDLED, help="bundled model dir (its config.json)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--parts", default="qmatmul,expert,crossover,int,layer,prompt",
                    help="comma-separated subset of qmatmul,expert,crossover,int,layer,prompt (bandwidth always runs)")
    ap.add_argument("--mixtral-only", action="store_true", help="skip the bundled model's shapes")
    args = ap.parse_args()

    set_threads()
    parallel_sum(np.ones((2, 16), np.float32))  # start numba's thread pool before machine() reads it
    info = machine() | {"cpu": cpu_model()}
    print("machine:", json.dumps(info))
    bw = read_bandwidth(args.repeats)
    bandwidth = bw["numba_sum_gbps"]
    print(f"memory read bandwidth (1 GiB): numba sum {bandwidth:.1f} GB/s, torch sum {bw['torch_sum_gbps']:.1f} GB/s")
    parts = set(args.parts.split(","))
    if "int" in parts:
        set_threads(1)
        one = read_bandwidth(args.repeats)["numba_sum_gbps"]
        set_threads()
        print(f"memory read bandwidth, 1 thread: numba sum {one:.1f} GB/s (the % columns use {bandwidth:.1f})")

    small = None if args.mixtral_only else bundled_shape(args.bundled)
    if small is None:
        print(f"bundled model shapes skipped ({args.bundled}): Mixtral shape only")
    records, notes = [], []
    if "qmatmul" in parts:
        for shape in [MIXTRAL] + ([small, small[::-1]] if small else []):  # gate/up [I, D], down [D, I]
            for bits in (8, 4, 2):
                records += bench_qmatmul(shape, bits, bandwidth, args.repeats, with_hot=shape == MIXTRAL)
            records += bench_torch_linear(shape, bandwidth, args.repeats)
    if "expert" in parts:
        fused = {}
        for shape in [MIXTRAL] + ([small] if small else []):
            for bits in (8, 4, 2):
                recs = bench_expert(shape, bits, bandwidth, args.repeats)
                records += recs
                one = {r["kernel"]: r["ms"] for r in recs if r["tokens"] == 1}
                fused[(shape, bits)] = one["swiglu_expert"] / one["three_gemvs"]
        notes.append("fused expert / three GEMVs, 1 token: "
                     + ", ".join(f"{s[0]}x{s[1]} int{b}: {v:.2f}x" for (s, b), v in fused.items()))
    if "crossover" in parts:
        crossings = {}
        for bits in (8, 4, 2):
            recs, first = crossover(bits, bandwidth, args.repeats)
            records += recs
            crossings[bits] = first
        notes.append("dequantize(bf16) + F.linear beats qmatmul from (tokens, Mixtral shape): "
                     + ", ".join(f"int{b}: {t if t else '>' + str(CROSSOVER_TOKENS[-1])}"
                                 for b, t in crossings.items()))
    if "int" in parts:
        for bits in (8, 4, 2):
            records += bench_int(bits, bandwidth, args.repeats)
    if "layer" in parts:
        for shape, active in LAYERS:
            for bits in (8, 4, 2):
                records += bench_layer(shape, active, bits, bandwidth, args.repeats)
    if "prompt" in parts:
        prompt = []
        for shape, nexperts in PROMPT_LAYERS:
            for bits in (8, 4, 2):
                prompt += bench_prompt_layer(shape, nexperts, bits, bandwidth, args.repeats)
        records += prompt
        notes.append(prompt_note(prompt))
    finish(records, args.json, notes)


def finish(records, json_path, notes):
    print_table(records)
    for note in notes:
        print(note)
    print("load average after:", os.getloadavg())
    if json_path:
        text = json.dumps(records, indent=1)
        if json_path == "-":
            print(text)
        else:
            Path(json_path).write_text(text)


if __name__ == "__main__":
    main()
