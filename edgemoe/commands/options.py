"""Options several commands take, defined once, and the typer callbacks that check a value where it
enters: each error names the flag (OptionError: one line, exit status 2)."""

from __future__ import annotations

import functools
from inspect import Parameter, signature as signature_of
from pathlib import Path
from typing import Optional

import typer

from edgemoe import options

DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


# ---- options checked where they enter: each error names the flag (OptionError, one line, exit 2) ----
def flag_of(param) -> str:
    return max(param.opts, key=len)


def checked(check, *args):
    """A typer callback running an edgemoe.options check on the option's value(s)."""
    def callback(param: typer.CallbackParam, value):
        if isinstance(value, (list, tuple)):
            return [check(v, flag_of(param), *args) for v in value]
        return check(value, flag_of(param), *args)
    return callback


def dtype_option():
    return typer.Option("auto", "--dtype", callback=checked(options.one_of, tuple(DTYPES)),
                        help="Dense weight matrices: auto (as the checkpoint stores them where the CPU computes that "
                        "type natively, else float32), float32, bfloat16 or float16. Activations are float32.")


def dense_bits_option():
    return typer.Option("auto", "--dense-bits", callback=checked(options.dense_bits),
                        help="The dense projections and the LM head at load: auto (8 bits for a store of a "
                        "decoder-only model, else as loaded), none (as loaded: --dtype), 8 or 4 bits (fewer "
                        "bytes per token; the embedding and routers stay as --dtype says).")


def threads_option():
    return typer.Option(None, "--threads", callback=checked(options.thread_count),
                        help="Threads for the kernels (default: the cores other processes leave free, "
                        "followed as the load changes).")


def force_option(what: str):
    return typer.Option(False, "--force", help=f"Replace an existing {what}; never an input of the command.")


def quiet_option():
    return typer.Option(False, "--quiet", "-q", help="No progress bars (they are shown only on a terminal).")


def torch_dtype(name: str):
    import torch
    return None if DTYPES[name] is None else getattr(torch, DTYPES[name])


MODEL_HELP = "Checkpoint directory or store (default: the bundled model)."


def model_path(model: Optional[Path]) -> Path:
    if model is not None:
        return model
    from edgemoe.bundled import bundled_model_path
    return bundled_model_path()


def ram_option(default="auto", help_text="Store only: RAM for experts, bytes (512MiB), a share of the store's "
               "expert bytes (25%) or auto (default: what the memory free to this process leaves after the dense "
               "weights, KV cache and a margin; docs/scheduling.md)."):
    return typer.Option(default, "--ram", help=help_text)


# The store's flags, shared by every command that runs a model (see with_store_options).
STORE_FLAGS = {
    "ram": (Optional[str], ram_option),
    "vram": (Optional[str], lambda: typer.Option(None, "--vram", help="Store only: VRAM for experts, bytes or a "
                                                 "share of the store's expert bytes (default: none).")),
    "device": (Optional[str], lambda: typer.Option(None, "--device", help="Store only: torch device of the VRAM "
                                                   "tier (default: cuda when present).")),
    "policy": (str, lambda: typer.Option("lru", "--policy", help="Store only: eviction policy, lru, lfu, "
                                         "frequency-distance or expected-use.")),
    "preload": (str, lambda: typer.Option("auto", "--preload", help="Store only: auto (correlation if the store "
                                          "has a profile, else lookahead), correlation, lookahead or none.")),
    "skip_below": (float, lambda: typer.Option(0.0, "--skip-below", help="Store only, trades quality for reads: "
                                               "an expert not in RAM that every token chose with a routing weight "
                                               "below this (never as its strongest) is skipped and the other "
                                               "weights rescaled (adaptive top-k; default 0: off).")),
    "fallback_below": (float, lambda: typer.Option(0.0, "--fallback-below", help="Store only, trades quality for "
                                                   "reads: an expert not in RAM that every token chose with a "
                                                   "routing weight below this (never as its strongest) is read "
                                                   "as its narrower copy (a store converted with --fallback-bits; "
                                                   "default 0: off).")),
    "compute": (str, lambda: typer.Option("auto", "--compute", help="Store only: the experts' compute path, auto "
                                          "(default: the fastest measured), fused-int, fused-float, dequant or "
                                          "device.")),
}


def with_store_options(*names: str):
    """A command that takes the store flags `names` (keys of STORE_FLAGS) and receives them as one
    StoreOptions in its `store` parameter, checked once with the flags' names."""
    def decorate(command):
        signature = signature_of(command)
        flags = [Parameter(n, Parameter.KEYWORD_ONLY, default=STORE_FLAGS[n][1](), annotation=STORE_FLAGS[n][0])
                 for n in names]

        @functools.wraps(command)
        def with_options(**values):
            from edgemoe.loader import StoreOptions
            store = StoreOptions(**{n: values.pop(n) for n in names}, name=options.cli_flag)
            return command(**values, store=store)

        kept = [p for p in signature.parameters.values() if p.name != "store"]
        with_options.__signature__ = signature.replace(parameters=kept + flags)
        with_options.__annotations__ = {**{k: v for k, v in command.__annotations__.items() if k != "store"},
                                        **{n: STORE_FLAGS[n][0] for n in names}}
        return with_options
    return decorate

