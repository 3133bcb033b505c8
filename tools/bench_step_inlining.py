"""The decode engine's one-call step with its blocks called as compiled functions (the kernels as
they are) against the same step with them inlined into it (numba compiles each block again inside
the step; the kernels before they were split), alternated token by token in one process, so that
the drift between processes stays out of the ratio.

    python tools/bench_step_inlining.py STORE [--prefill 512] [--tokens 200] [--threads 2]

STORE: a store whose model the step kernel runs (grouped-query attention, softmax-routed MoE layers),
every expert made resident; dense matrices at 4 bits. Routing: the model's own (greedy decoding of
a fixed prompt). Prints each variant's median token time and their compile times.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import numba
import torch

import edgemoe
from edgemoe.kernels import cpu_int, cpu_layer
from edgemoe.kernels._jit import EXACT, EXACT_INLINE
from edgemoe.model import Segment


def rebuilt(fn, options: dict, **globals_replaced):
    """fn's Python function jitted with `options`, its module globals replaced where named."""
    py = fn.py_func
    namespace = dict(py.__globals__, **globals_replaced)
    return numba.njit(**dict(options, cache=False))(types.FunctionType(py.__code__, namespace, py.__name__,
                                                                       py.__defaults__, py.__closure__))


def inlined_step():
    """decode_token_kernel with _attention_block, _moe_block and swiglu_experts_int inlined: one
    parallel function, as the step kernel was compiled before its blocks became functions."""
    experts = rebuilt(cpu_int.swiglu_experts_int, EXACT_INLINE)
    moe = rebuilt(cpu_layer._moe_block, EXACT_INLINE, swiglu_experts_int=experts)
    attention = rebuilt(cpu_layer._attention_block, EXACT_INLINE)
    return rebuilt(cpu_layer.decode_token_kernel, dict(EXACT, parallel=True), _attention_block=attention,
                   _moe_block=moe)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    variants = {"called": cpu_layer.decode_token_kernel, "inlined": inlined_step()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    with edgemoe.load(args.store, dense_bits=4, preload="none", threads=args.threads) as model:
        for entry in model.store.experts():
            model.store.get(*entry.key)
        cache = model.new_cache()
        prompt = torch.randint(0, model.spec.vocab_size, (args.prefill,), generator=torch.Generator().manual_seed(0))
        token = int(model.forward(prompt, [Segment(cache, args.prefill)])[-1].argmax())
        for name, kernel in variants.items():   # compile (or load) each before timing
            cpu_layer.decode_token_kernel = kernel
            start = time.perf_counter()
            token = int(model.forward(torch.tensor([token]), [Segment(cache, 1)])[-1].argmax())
            print(f"{name}: first step {time.perf_counter() - start:.1f} s (compiles on an empty cache)")
        for i in range(args.tokens):
            name = list(variants)[i % 2]
            cpu_layer.decode_token_kernel = variants[name]   # the engine looks the kernel up at each call
            start = time.perf_counter()
            token = int(model.forward(torch.tensor([token]), [Segment(cache, 1)])[-1].argmax())
            times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        print(f"{name}: median token {statistics.median(t) * 1e3:.2f} ms over {len(t)} tokens")
    print(f"inlined / called: {statistics.median(times['inlined']) / statistics.median(times['called']):.3f}")


if __name__ == "__main__":
    main()
