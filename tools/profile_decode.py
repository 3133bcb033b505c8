"""Where a decode token's time goes: inside the kernels (dense matrix products, attention, the
experts' kernels) or outside them (Python glue, small torch ops, the store's bookkeeping).

Loads STORE with every expert in RAM, prefills a prompt, then times decode steps with a timer
around each kernel entry point (a few hundred calls a token; the timers cost well under 1%).

    python tools/profile_decode.py STORE [--prefill 512] [--tokens 32] [--dense-bits 8] [--threads N] [--cpu-time]
                                         [--per-expert] [--generic] [--by-layer] [--generated-routing]

With every expert resident, the decode engine (edgemoe/decode.py) runs a step's every layer in one
kernel call ("all layers"), where attention and experts cannot be told apart: --by-layer runs its
calls layer by layer instead (the attention block, then the MoE block: the same bits), to split them.
--per-expert computes each expert in its own kernel call (StoreExperts.layer_kernel off), to set
beside one call per layer. --generic runs without the decode engine.

--cpu-time counts this thread's CPU time instead of wall time: with --threads 1 every kernel runs on
the calling thread, so the split holds even on a busy machine (where wall time also counts the
waits for a core).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

import edgemoe
from edgemoe import kernels, quantized
from edgemoe.kernels import cpu_layer
from edgemoe.model import Segment

CLOCK = time.perf_counter
TOTALS: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def timed(kind: str, fn):
    def wrapper(*args, **kwargs):
        start = CLOCK()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[kind] += CLOCK() - start
            CALLS[kind] += 1
    return wrapper


def instrument(model) -> None:
    """Timers around every kernel the decode step calls (module attributes, so the callers see them)."""
    F.linear = timed("dense matmul", F.linear)
    # attention over the KV cache, in torch, any path: the model's attention kind's function
    model._attend = timed("attention", model._attend)
    # the decode engine's one call per layer: norms, projections, rotary, attention, router logits
    cpu_layer.attention_block_kernel = timed("attention block", cpu_layer.attention_block_kernel)
    cpu_layer.latent_attention_block_kernel = timed("attention block", cpu_layer.latent_attention_block_kernel)
    # the decode engine's MoE block: router, experts and their weighted sum, when every expert is resident
    cpu_layer.moe_block_kernel = timed("experts", cpu_layer.moe_block_kernel)
    if hasattr(cpu_layer, "shared_expert_kernel"):   # a shared expert beside the generic MoE block
        cpu_layer.shared_expert_kernel = timed("experts", cpu_layer.shared_expert_kernel)
    # or every layer of the step in one call (attention and experts not split: --by-layer splits them)
    cpu_layer.decode_token_kernel = timed("all layers", cpu_layer.decode_token_kernel)
    if hasattr(cpu_layer, "decode_latent_token_kernel"):   # the same for latent attention (DeepSeek)
        cpu_layer.decode_latent_token_kernel = timed("all layers", cpu_layer.decode_latent_token_kernel)
    kernels.qmatmul_int = timed("dense matmul", kernels.qmatmul_int)      # QuantizedLinear (--dense-bits)
    kernels.dequantize = timed("dense matmul", kernels.dequantize)
    for path, fn in list(quantized.FUSED.items()):
        quantized.FUSED[path] = timed("experts", fn)
    quantized.swiglu_experts_int = timed("experts", quantized.swiglu_experts_int)
    quantized.weighted_sum = timed("experts", quantized.weighted_sum)


def prefilled(store: str, threads: int | None, dense_bits: int | None, prefill: int, steps: int,
              generated_routing: bool):
    """(model, cache, next token): STORE loaded with every expert resident, a prompt of `prefill`
    random tokens prefilled; routed by a generated Mixtral-like trace long enough for `steps` decode
    steps after it, if generated_routing. tools/profile_threads.py starts the same way."""
    quantize = {"dense_bits": dense_bits} if dense_bits else {}   # (runs on older versions without)
    model = edgemoe.load(store, threads=threads, **quantize)
    if generated_routing:
        from edgemoe.bench import generated_routing as trace
        trace(model.spec, prefill + steps)[0].attach(model)
    for entry in model.store.experts():          # every expert resident before the timing
        model.store.get(*entry.key)
    cache = model.new_cache()
    prompt = torch.randint(0, model.spec.vocab_size, (prefill,), generator=torch.Generator().manual_seed(0))
    token = int(model.forward(prompt, [Segment(cache, prefill)], last_only=True)[-1].argmax())
    return model, cache, token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("store")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dense-bits", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cpu-time", action="store_true")
    parser.add_argument("--per-expert", action="store_true")
    parser.add_argument("--generic", action="store_true", help="without the decode engine (the generic forward)")
    parser.add_argument("--by-layer", action="store_true",
                        help="the engine's calls layer by layer, not one call for every layer (to split its time)")
    parser.add_argument("--generated-routing", action="store_true",
                        help="route by a generated Mixtral-like trace, as `edgemoe bench` does by default (a random-"
                             "weight model's own routers may send every token to the same few experts, in cache)")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.thread_time if args.cpu_time else time.perf_counter
    model, cache, token = prefilled(args.store, args.threads, args.dense_bits, args.prefill, 4 + args.tokens,
                                    args.generated_routing)
    model.experts.layer_kernel = not args.per_expert
    if args.generic:
        model.decode_engine = None
    if args.by_layer:
        model.experts.resident_step_layouts = lambda first: None
    for _ in range(4):                            # warm every path
        token = int(model.forward(torch.tensor([token]), [Segment(cache, 1)], last_only=True)[-1].argmax())
    instrument(model)
    start = CLOCK()
    for _ in range(args.tokens):
        token = int(model.forward(torch.tensor([token]), [Segment(cache, 1)], last_only=True)[-1].argmax())
    total = (CLOCK() - start) / args.tokens
    model.close()
    print(f"{args.store}: dense bits {args.dense_bits or 'as loaded'}, threads {args.threads or 'auto'}, "
          f"{'one kernel call per expert' if args.per_expert else 'one kernel call per layer'}, "
          f"prefill {args.prefill}, {args.tokens} tokens, {'CPU' if args.cpu_time else 'wall'} time; load average {os.getloadavg()[0]:.2f}")
    print(f"{'part':>14} {'ms/token':>9} {'share':>6} {'calls/token':>11}")
    inside = 0.0
    for kind in ("dense matmul", "attention", "attention block", "experts", "all layers"):
        ms = TOTALS[kind] / args.tokens
        inside += ms
        print(f"{kind:>14} {ms * 1e3:9.2f} {ms / total:6.1%} {CALLS[kind] / args.tokens:11.0f}")
    outside = total - inside
    print(f"{'outside':>14} {outside * 1e3:9.2f} {outside / total:6.1%}")
    print(f"{'total':>14} {total * 1e3:9.2f}")


if __name__ == "__main__":
    main()
