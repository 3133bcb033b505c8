"""Options several commands take, each defined once: a typer option object that a command names as its
parameter's default (`threads: Optional[int] = THREADS`), so the flag, its default, help and check
are the same on every command that takes it. Groups:

- the store's flags (STORE_FLAGS): how a store's experts are held and run, made into one StoreOptions
  (as_store_options). run, eval, serve and chat take all of them; bench takes --compute, --skip-below
  and --fallback-below (its modes set the rest).
- loading a model: --dtype, --dense-bits, --threads (--threads on every command that computes).
- sampling: --temperature, --top-k, --top-p, --seed (run and chat).
- output: --quiet, --json, --force.

A value is checked where it enters: a typer callback runs an edgemoe.options check, or StoreOptions
checks the store's flags when made; each error names the flag (OptionError: one line, exit status 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from edgemoe import options
from edgemoe.bundled import bundled_model_path
from edgemoe.scheduling.policies import DEFAULT_POLICY, POLICIES

DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def flag_of(param) -> str:
    return max(param.opts, key=len)


def checked(check, *args):
    """A typer callback running an edgemoe.options check on the option's value(s)."""
    def callback(param: typer.CallbackParam, value):
        if isinstance(value, (list, tuple)):
            return [check(v, flag_of(param), *args) for v in value]
        return check(value, flag_of(param), *args)
    return callback


MODEL = typer.Argument(None, help="Checkpoint directory or store (default: the bundled model).")


def model_path(model: Optional[Path]) -> Path:
    return bundled_model_path() if model is None else model


# ---- the store's flags: StoreOptions' fields, checked by StoreOptions ----
RAM = typer.Option("auto", "--ram", help="Store only: RAM for experts, bytes (512MiB), a share of the store's "
                   "expert bytes (25%) or auto (default: what the memory free to this process leaves after the "
                   "dense weights, KV cache and a margin; docs/scheduling.md).")
VRAM = typer.Option(None, "--vram", help="Store only: VRAM for experts, bytes or a share of the store's expert "
                    "bytes (default: none).")
DEVICE = typer.Option(None, "--device", help="Store only: torch device of the VRAM tier (default: cuda when "
                      "present).")
POLICY = typer.Option(DEFAULT_POLICY, "--policy", help="Store only: eviction policy, adaptive (default: follows "
                      "whichever of the others would read least), or one of "
                      f"{', '.join(p for p in POLICIES if p != DEFAULT_POLICY)}.")
PRELOAD = typer.Option("auto", "--preload", help="Store only: auto (the predictor the store's profiling measured "
                       "better; else correlation if the store has a profile, else lookahead), correlation, "
                       "lookahead or none.")
SKIP_BELOW = typer.Option(0.0, "--skip-below", help="Store only, trades quality for reads: an expert not in RAM "
                          "that every token chose with a routing weight below this (never as its strongest) is "
                          "skipped and the other weights rescaled (adaptive top-k; default 0: off).")
FALLBACK_BELOW = typer.Option(0.0, "--fallback-below", help="Store only, trades quality for reads: an expert not in "
                              "RAM that every token chose with a routing weight below this (never as its "
                              "strongest) is read as its narrower copy (a store converted with --fallback-bits; "
                              "default 0: off).")
COMPUTE = typer.Option("auto", "--compute", help="Store only: the experts' compute path, auto (default: the fastest "
                       "measured), fused-int, fused-float, dequant or device.")

STORE_FLAGS = {"ram": RAM, "vram": VRAM, "device": DEVICE, "policy": POLICY, "preload": PRELOAD,
               "skip_below": SKIP_BELOW, "fallback_below": FALLBACK_BELOW, "compute": COMPUTE}
STORE_COMMANDS = ("run", "eval", "serve", "chat")     # the commands that take every one of them


def as_store_options(**flags):
    """The store's flags as one StoreOptions, checked once, each error naming its flag."""
    from edgemoe.loader import StoreOptions

    return StoreOptions(**flags, name=options.cli_flag)


# ---- loading a model ----
DTYPE = typer.Option("auto", "--dtype", callback=checked(options.one_of, tuple(DTYPES)),
                     help="Dense weight matrices: auto (as the checkpoint stores them where the CPU computes that "
                     "type natively, else float32), float32, bfloat16 or float16. Activations are float32.")
DENSE_BITS = typer.Option("auto", "--dense-bits", callback=checked(options.dense_bits),
                          help="The dense projections and the LM head at load: auto (for a store of a decoder-only "
                          "model 4 bits if its experts are at 4 or fewer and no quality budget chose them, else 8; "
                          "a checkpoint as loaded), none (as loaded: --dtype), 8 or 4 bits (fewer "
                          "bytes per token; the embedding and routers stay as --dtype says).")
KV_DTYPE = typer.Option("float32", "--kv-dtype", callback=checked(options.one_of, ("float32", "bfloat16")),
                        help="The KV cache's keys and values: float32, or bfloat16 (half the memory; faster only "
                        "at long contexts, docs/benchmarks.md).")
SERVED_CONTEXT = typer.Option(None, "--context", callback=checked(options.integer_at_least, 2),
                              help="Longest sequence served, prompt and answer, in tokens (default: the model's "
                              "context, shortened to 4096 or a doubling of it where its KV cache would leave too "
                              "little room to cache every expert; docs/serving.md).")
THREADS = typer.Option(None, "--threads", callback=checked(options.thread_count),
                       help="Threads for the kernels (default: the cores other processes leave free, followed as "
                       "the load changes).")


def torch_dtype(name: str):
    import torch

    return None if DTYPES[name] is None else getattr(torch, DTYPES[name])


# ---- sampling ----
TEMPERATURE = typer.Option(None, "--temperature", callback=checked(options.finite_at_least),
                           help="0 = greedy (default: the model's generation_config).")
TOP_K = typer.Option(None, "--top-k", callback=checked(options.integer_at_least, 0))
TOP_P = typer.Option(None, "--top-p", callback=checked(options.probability))
SEED = typer.Option(None, "--seed", help="Seed for sampling.")


def sampling(temperature, top_k, top_p) -> dict:
    """The sampling options given, as generate() takes them (the others: the model's defaults)."""
    return {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p).items() if v is not None}


# ---- output ----
QUIET = typer.Option(False, "--quiet", "-q", help="No progress bars (they are shown only on a terminal).")
JSON = typer.Option(False, "--json", help="Print JSON instead of text.")


def force_option(what: str):
    return typer.Option(False, "--force", help=f"Replace an existing {what}; never an input of the command.")
