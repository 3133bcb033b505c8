"""An encoder-decoder store's decoder steps (Switch Transformers) three ways in one process, alternated
token by token.

    python tools/bench_seq2seq_decode.py STORE --prompt 256 --tokens 64 --threads 2

- engine: the commands' default (--dense-bits auto), each decoder layer in the decode engine's kernel
  call (edgemoe/decode.py's EncoderDecoderEngine);
- generic: the same model, its engine off: the generic forward over the same quantized matrices;
- as-stored: --dense-bits none, the generic forward over the dense matrices as stored (what
  encoder-decoder stores ran before they had an engine).

Every expert is read into RAM before the timing (all resident) unless --ram gives the RAM tier a
budget (then they are read as routed). Each model encodes the same random prompt three times (timed,
alternated: the engine does not run the encoder), then decodes greedily from it, one token of each
in turn, timing each decode() call and splitting its time by the model's Timings (the attention
blocks, which in the engine include a dense layer's MLP; the MoE blocks; the rest: embedding, final
norm, LM head). On these shared 2-vCPU machines one process's speed drifts by up to 2x from the next
one's; alternating within one process keeps the drift out of the ratios. Prints the median
milliseconds a token of each, their ratios to the engine's, and the median encode time.

With PYTHONPATH set to an older source tree, the same runs measure that tree (one without the
engine runs "engine" on the generic forward).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import torch

import edgemoe


def load(store: str, dense_bits, ram: str | None, engine: bool):
    model = edgemoe.load(store, dense_bits=dense_bits, **({"ram": ram} if ram else {}))
    if not engine:
        model.decode_engine = None
    if ram is None:   # every expert read before the timing: all resident, as a model that fits runs
        for entry in model.store.experts():
            model.store.get(*entry.key)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens (random ids)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ram", default=None, help="the RAM tier (default: the store's default)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    models = {"engine": load(args.store, "auto", args.ram, True), "generic": load(args.store, "auto", args.ram, False),
              "as-stored": load(args.store, None, args.ram, False)}
    spec = models["engine"].spec
    if not spec.is_encoder_decoder:
        parser.error(f"{args.store}: not an encoder-decoder store")
    prompt = torch.randint(0, spec.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0))
    encode_times = {name: [] for name in models}
    for _ in range(3):
        for name, model in models.items():
            start = time.perf_counter()
            model.encode(prompt)
            encode_times[name].append(time.perf_counter() - start)
    states = {name: m.start(m.encode(prompt)) for name, m in models.items()}
    for model in models.values():
        model.timings.reset()   # the decoder steps' alone
    tokens = {name: spec.stacks.decoder_start_token_id for name in models}
    times = {name: [] for name in models}
    for _ in range(args.tokens):
        for name, model in models.items():
            start = time.perf_counter()
            logits = model.decode([tokens[name]], states[name])
            times[name].append(time.perf_counter() - start)
            tokens[name] = int(logits[-1].argmax())
    engine = statistics.median(times["engine"])
    print(f"{args.store}: prompt {args.prompt}, {args.tokens} tokens, {args.threads} threads, "
          f"dense bits {getattr(models['engine'], 'dense_bits', None)}")
    for name, samples in times.items():
        median = statistics.median(samples)
        t = models[name].timings
        split = ", ".join(f"{part} {seconds / t.total:.0%}" for part, seconds in
                          (("attention blocks", t.attention), ("MoE blocks", t.experts), ("other", t.other)))
        print(f"{name:10s} {median * 1e3:8.2f} ms/token  {median / engine:5.2f}x the engine's time  ({split}); "
              f"encode {statistics.median(encode_times[name]) * 1e3:.0f} ms")
    for model in models.values():
        model.close()


if __name__ == "__main__":
    main()
