"""What several commands share: reading their inputs, the model serve and chat load, warnings and
sizes as they print them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional

from edgemoe import files
from edgemoe.bundled import BUNDLED_DIR
from edgemoe.errors import EdgeMoEError
from edgemoe.scheduling.profile import read_trace

from .options import model_path, torch_dtype


def read_text(path: Path) -> str:
    from edgemoe.tokenizer import valid_text

    try:
        return valid_text(path.read_bytes(), str(path))
    except FileNotFoundError:
        raise EdgeMoEError(f"{path}: text file not found") from None


def refuse_overwrite(path: Path, inputs, force: bool) -> None:
    """Before any work: never write over an input, nor over an existing file without --force."""
    files.refuse_overwrite(path, [p for p in inputs if p is not None], force, "--force")


def bundled_text_for(model: Path, name: str) -> Optional[Path]:
    """The bundled model's calib.txt / eval.txt when `model` is the bundled checkpoint."""
    return BUNDLED_DIR / name if model.resolve() == BUNDLED_DIR and (BUNDLED_DIR / name).exists() else None


def replay_for(spec, trace: Optional[Path]):
    """The trace's routing laid over the model (refused here, naming the file, if it does not fit)."""
    if trace is None:
        return None
    from edgemoe.replay import RoutingReplay

    return RoutingReplay(read_trace(trace), spec.moe_layer_ids, spec.num_experts, spec.top_k, str(trace))


def load_served(model: Optional[Path], dtype: str, dense_bits: str, kv_dtype: str, threads, store_options,
                context: Optional[int] = None, say: Callable[[str], None] = print):
    """The model for serve and chat (store options given for a checkpoint directory are refused), its
    context_length the served context (--context, None: auto; edgemoe.loader.served_context), which
    `say` reports where it is shorter than the model's."""
    import edgemoe
    from edgemoe.loader import require_decoder_only, served_context

    path = model_path(model)
    served = served_context(path, context, store_options, torch_dtype(dtype), dense_bits, kv_dtype)
    m = edgemoe.load(path, torch_dtype(dtype), threads, store=store_options, dense_bits=dense_bits,
                     kv_dtype=kv_dtype, context=served.tokens, cap_context=True)
    if served.shortened:
        say(f"serving a context of {served.tokens} tokens ({served.why})")
    warn_ram_auto(m)
    require_decoder_only(m.spec, path, "serving and chat (edgemoe serve / chat)")
    if m.tokenizer is None:
        raise EdgeMoEError(f"{path}: no tokenizer.json, cannot generate text")
    return m


def warn(message: str) -> None:
    sys.stdout.flush()
    print(f"\nwarning: {message}", file=sys.stderr, flush=True)


def warn_ram_auto(model) -> None:
    """Say so when --ram auto found no room for experts, or could not read the free memory."""
    breakdown = getattr(model.store, "ram_breakdown", None)
    if breakdown and "note" in breakdown:
        warn(f"--ram auto: {breakdown['note']} (edgemoe inspect STORE --ram auto shows why)")


def ram_breakdown_text(b: dict) -> str:
    """--ram auto's choice in one line: the budget, then what it was taken from (auto_ram's breakdown)."""
    held = ", ".join(f"{name.replace('_', ' ')} {size(b[name])}"
                     for name in ("dense", "kv_cache", "activations", "read_buffers", "runtime",
                                  "kernel_compile", "margin") if name in b)
    available = "unknown" if b["available"] is None else size(b["available"])
    note = f"; {b['note']}" if "note" in b else ""
    return (f"--ram auto: {size(b['budget'])} of {size(b['expert_bytes'])} of experts in RAM = "
            f"available {available} ({b['source']}) - {held}{note}")


def ram_growth_text(g: dict) -> str:
    """--ram auto's second look in one line (edgemoe.ram_growth): how much the RAM tier grew, and from what."""
    return (f"--ram auto, after {g['after_tokens']} tokens: grown by {size(g['grown_by'])} to "
            f"{size(g['capacity_before'] + g['grown_by'])} = available {size(g['available'])} - a step's peak "
            f"{size(g['transient'])} - KV cache growth {size(g['future'])} - room not yet filled "
            f"{size(g['capacity_before'] - g['cached'])} - margin {size(g['margin'])}")


def size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
