#!/usr/bin/env python
"""The VRAM tier and the device compute path on a real GPU, beside the CPU-only run of the same store.

    python tools/bench_device.py STORE [--device cuda] [--threads 2] [--prefill 128] [--tokens 32]
                                       [--repeats 3] [--setups ram,vram-all,...] [--breakdown] [--json F]

Setups, each loaded fresh from STORE with every expert resident before the timing:
  ram             every expert in RAM (the CPU path: the decode engine where it applies)
  vram-all        every expert in VRAM (ram=0): dequantized and multiplied on the device, a layer's
                  experts sharing one copy of their rows there and one back, those of one shape and
                  width dequantized together
  vram-all-alone  as vram-all, each expert dequantized on its own (device_batch_bytes=0: the code before
                  a layer's experts of one shape and width were dequantized together)
  vram-all-each   the same, one expert at a time (StoreExperts.layer_kernel off): a round trip each
  vram-half       half the expert bytes in VRAM, the rest in RAM (each expert computed where it is)
  device-compute  every expert in RAM, copied to the device and computed there per use (compute="device")

Per setup: seconds to load with every expert resident, prefill seconds for a prompt of --prefill
tokens, decode milliseconds per token (median of --repeats timed runs of --tokens greedy steps after
4 warm-up steps), where the experts are resident, and the greedy tokens against the "ram" setup's.
With --dtype float32 (the default) the prompt's last logits are also compared with RAM experts on
the float kernels (compute="fused-float"): the device path differs from them by float32 summation
order only. --breakdown times the parts of one VRAM expert's one-token call. With --device cpu the
CPU stands in for the GPU (a check of the script, not a measurement of a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

import torch

import edgemoe
from edgemoe.model import Segment

SETUPS = {
    "ram": dict(),
    "vram-all": dict(ram=0, vram="100%"),
    "vram-all-alone": dict(ram=0, vram="100%"),       # with device_batch_bytes=0
    "vram-all-each": dict(ram=0, vram="100%"),        # with layer_kernel off: one round trip per expert
    "vram-half": dict(vram="50%"),
    "device-compute": dict(vram=1, compute="device"),
}
ONE_CALL_EACH = {"vram-all-each"}
DEQUANTIZED_ALONE = {"vram-all-alone", "vram-all-each"}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_setup(store: str, name: str, args) -> dict:
    options = dict(SETUPS[name])
    if "vram" in options:
        options["device"] = args.device
    start = time.perf_counter()
    model = edgemoe.load(store, getattr(torch, args.dtype), threads=args.threads, preload="none", **options)
    for entry in model.store.experts():      # every expert resident (VRAM first while it has room)
        model.store.get(*entry.key)
    load_s = time.perf_counter() - start
    model.experts.layer_kernel = name not in ONE_CALL_EACH
    if name in DEQUANTIZED_ALONE:
        model.experts.device_batch_bytes = 0
    prompt = torch.randint(0, model.spec.vocab_size, (args.prefill,), generator=torch.Generator().manual_seed(0))
    decode_ms, tokens = [], []
    for repeat in range(args.repeats):
        cache = model.new_cache()
        start = time.perf_counter()
        logits = model.forward(prompt, [Segment(cache, args.prefill)], last_only=True)[-1]
        _sync(args.device)
        prefill_s = time.perf_counter() - start
        token = int(logits.argmax())
        run = [token]
        for _ in range(4):
            token = int(model.forward(torch.tensor([token]), [Segment(cache, 1)], last_only=True)[-1].argmax())
            run.append(token)
        start = time.perf_counter()
        for _ in range(args.tokens):
            token = int(model.forward(torch.tensor([token]), [Segment(cache, 1)], last_only=True)[-1].argmax())
            run.append(token)
        decode_ms.append((time.perf_counter() - start) / args.tokens * 1e3)
        tokens = run
    record = {"setup": name, "options": dict(options), "load_s": round(load_s, 2),
              "prefill_s": round(prefill_s, 3), "decode_ms_per_token": round(statistics.median(decode_ms), 2),
              "decode_ms_runs": [round(t, 2) for t in decode_ms],
              "resident": dict(Counter(model.store.resident().values())), "tokens": tokens,
              "last_logits": logits.float().cpu()}
    model.close()
    return record


def breakdown(store: str, args) -> None:
    """Where one VRAM expert's one-token call goes, each part timed alone with the device synchronized
    (medians of 30 calls, 3 rounds); then a decode step's top-k experts of a layer, each alone and
    dequantized together."""
    from edgemoe.kernels.device import batch_key, swiglu_batch_on_device, swiglu_on_device, weights_on_device
    from edgemoe.latency import median_time

    model = edgemoe.load(store, threads=args.threads, preload="none", ram=0, vram="100%", device=args.device)
    r = model.store.get(0, 0)
    x = torch.randn(1, model.spec.hidden_size)
    xd = x.to(args.device)

    def synced(fn):
        def run():
            fn()
            _sync(args.device)
        return run
    k = model.spec.top_k
    layer = [model.store.get(r.entry.key[0], e) for e in range(k)]
    xk = torch.randn(k, model.spec.hidden_size).to(args.device)

    def each_alone():
        return [swiglu_on_device(xk[j:j + 1], e.entry.tensors, e.device_tensors) for j, e in enumerate(layer)]

    def together():
        return swiglu_batch_on_device(xk, [1] * k, r.entry.tensors, [e.device_tensors for e in layer])
    parts = {"one VRAM expert, input to device": lambda: x.to(args.device),
             "one VRAM expert, dequantize 3 matrices": lambda: weights_on_device(r.entry.tensors, r.device_tensors),
             "one VRAM expert, whole expert on device": lambda: swiglu_on_device(xd, r.entry.tensors, r.device_tensors),
             "one VRAM expert, result to host": lambda: xd.cpu()}
    if len({batch_key(e.entry.tensors) for e in layer}) == 1:       # one width: they batch
        parts |= {f"{k} experts of a layer, each alone": each_alone,
                  f"{k} experts of a layer, dequantized together": together}
    for name, fn in parts.items():
        rounds = [median_time(synced(fn), 30) * 1e6 for _ in range(3)]
        print(f"  {name}: {' '.join(f'{t:.0f}' for t in rounds)} us (3 rounds)")
    model.close()


def reference_logits(store: str, args) -> torch.Tensor:
    model = edgemoe.load(store, torch.float32, threads=args.threads, preload="none", compute="fused-float")
    prompt = torch.randint(0, model.spec.vocab_size, (args.prefill,), generator=torch.Generator().manual_seed(0))
    logits = model.forward(prompt, [Segment(model.new_cache(), args.prefill)], last_only=True)[-1].float()
    model.close()
    return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("store")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--breakdown", action="store_true", help="also time the parts of one VRAM expert's call")
    args = parser.parse_args()
    names = args.setups.split(",")
    reference = reference_logits(args.store, args) if args.dtype == "float32" else None
    records = [run_setup(args.store, name, args) for name in names]
    base = next((r for r in records if r["setup"] == "ram"), records[0])
    print(f"{args.store}: threads {args.threads}, dtype {args.dtype}, prefill {args.prefill}, {args.tokens} tokens "
          f"x {args.repeats} runs, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    print(f"{'setup':>15} {'load s':>7} {'prefill s':>9} {'decode ms':>9} {'x ram':>6} {'same tokens':>11} "
          f"{'max |dlogit|':>12}  resident")
    for r in records:
        diff = (r["last_logits"] - reference).abs().max().item() if reference is not None else float("nan")
        same = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))
        print(f"{r['setup']:>15} {r['load_s']:7.2f} {r['prefill_s']:9.3f} {r['decode_ms_per_token']:9.2f} "
              f"{base['decode_ms_per_token'] / r['decode_ms_per_token']:6.2f} {same:>5}/{len(r['tokens']):<5} "
              f"{diff:12.2e}  {r['resident']}")
        r["max_logit_diff_vs_fused_float"] = diff
    if args.breakdown:
        breakdown(args.store, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "last_logits"} for r in records], f, indent=1)


if __name__ == "__main__":
    main()
