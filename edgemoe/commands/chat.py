"""`edgemoe chat`: chat on stdin and stdout through the tokenizer's chat template."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from edgemoe import options

from .cannot_act import refuse_sampling_flags_if_greedy
from .common import load_served
from .options import (COMPUTE, DENSE_BITS, DEVICE, DTYPE, FALLBACK_BELOW, KV_DTYPE, MODEL, POLICY, PRELOAD, RAM, SEED,
                      SERVED_CONTEXT, SKIP_BELOW, TEMPERATURE, THREADS, TOP_K, TOP_P, VRAM, as_store_options, checked,
                      model_path, sampling)


def chat(
    model: Optional[Path] = MODEL,
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", "-n", callback=checked(options.integer_at_least, 1),
                                       help="Longest answer, in tokens."),
    temperature: Optional[float] = TEMPERATURE,
    top_k: Optional[int] = TOP_K,
    top_p: Optional[float] = TOP_P,
    seed: Optional[int] = SEED,
    system: Optional[str] = typer.Option(None, "--system", help="A system message before the conversation."),
    ram: Optional[str] = RAM,
    vram: Optional[str] = VRAM,
    device: Optional[str] = DEVICE,
    policy: str = POLICY,
    preload: str = PRELOAD,
    skip_below: float = SKIP_BELOW,
    fallback_below: float = FALLBACK_BELOW,
    compute: str = COMPUTE,
    dtype: str = DTYPE,
    dense_bits: str = DENSE_BITS,
    kv_dtype: str = KV_DTYPE,
    context: Optional[int] = SERVED_CONTEXT,
    threads: Optional[int] = THREADS,
):
    """Chat on stdin/stdout through the tokenizer's chat template (/reset, /exit; Ctrl-C stops an answer)."""
    from edgemoe.chat import chat_loop
    from edgemoe.tokenizer import valid_text

    store_options = as_store_options(ram=ram, vram=vram, device=device, policy=policy, preload=preload,
                                     skip_below=skip_below, fallback_below=fallback_below, compute=compute)
    system = None if system is None else valid_text(system, "--system")
    if hasattr(sys.stdin, "reconfigure"):   # a line that is not UTF-8 reaches the loop, which refuses it
        sys.stdin.reconfigure(errors="surrogateescape")
    m = load_served(model, dtype, dense_bits, kv_dtype, threads, store_options, context,
                    say=lambda text: print(text, file=sys.stderr))
    refuse_sampling_flags_if_greedy(m, model_path(model), temperature,
                                     {"--top-k": top_k, "--top-p": top_p, "--seed": seed})
    chat_loop(m, input, sys.stdout, max_new_tokens=max_new_tokens, system=system, seed=seed,
              **sampling(temperature, top_k, top_p))
