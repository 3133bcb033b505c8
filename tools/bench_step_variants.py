"""The decode engine's one-call step as it is, against variants of it built beside it, alternated
token by token in one process (so that the drift between processes stays out of the ratios):

- inlined: the attention block, the MoE block and the experts' layer kernel inlined into the step
  (numba then compiles each again inside it), as the step was compiled before they became
  functions of their own;
- projections-inlined: the attention block's matrix products inlined at each call site, as they were
  before they became one function of their own (`cpu_layer._matrix_product`);
- attention-in-one-function: the attention block one parallel function, its three compiled parts
  (`_gqa_projections`, `_cached_attention`, `_output`) inlined into it, as it was before the split;
- loop-written-out: the step's loop over its layers written in the kernel, as it was before both step
  kernels shared it (`cpu_layer._token_layers`, which takes the attention block as an argument);
- layer-by-layer: no step kernel, each layer's attention block and MoE block in a call of its own
  (what a model runs when its step cannot run whole), on the same resident experts;
- array-expressions: the MoE block's copies and zeroing, and the zeroed activation codes of the
  projections and of the experts' layer kernel, as array expressions (`rows[a, :] = h`,
  `np.zeros`), as they were written before: in a parallel function numba makes each such expression
  a parallel region of its own.

    python tools/bench_step_variants.py STORE [--variants inlined projections-inlined attention-in-one-function array-expressions
                                              loop-written-out layer-by-layer] [--prefill 512] [--tokens 300]
                                              [--threads 2]

STORE: a store whose model the step kernel runs (grouped-query attention, softmax-routed MoE layers;
latent attention for layer-by-layer alone), every expert made resident; dense matrices at 4 bits;
greedy decoding of a random prompt. Prints each variant's first step (its compile, on an empty
cache) and median token time.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import numba
import numpy as np
import torch

import edgemoe
from edgemoe.kernels import cpu_int, cpu_layer
from edgemoe.kernels._jit import EXACT, EXACT_INLINE
from edgemoe.model import Segment

PARALLEL = dict(EXACT, parallel=True)

# The MoE block as it was written with array expressions (cpu_layer's names in scope).
ARRAY_EXPRESSIONS = '''
def moe_block_kernel(path, layouts, h, logits, top_k, router, table, jitter, scaling, replayed, x, weights, experts, nblocks):
    if not replayed:
        _route(router, logits, table, jitter, top_k, weights, experts)
        if scaling != 1:
            for a in range(top_k):
                weights[a] = weights[a] * scaling
    order = np.argsort(experts, kind="mergesort")
    dim = h.shape[0]
    chosen = np.empty((top_k, layouts.shape[1]), np.int64)
    rows = np.empty((top_k, dim), np.float32)
    for a in range(top_k):
        chosen[a, :] = layouts[experts[order[a]], :]
        rows[a, :] = h
    starts = np.arange(top_k + 1)
    y = np.empty((top_k, dim), np.float32)
    swiglu_experts_int(path, chosen, starts, rows, layouts[0, INNER], y, nblocks)
    out = np.zeros(dim, np.float32)
    for a in range(top_k):
        w = weights[order[a]]
        for c in range(dim):
            out[c] = out[c] + y[a, c] * w
    _add_shared_expert(path, table, h, out, nblocks)
    for c in range(dim):
        x[c] = x[c] + out[c]

'''


def rebuilt(fn, options: dict, **globals_replaced):
    """fn's Python function jitted with `options`, its module globals replaced where named."""
    py = fn.py_func
    namespace = dict(py.__globals__, **globals_replaced)
    return numba.njit(**dict(options, cache=False))(types.FunctionType(py.__code__, namespace, py.__name__,
                                                                       py.__defaults__, py.__closure__))


def inlined_step():
    experts = rebuilt(cpu_int.swiglu_experts_int, EXACT_INLINE)
    moe = rebuilt(cpu_layer.moe_block_kernel, EXACT_INLINE, swiglu_experts_int=experts)
    attention = attention_block(cpu_layer._project, EXACT_INLINE)
    return rebuilt(cpu_layer.decode_token_kernel, PARALLEL, attention_block_kernel=attention, moe_block_kernel=moe)


@numba.njit(**dict(EXACT_INLINE, cache=False))
def np_zeroed_codes(rows, cols):
    return np.zeros((rows, cols), np.int8)


def array_expressions_step():
    experts = rebuilt(cpu_int.swiglu_experts_int, PARALLEL, zeroed_codes=np_zeroed_codes)
    namespace = dict(vars(cpu_layer), swiglu_experts_int=experts)
    exec(ARRAY_EXPRESSIONS, namespace)
    moe = numba.njit(**dict(PARALLEL, cache=False))(namespace["moe_block_kernel"])
    product = rebuilt(cpu_layer._matrix_product, PARALLEL, zeroed_codes=np_zeroed_codes)
    project = rebuilt(cpu_layer._project, EXACT_INLINE, _matrix_product=product)
    return rebuilt(cpu_layer.decode_token_kernel, EXACT, attention_block_kernel=attention_block(project),
                   moe_block_kernel=moe)


# decode_token_kernel as it was written before the loop became cpu_layer._token_layers.
LOOP_WRITTEN_OUT = '''
def decode_token_kernel(path, tables, dims, eps, scale, clip, x, cos, sin, kv, kv_like, pos, layouts, top_k,
                        router, jitter, scaling, replayed, hs, weights, experts, nblocks):
    heads, dk, dv = dims[DIM_K], dims[DIM_DK], dims[DIM_DV]
    logits = np.empty(layouts.shape[1], np.float32)
    for l in range(tables.shape[0]):
        keys = like_view(kv[l, 0], (heads, kv[l, 2], dk), kv_like)
        values = like_view(kv[l, 1], (heads, kv[l, 2], dv), kv_like)
        attention_block_kernel(path, tables[l], dims, eps, scale, clip, x, cos, sin, keys, values, pos, hs[l], logits,
                         nblocks)
        moe_block_kernel(path, layouts[l], hs[l], logits, top_k, router, tables[l], jitter, scaling, replayed, x,
                   weights[l], experts[l], nblocks)
'''


def loop_written_out_step():
    namespace = dict(vars(cpu_layer))
    exec(LOOP_WRITTEN_OUT, namespace)
    return numba.njit(**dict(EXACT, cache=False))(namespace["decode_token_kernel"])


def attention_block(project, options=PARALLEL):
    """cpu_layer.attention_block_kernel as one function (`options`: compiled, or inlined into its caller)
    with its three compiled parts inlined into it, as it was written before they were split (so that
    another cache element type compiles only the part that reads the cache), around `project`."""
    qkv = rebuilt(cpu_layer._gqa_qkv, EXACT_INLINE, _project=project)
    parts = {name: rebuilt(getattr(cpu_layer, name), EXACT_INLINE, _project=project, _gqa_qkv=qkv)
             for name in ("_gqa_projections", "_cached_attention", "_output")}
    return rebuilt(cpu_layer.attention_block_kernel, options, **parts)


def attention_in_one_function_step():
    return rebuilt(cpu_layer.decode_token_kernel, EXACT, attention_block_kernel=attention_block(cpu_layer._project))


def projections_inlined_step():
    project = rebuilt(cpu_layer._matrix_product, EXACT_INLINE)   # the same arguments as _project
    return rebuilt(cpu_layer.decode_token_kernel, EXACT, attention_block_kernel=attention_block(project))


VARIANTS = {"inlined": inlined_step, "projections-inlined": projections_inlined_step,
            "attention-in-one-function": attention_in_one_function_step,
            "array-expressions": array_expressions_step, "loop-written-out": loop_written_out_step,
            "layer-by-layer": lambda: None}   # None: no step kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    kernels = {"as is": cpu_layer.decode_token_kernel, **{name: VARIANTS[name]() for name in args.variants}}
    times: dict[str, list[float]] = {name: [] for name in kernels}
    with edgemoe.load(args.store, dense_bits=4, preload="none", threads=args.threads) as model:
        for entry in model.store.experts():
            model.store.get(*entry.key)
        cache = model.new_cache()
        prompt = torch.randint(0, model.spec.vocab_size, (args.prefill,), generator=torch.Generator().manual_seed(0))
        token = int(model.forward(prompt, [Segment(cache, args.prefill)])[-1].argmax())
        step_layouts = model.experts.resident_step_layouts

        def step(kernel) -> float:
            nonlocal token
            if kernel is None:
                model.experts.resident_step_layouts = lambda first: None
            else:
                model.experts.resident_step_layouts = step_layouts
                cpu_layer.decode_token_kernel = kernel   # the engine looks the kernel up on the module at each call
            start = time.perf_counter()
            token = int(model.forward(torch.tensor([token]), [Segment(cache, 1)])[-1].argmax())
            return time.perf_counter() - start

        for name, kernel in kernels.items():
            print(f"{name}: first step {step(kernel):.1f} s (compiles on an empty cache)")
        for i in range(args.tokens):
            name = list(kernels)[i % len(kernels)]
            times[name].append(step(kernels[name]))
    base = statistics.median(times["as is"])
    for name, t in times.items():
        print(f"{name}: median token {statistics.median(t) * 1e3:.2f} ms over {len(t)} tokens, "
              f"{statistics.median(t) / base:.3f}x as is")


if __name__ == "__main__":
    main()
