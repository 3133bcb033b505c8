"""`edgemoe chat`: chat on stdin and stdout through the tokenizer's chat template."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from edgemoe import options

from .cannot_act import refuse_options_that_cannot_act, refuse_sampling_flags_if_greedy
from .common import load_served
from .options import checked, dense_bits_option, dtype_option, model_path, threads_option, with_store_options

@refuse_options_that_cannot_act
@with_store_options("ram", "vram", "device", "policy", "preload")
def chat(
    model: Optional[Path] = typer.Argument(None, help="Checkpoint directory or store (default: the bundled model)."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", "-n", callback=checked(options.integer_at_least, 1),
                                       help="Longest answer, in tokens."),
    temperature: Optional[float] = typer.Option(None, callback=checked(options.finite_at_least),
                                                help="0 = greedy (default: the model's generation_config)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", callback=checked(options.integer_at_least, 0)),
    top_p: Optional[float] = typer.Option(None, "--top-p", callback=checked(options.probability)),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    system: Optional[str] = typer.Option(None, "--system", help="A system message before the conversation."),
    dtype: str = dtype_option(),
    dense_bits: str = dense_bits_option(),
    threads: Optional[int] = threads_option(),
    store=None,
):
    """Chat on stdin/stdout through the tokenizer's chat template (/reset, /exit; Ctrl-C stops an answer)."""
    from edgemoe.chat import chat_loop
    from edgemoe.tokenizer import valid_text

    system = None if system is None else valid_text(system, "--system")
    if hasattr(sys.stdin, "reconfigure"):   # a line that is not UTF-8 reaches the loop, which refuses it
        sys.stdin.reconfigure(errors="surrogateescape")
    m = load_served(model, dtype, dense_bits, threads, store)
    refuse_sampling_flags_if_greedy(m, model_path(model), temperature,
                                     {"--top-k": top_k, "--top-p": top_p, "--seed": seed})
    sampling = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p).items() if v is not None}
    chat_loop(m, input, sys.stdout, max_new_tokens=max_new_tokens, system=system, seed=seed, **sampling)
