"""`edgemoe run`: generate text from a checkpoint directory or a store, streamed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from edgemoe import options
from edgemoe.errors import EdgeMoEError
from edgemoe.stats import format_stats, run_stats

from .cannot_act import refuse_sampling_flags_if_greedy
from .common import ram_breakdown_text, ram_growth_text, replay_for, warn, warn_ram_auto
from .options import (COMPUTE, DENSE_BITS, DEVICE, DTYPE, FALLBACK_BELOW, KV_DTYPE, MODEL, POLICY, PRELOAD, RAM, SEED,
                      SKIP_BELOW, TEMPERATURE, THREADS, TOP_K, TOP_P, VRAM, as_store_options, checked, model_path,
                      sampling, torch_dtype)

# --ram auto's allowance for tokens a prompt gains past its text: BOS/EOS-like specials, and a chat
# template's role markers and system text (the bundled templates add well under this).
SPECIAL_TOKENS = 16
CHAT_TEMPLATE_TOKENS = 256


def run(
    model: Optional[Path] = MODEL,
    prompt: str = typer.Option("", "--prompt", "-p", help="Text to continue (default: start from nothing)."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", "-n", callback=checked(options.integer_at_least, 0)),
    temperature: Optional[float] = TEMPERATURE,
    top_k: Optional[int] = TOP_K,
    top_p: Optional[float] = TOP_P,
    seed: Optional[int] = SEED,
    stop: List[str] = typer.Option([], "--stop", callback=checked(lambda v, flag: options.unescape(v)),
                                   help="Stop when this text is produced (repeatable; \\n, \\t are read as "
                                   "newline and tab)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the tokenizer's chat template."),
    truncate: bool = typer.Option(False, "--truncate", help="A prompt longer than the model's context keeps its "
                                  "last tokens (default: refused)."),
    stats: bool = typer.Option(False, "--stats", help="Print speed and cache figures after the text."),
    replay: Optional[Path] = typer.Option(None, "--replay", help="Route by this trace instead of the routers "
                                          "(a random-weight model routed as a real one was)."),
    beams: Optional[int] = typer.Option(None, "--beams", callback=checked(options.integer_at_least, 1),
                                        help="Beam search with this many beams, run together through each layer; "
                                        "prints the best beam (not streamed)."),
    length_penalty: Optional[float] = typer.Option(None, "--length-penalty", callback=checked(options.finite_number),
                                                   help="With --beams: a finished beam scores its summed "
                                                   "log-probabilities / length ** this (default 1)."),
    early_stopping: bool = typer.Option(False, "--early-stopping", help="With --beams: stop as soon as --beams "
                                        "beams have finished."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Speculative decoding: a draft model that proposes "
                                        "tokens the model checks in one step, a checkpoint directory or store with "
                                        "the same tokenizer, or 'self': this model with low-width experts, a store's "
                                        "fallback copies (convert --fallback-bits) cached within --ram, else (a "
                                        "checkpoint) INT2 copies in RAM (cap: --draft-ram). "
                                        "Off, with a warning, for a store without fallback copies under --ram, and "
                                        "where it reads more expert bytes per token than plain decoding."),
    speculate: Optional[int] = typer.Option(None, "--speculate", callback=checked(options.integer_at_least, 1),
                                            help="With --draft: tokens the draft proposes per round (default 4)."),
    draft_ram: Optional[str] = typer.Option(None, "--draft-ram", callback=checked(options.parse_bytes),
                                            help="With --draft self and INT2 copies: RAM for them, bytes "
                                            "like 64MiB (default: unlimited; least recently used dropped first)."),
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
    threads: Optional[int] = THREADS,
):
    """Generate text, streamed as it is produced, from a checkpoint directory or a store."""
    import edgemoe
    from edgemoe.loader import require_decoder_only
    from edgemoe.speculative import speculator_for
    from edgemoe.tokenizer import valid_text

    store_options = as_store_options(ram=ram, vram=vram, device=device, policy=policy, preload=preload,
                                     skip_below=skip_below, fallback_below=fallback_below, compute=compute)
    prompt, stop = valid_text(prompt, "--prompt"), [valid_text(s, "--stop") for s in stop]
    path = model_path(model)
    context = _run_context(prompt, chat, max_new_tokens, (speculate or 4) if draft else 0)
    m = edgemoe.load(path, torch_dtype(dtype), threads, store=store_options, dense_bits=dense_bits, kv_dtype=kv_dtype,
                     context=context, batch=beams or 1)
    warn_ram_auto(m)
    for flag, given in (("--beams", beams is not None), ("--replay", replay is not None),
                        ("--draft", draft is not None)):
        if given:
            require_decoder_only(m.spec, path, flag)
    if replay is not None:
        replay_for(m.spec, replay).attach(m)
    if m.tokenizer is None:
        raise EdgeMoEError(f"{path}: no tokenizer.json, cannot generate text")
    refuse_sampling_flags_if_greedy(m, path, temperature, {"--top-k": top_k, "--top-p": top_p, "--seed": seed})
    speculator = None
    if draft is not None:
        speculator = speculator_for(m, draft, speculate or 4, draft_ram, torch_dtype(dtype), threads)
    seen = _prompt_seen(m, prompt, chat, max_new_tokens, truncate)
    if beams is not None:
        sys.stdout.write(_best_beam_text(m, seen, beams, max_new_tokens, length_penalty, early_stopping, truncate))
    else:
        m.generate(seen, on_text=lambda piece: (sys.stdout.write(piece), sys.stdout.flush()),
                   on_warning=warn, max_new_tokens=max_new_tokens, seed=seed, stop_strings=tuple(stop),
                   truncate=truncate, **({"decoder": speculator.decode} if speculator else {}),
                   **sampling(temperature, top_k, top_p))
    sys.stdout.write("\n")
    if stats:
        _print_run_stats(m, speculator.stats if speculator else None)
    if speculator is not None:
        speculator.close()


def _prompt_seen(model, prompt: str, chat: bool, max_new_tokens: int, truncate: bool) -> list[int]:
    """The prompt's token ids as the model will see them, echoed (not with --chat) only once they are:
    a prompt past the context is refused before anything is printed, and a truncated one is shown
    as its kept tokens, not as it was given."""
    from edgemoe.generate import GenerationOptions, fit_context

    # The chat template writes its own special tokens: encoded without adding them again.
    ids = model.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else model.tokenizer.encode(prompt)
    seen = fit_context(model, ids, GenerationOptions(max_new_tokens=max_new_tokens, truncate=truncate), warn)
    if not chat:
        sys.stdout.write(prompt if len(seen) == len(ids) else model.tokenizer.decode(seen))
    return seen


def _run_context(prompt: str, chat: bool, max_new_tokens: int, speculate: int) -> int:
    """The tokens a run's KV cache may hold, for --ram auto, before the prompt is tokenized: its UTF-8
    bytes (a byte-level BPE or a byte-fallback tokenizer makes at most one token per byte), an
    allowance for special tokens and the chat template, the new tokens and a speculative round's
    draft tokens."""
    allowance = CHAT_TEMPLATE_TOKENS if chat else SPECIAL_TOKENS
    return len(prompt.encode("utf-8")) + allowance + max_new_tokens + speculate


def _best_beam_text(model, prompt_ids: list[int], beams: int, max_new_tokens: int, length_penalty,
                    early_stopping: bool, truncate: bool) -> str:
    from edgemoe.beam import beam_search
    from edgemoe.generate import StopStringStream

    penalty = 1.0 if length_penalty is None else length_penalty
    hypotheses = beam_search(model, prompt_ids, beams, max_new_tokens, penalty, early_stopping, truncate=truncate,
                             warn=warn)
    stream = StopStringStream(model.tokenizer)     # decoded as generate decodes its tokens
    for token in hypotheses[0][0] if hypotheses else []:
        stream.push(token)
    stream.finish()
    return stream.text


def _print_run_stats(model, speculation=None) -> None:
    breakdown = getattr(model.store, "ram_breakdown", None)
    if breakdown:
        print(f"[stats] {ram_breakdown_text(breakdown)}", file=sys.stderr)
        if "grown" in breakdown:
            print(f"[stats] {ram_growth_text(breakdown['grown'])}", file=sys.stderr)
    for line in format_stats(run_stats(model, speculation)):
        print(f"[stats] {line}", file=sys.stderr)
