"""The `edgemoe` command: thin typer commands over the library. Errors in input print one line naming
the file, tensor or option, and exit with status 2.

The library is imported inside each command, not at the top: `edgemoe --help` and a bad flag answer
without loading torch and numba, which take seconds (docs/benchmarks.md, "Command start-up")."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from inspect import Parameter, signature as signature_of
from pathlib import Path
from typing import Callable, List, Optional

import typer

from . import options
from .errors import EdgeMoEError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run Mixture-of-Experts LLMs on machines too small to hold them.")


@app.callback()
def _group() -> None:
    """Run Mixture-of-Experts LLMs on machines too small to hold them."""


DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


# ---- options checked where they enter: each error names the flag (OptionError, one line, exit 2) ----
def _flag(param) -> str:
    return max(param.opts, key=len)


def _checked(check, *args):
    """A typer callback running an edgemoe.options check on the option's value(s)."""
    def callback(param: typer.CallbackParam, value):
        if isinstance(value, (list, tuple)):
            return [check(v, _flag(param), *args) for v in value]
        return check(value, _flag(param), *args)
    return callback




def _policy(value, flag):
    from edgemoe.scheduling.policies import POLICIES
    return options.one_of(value, flag, sorted(POLICIES))




METRICS = ("ppl", "top1", "kl")
IMPORTANCE_METHODS = ("local", "exact")       # edgemoe.convert.budget's, without importing torch here


def _confidence(value: float, flag: str) -> float:
    if not 0.5 <= value < 1:
        raise options.OptionError(flag, value, "expected a number in [0.5, 1)")
    return value


def _unit_interval(value: float, flag: str) -> float:
    if not 0 <= value <= 1:
        raise options.OptionError(flag, value, "expected a number in [0, 1]")
    return value


def _port(value: int, flag: str) -> int:
    if not 0 <= value <= 65535:
        raise options.OptionError(flag, value, "expected a TCP port in 0..65535")
    return value


def _bench_mode(value, flag):
    from .bench import MODES
    return options.one_of(value, flag, MODES)


def _byte_size(value, flag):
    from edgemoe.store import parse_bytes
    return parse_bytes(value, flag)


def _dtype_option():
    return typer.Option("auto", "--dtype", callback=_checked(options.one_of, tuple(DTYPES)),
                        help="Dense weight matrices: auto (as the checkpoint stores them where the CPU computes that "
                        "type natively, else float32), float32, bfloat16 or float16. Activations are float32.")


def _dense_bits_option():
    return typer.Option("auto", "--dense-bits", callback=_checked(options.dense_bits),
                        help="The dense projections and the LM head at load: auto (8 bits for a store of a "
                        "decoder-only model, else as loaded), none (as loaded: --dtype), 8 or 4 bits (fewer "
                        "bytes per token; the embedding and routers stay as --dtype says).")


def _threads_option():
    return typer.Option(None, "--threads", callback=_checked(options.thread_count),
                        help="Threads for the kernels (default: the cores other processes leave free, "
                        "followed as the load changes).")


def _force_option(what: str):
    return typer.Option(False, "--force", help=f"Replace an existing {what}; never an input of the command.")


def _refuse_overwrite(path: Path, inputs, force: bool) -> None:
    """Before any work: never write over an input, nor over an existing file without --force."""
    from .files import refuse_overwrite
    refuse_overwrite(path, [p for p in inputs if p is not None], force, "--force")


def _quiet_option():
    return typer.Option(False, "--quiet", "-q", help="No progress bars (they are shown only on a terminal).")


def _dtype(name: str):
    import torch
    return None if DTYPES[name] is None else getattr(torch, DTYPES[name])


MODEL_HELP = "Checkpoint directory or store (default: the bundled model)."
# --ram auto's allowance for tokens a prompt gains past its text: BOS/EOS-like specials, and a chat
# template's role markers and system text (the bundled templates add well under this).
SPECIAL_TOKENS = 16
CHAT_TEMPLATE_TOKENS = 256


def _model_path(model: Optional[Path]) -> Path:
    if model is not None:
        return model
    from .bundled import bundled_model_path
    return bundled_model_path()


def _ram_option(default="auto", help_text="Store only: RAM for experts, bytes (512MiB), a share of the store's "
               "expert bytes (25%) or auto (default: what the memory free to this process leaves after the dense "
               "weights, KV cache and a margin; docs/scheduling.md)."):
    return typer.Option(default, "--ram", help=help_text)


# The store's flags, shared by every command that runs a model (see _with_store_options).
STORE_FLAGS = {
    "ram": (Optional[str], _ram_option),
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


def _with_store_options(*names: str):
    """A command that takes the store flags `names` (keys of STORE_FLAGS) and receives them as one
    StoreOptions in its `store` parameter, checked once with the flags' names."""
    def decorate(command):
        signature = signature_of(command)
        flags = [Parameter(n, Parameter.KEYWORD_ONLY, default=STORE_FLAGS[n][1](), annotation=STORE_FLAGS[n][0])
                 for n in names]

        @functools.wraps(command)
        def with_options(**values):
            from .loader import StoreOptions
            store = StoreOptions(**{n: values.pop(n) for n in names}, name=options.cli_flag)
            return command(**values, store=store)

        kept = [p for p in signature.parameters.values() if p.name != "store"]
        with_options.__signature__ = signature.replace(parameters=kept + flags)
        with_options.__annotations__ = {**{k: v for k, v in command.__annotations__.items() if k != "store"},
                                        **{n: STORE_FLAGS[n][0] for n in names}}
        return with_options
    return decorate


# ---- options that cannot act: refused, never ignored ----
@dataclass(frozen=True)
class CannotAct:
    """An option of `commands` that cannot act when `when(arguments)` holds: given there, it is
    refused with `why` (completing "--flag VALUE: ..."), never silently ignored."""
    commands: tuple[str, ...]
    option: str                                   # the command's parameter name
    when: Callable[["GivenArguments"], bool]
    why: str


class GivenArguments:
    """A command's arguments as parsed (attributes) and whether each was given (not its default)."""

    def __init__(self, context: typer.Context, values: dict):
        self._context, self._values = context, values

    def __getattr__(self, name: str):
        return self._values[name]

    def given(self, name: str) -> bool:
        source = self._context.get_parameter_source(name)
        return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def _greedy(a: GivenArguments) -> bool:
    return a.given("temperature") and a.temperature == 0


def _every(commands, names, when, why) -> list[CannotAct]:
    return [CannotAct(commands, name, when, why) for name in names]


MODEL_COMMANDS = ("run", "eval", "serve", "chat")   # those taking the store options
CANNOT_ACT = (
    *_every(("run",), ("temperature", "top_k", "top_p", "seed", "stop"), lambda a: a.given("beams"),
            "cannot act with --beams (beam search neither samples nor stops on strings)"),
    *_every(("run", "chat"), ("top_k", "top_p", "seed"), _greedy,
            "cannot act with --temperature 0 (greedy decoding takes the most likely token: nothing is sampled)"),
    *_every(("run",), ("length_penalty", "early_stopping"), lambda a: not a.given("beams"), "only with --beams"),
    CannotAct(("run",), "speculate", lambda a: not a.given("draft"), "only with --draft"),
    CannotAct(("run",), "draft_ram", lambda a: a.draft != "self", "only with --draft self (a separate draft "
              "is held as it loads)"),
    *[CannotAct(("run",), "draft", lambda a, other=other: a.given(other), f"cannot act with --{other} "
                "(speculative decoding is for greedy or sampled decoding with the model's own routers)")
      for other in ("beams", "replay")],
    CannotAct(MODEL_COMMANDS, "device", lambda a: not a.given("vram"), "only with --vram (the device holds "
              "the VRAM tier)"),
    *_every(("bench",), ("skip_below", "fallback_below"),
            lambda a: a.given("mode") and "predictive" not in a.mode,
            "only with --mode predictive (the other modes run without quality trade-offs)"),
    CannotAct(("bench",), "ram", lambda a: a.given("mode") and set(a.mode) == {"all-in-ram"}, "cannot act with "
              "only --mode all-in-ram (it holds every expert in RAM)"),
    CannotAct(("bench",), "routing", lambda a: a.given("replay"), "cannot act with --replay (the trace routes "
              "every run)"),
    *_every(("convert",), ("metric", "heldout", "calib_tokens", "confidence", "importance"),
            lambda a: not a.given("budget"), "only with --budget"),
    CannotAct(("convert",), "bits", lambda a: a.given("widths") or a.given("budget"), "cannot act with --widths "
              "or --budget (they set every expert's width)"),
    *_every(("profile",), ("context", "threads"), lambda a: a.given("trace_file"), "cannot act with --trace "
            "(a profile built from a trace runs no text through the model)"),
)


def _refuse_options_that_cannot_act(command):
    """Check the command's arguments against CANNOT_ACT before it runs (typer passes the click
    context, which knows which options were given, as the added parameter `typer_context`)."""
    signature = signature_of(command)

    @functools.wraps(command)
    def checked(typer_context: typer.Context, **values):
        arguments = GivenArguments(typer_context, values)
        for rule in CANNOT_ACT:
            if typer_context.info_name in rule.commands and arguments.given(rule.option) and rule.when(arguments):
                raise EdgeMoEError(_cannot_act_message(typer_context, rule, values[rule.option]))
        return command(**values)

    context = Parameter("typer_context", Parameter.KEYWORD_ONLY, annotation=typer.Context)
    checked.__signature__ = signature.replace(parameters=[*signature.parameters.values(), context])
    checked.__annotations__ = {**command.__annotations__, "typer_context": typer.Context}
    return checked


def _refuse_sampling_flags_if_greedy(model, path: Path, temperature, sampling_flags: dict) -> None:
    """CANNOT_ACT's greedy rule where the model decides it: without --temperature, decoding samples
    only if generation_config.json says do_sample; otherwise --top-k, --top-p and --seed cannot act."""
    from .generate import defaults_from

    if temperature is not None or defaults_from(model.generation_config).get("temperature", 0) != 0:
        return
    for flag, value in sampling_flags.items():
        if value is not None:
            raise options.OptionError(flag, value, f"cannot act: {path}'s generation_config.json decodes greedily "
                                                   f"(give --temperature above 0 to sample)")


def _cannot_act_message(context, rule: CannotAct, value) -> str:
    flag = _flag(next(p for p in context.command.params if p.name == rule.option))
    if isinstance(value, bool):          # a switch: no value to show
        return f"{flag}: {rule.why}"
    shown = value[0] if isinstance(value, list) and len(value) == 1 else value
    return options.option_message(flag, shown, rule.why)


@app.command()
@_refuse_options_that_cannot_act
@_with_store_options("ram", "vram", "device", "policy", "preload", "skip_below", "fallback_below")
def run(
    model: Optional[Path] = typer.Argument(None, help=MODEL_HELP),
    prompt: str = typer.Option("", "--prompt", "-p", help="Text to continue (default: start from nothing)."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", "-n", callback=_checked(options.integer_at_least, 0)),
    temperature: Optional[float] = typer.Option(None, callback=_checked(options.finite_at_least),
                                                help="0 = greedy (default: the model's generation_config)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", callback=_checked(options.integer_at_least, 0)),
    top_p: Optional[float] = typer.Option(None, "--top-p", callback=_checked(options.probability)),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    stop: List[str] = typer.Option([], "--stop", callback=_checked(lambda v, flag: options.unescape(v)),
                                   help="Stop when this text is produced (repeatable; \\n, \\t are read as "
                                   "newline and tab)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the tokenizer's chat template."),
    truncate: bool = typer.Option(False, "--truncate", help="A prompt longer than the model's context keeps its "
                                  "last tokens (default: refused)."),
    stats: bool = typer.Option(False, "--stats", help="Print speed and cache figures after the text."),
    replay: Optional[Path] = typer.Option(None, "--replay", help="Route by this trace instead of the routers "
                                          "(a random-weight model routed as a real one was)."),
    beams: Optional[int] = typer.Option(None, "--beams", callback=_checked(options.integer_at_least, 1),
                                        help="Beam search with this many beams, run together through each layer; "
                                        "prints the best beam (not streamed)."),
    length_penalty: Optional[float] = typer.Option(None, "--length-penalty", callback=_checked(options.finite_number),
                                                   help="With --beams: a finished beam scores its summed "
                                                   "log-probabilities / length ** this (default 1)."),
    early_stopping: bool = typer.Option(False, "--early-stopping", help="With --beams: stop as soon as --beams "
                                        "beams have finished."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Speculative decoding: a draft model that proposes "
                                        "tokens the model checks in one step, a checkpoint directory or store with "
                                        "the same tokenizer, or 'self': this model with its experts re-quantized "
                                        "to INT2 in RAM (about 3 bits per weight, outside --ram; cap: --draft-ram)."),
    speculate: Optional[int] = typer.Option(None, "--speculate", callback=_checked(options.integer_at_least, 1),
                                            help="With --draft: tokens the draft proposes per round (default 4)."),
    draft_ram: Optional[str] = typer.Option(None, "--draft-ram", callback=_checked(options.parse_bytes),
                                            help="With --draft self: RAM for the INT2 copy of the experts, bytes "
                                            "like 64MiB (default: unlimited; least recently used dropped first)."),
    dtype: str = _dtype_option(),
    dense_bits: str = _dense_bits_option(),
    threads: Optional[int] = _threads_option(),
    store=None,
):
    """Generate text, streamed as it is produced, from a checkpoint directory or a store."""
    import edgemoe

    from .tokenizer import valid_text

    prompt, stop = valid_text(prompt, "--prompt"), [valid_text(s, "--stop") for s in stop]
    from .loader import require_decoder_only

    path = _model_path(model)
    context = _run_context(prompt, chat, max_new_tokens, (speculate or 4) if draft else 0)
    m = edgemoe.load(path, _dtype(dtype), threads, store=store, dense_bits=dense_bits, context=context,
                     batch=beams or 1)
    _warn_ram_auto(m)
    for flag, given in (("--beams", beams is not None), ("--replay", replay is not None),
                        ("--draft", draft is not None)):
        if given:
            require_decoder_only(m.spec, path, flag)
    if replay is not None:
        _replay_for(m.spec, replay).attach(m)
    if m.tokenizer is None:
        raise EdgeMoEError(f"{path}: no tokenizer.json, cannot generate text")
    _refuse_sampling_flags_if_greedy(m, path, temperature, {"--top-k": top_k, "--top-p": top_p, "--seed": seed})
    speculator = None
    if draft is not None:
        from .speculative import speculator_for
        speculator = speculator_for(m, draft, speculate or 4, draft_ram, _dtype(dtype), threads)
    seen = _prompt_seen(m, prompt, chat, max_new_tokens, truncate)
    sampling = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p).items() if v is not None}
    if beams is not None:
        sys.stdout.write(_best_beam_text(m, seen, beams, max_new_tokens, length_penalty, early_stopping, truncate))
    else:
        m.generate(seen, on_text=lambda piece: (sys.stdout.write(piece), sys.stdout.flush()),
                   on_warning=_warn, max_new_tokens=max_new_tokens, seed=seed, stop_strings=tuple(stop),
                   truncate=truncate, **({"token_stream": speculator.stream} if speculator else {}), **sampling)
    sys.stdout.write("\n")
    if stats:
        _print_run_stats(m, speculator.stats if speculator else None)
    if speculator is not None:
        speculator.close()


def _prompt_seen(model, prompt: str, chat: bool, max_new_tokens: int, truncate: bool) -> list[int]:
    """The prompt's token ids as the model will see them, echoed (not with --chat) only once they are:
    a prompt past the context is refused before anything is printed, and a truncated one is shown
    as its kept tokens, not as it was given."""
    from .generate import GenerationOptions, fit_context

    # The chat template writes its own special tokens: encoded without adding them again.
    ids = model.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else model.tokenizer.encode(prompt)
    seen = fit_context(model, ids, GenerationOptions(max_new_tokens=max_new_tokens, truncate=truncate), _warn)
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
    from .beam import beam_search
    from .generate import StopStringStream

    penalty = 1.0 if length_penalty is None else length_penalty
    hypotheses = beam_search(model, prompt_ids, beams, max_new_tokens, penalty, early_stopping, truncate=truncate,
                             warn=_warn)
    stream = StopStringStream(model.tokenizer)     # decoded as generate decodes its tokens
    for token in hypotheses[0][0] if hypotheses else []:
        stream.push(token)
    stream.finish()
    return stream.text


def _warn(message: str) -> None:
    sys.stdout.flush()
    print(f"\nwarning: {message}", file=sys.stderr, flush=True)


def _print_run_stats(model, speculation=None) -> None:
    from .stats import format_stats, run_stats

    breakdown = getattr(model.store, "ram_breakdown", None)
    if breakdown:
        print(f"[stats] {_ram_breakdown_text(breakdown)}", file=sys.stderr)
    for line in format_stats(run_stats(model, speculation)):
        print(f"[stats] {line}", file=sys.stderr)


def _warn_ram_auto(model) -> None:
    """Say so when --ram auto found no room for experts, or could not read the free memory."""
    breakdown = getattr(model.store, "ram_breakdown", None)
    if breakdown and "note" in breakdown:
        _warn(f"--ram auto: {breakdown['note']} (edgemoe inspect STORE --ram auto shows why)")


def _auto_ram_of(store: Path) -> tuple[int, dict]:
    """--ram auto for `edgemoe inspect`: the budget a run here would get (the commands' default
    --dense-bits, the model's whole context)."""
    from edgemoe.store import read_manifest

    from .loader import auto_ram
    return auto_ram(read_manifest(store))


def _ram_breakdown_text(b: dict) -> str:
    """--ram auto's choice in one line: the budget, then what it was taken from (auto_ram's breakdown)."""
    held = ", ".join(f"{name.replace('_', ' ')} {_size(b[name])}"
                     for name in ("dense", "kv_cache", "activations", "read_buffers", "runtime", "margin"))
    available = "unknown" if b["available"] is None else _size(b["available"])
    note = f"; {b['note']}" if "note" in b else ""
    return (f"--ram auto: {_size(b['budget'])} of {_size(b['expert_bytes'])} of experts in RAM = "
            f"available {available} ({b['source']}) - {held}{note}")


@app.command()
@_refuse_options_that_cannot_act
def convert(
    model: Path = typer.Argument(..., help="Hugging Face checkpoint directory."),
    out: Path = typer.Option(..., "--out", "-o", help="Store directory to create."),
    bits: int = typer.Option(4, "--bits", callback=_checked(options.one_of, (2, 4, 8)),
                             help="Width of every expert: 2, 4 or 8."),
    widths: Optional[Path] = typer.Option(None, "--widths", help='Per-expert widths, JSON {"widths": '
                                          '{"<layer>": [bits, ...]}}, overriding --bits.'),
    group_size: Optional[int] = typer.Option(None, "--group-size", callback=_checked(options.integer_at_least, 1),
                                             help="Quantization group along the input dimension (default: one "
                                             "group per row)."),
    method: str = typer.Option("rtn", "--method", callback=_checked(options.one_of, ("rtn", "hqq")),
                               help="rtn (round to nearest) or hqq (refined zero points)."),
    compress: Optional[str] = typer.Option(None, "--compress", callback=_checked(options.one_of, ("zstd",)),
                                           help="zstd: compress each expert blob."),
    fallback_bits: Optional[int] = typer.Option(None, "--fallback-bits", callback=_checked(options.one_of, (2, 4)),
                                                help="Also store each wider expert narrowed to 2 or 4 bits: the copy "
                                                "read for a weakly chosen miss (run --fallback-below)."),
    force: bool = _force_option("store (only a store)"),
    workers: Optional[int] = typer.Option(None, "--workers", callback=_checked(options.integer_at_least, 1),
                                          help="Quantization threads (default: as --threads)."),
    calib: Optional[Path] = typer.Option(None, "--calib", help="Calibration text: profile the store's routing "
                                         "on it, and search widths on it with --budget (default for the "
                                         "bundled model: its calib.txt)."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Quality loss allowed, e.g. 5%: per-expert "
                                         "widths from 2/4/8, the store as small as possible within it."),
    metric: str = typer.Option("ppl", "--metric", callback=_checked(options.one_of, METRICS),
                               help="Loss for --budget: ppl (relative perplexity increase), top1 (1 - top-1 "
                               "agreement) or kl (mean KL, nats/token)."),
    heldout: Optional[Path] = typer.Option(None, "--heldout", help="Held-out text to confirm the budget on "
                                           "(default for the bundled model: its eval.txt)."),
    calib_tokens: Optional[int] = typer.Option(None, "--calib-tokens", callback=_checked(options.integer_at_least, 2),
                                               help="Use at most this many calibration tokens for --budget."),
    importance: str = typer.Option("local", "--importance", callback=_checked(options.one_of, IMPORTANCE_METHODS),
                                   help="How --budget ranks experts: local (each expert's output error on its "
                                   "tokens, scaled per layer; one re-run per layer) or exact (one re-run per "
                                   "expert)."),
    confidence: float = typer.Option(0.95, "--confidence", callback=_checked(_confidence),
                                     help="--budget must hold for this one-sided upper confidence bound of the "
                                     "calibration loss, in [0.5, 1) (0.5: the estimate)."),
    profile_tokens: Optional[int] = typer.Option(None, "--profile-tokens",
                                                 callback=_checked(options.integer_at_least, 1),
                                                 help="Trace at most this many tokens of --calib for the "
                                                 "routing profile (default 4096, docs/budget.md)."),
    allow_no_tokenizer: bool = typer.Option(False, "--allow-no-tokenizer", help="Convert a checkpoint without "
                                            "tokenizer.json: a store for token ids only (bench, the Python API); "
                                            "run, eval and chat refuse it (default: refused here)."),
    threads: Optional[int] = _threads_option(),
    quiet: bool = _quiet_option(),
):
    """Quantize a checkpoint's experts into a tiered store (and profile its routing on --calib)."""
    from .convert import QualityBudget, check_destination, convert as convert_store
    from .convert.pipeline import PROFILE_TOKENS
    from .progress import staged_progress
    from .threads import set_command_threads

    calib = calib or _bundled_text(model, "calib.txt")
    if budget is not None:
        if widths is not None:
            raise EdgeMoEError("--budget chooses the widths: give it or --widths, not both")
        if calib is None:
            raise EdgeMoEError("--budget needs calibration text: --calib FILE (the bundled model uses its calib.txt)")
        heldout = heldout or _bundled_text(model, "eval.txt")
    if profile_tokens is not None and calib is None:
        raise EdgeMoEError("--profile-tokens: only with --calib (it caps the calibration text's tokens profiled)")
    inputs = [p for p in (widths, calib, heldout) if p is not None]
    check_destination(out, force, [model, *inputs])
    calib_text = _read_text(calib) if calib is not None else None      # every input read before any work
    quality = None if budget is None else QualityBudget(
        _budget(budget, metric), metric, confidence, calib_tokens, _read_text(heldout) if heldout else None,
        importance=importance)
    workers = workers or set_command_threads(threads)
    with staged_progress(quiet) as report:
        result = convert_store(model, out, bits=bits, widths=widths, group_size=group_size, method=method,
                               compress=compress, force=force, workers=workers, budget=quality,
                               calib_text=calib_text, threads=threads, progress=report, inputs=inputs,
                               fallback_bits=fallback_bits, allow_no_tokenizer=allow_no_tokenizer,
                               profile_tokens=profile_tokens or PROFILE_TOKENS)
    widths_text = ", ".join(f"INT{b}: {n}" for b, n in result.widths.items())
    print(f"wrote {result.store}: {result.experts} experts ({widths_text}), expert bytes "
          f"{_size(result.expert_bytes)} ({result.bits_per_weight:.3f} bits/weight), dense "
          f"{_size(result.dense_bytes)}; {result.seconds:.1f} s in all, peak RSS {_size(result.peak_rss_bytes)}")
    if result.fallback_copies:
        print(f"fallback copies: {result.fallback_copies} experts at INT{fallback_bits}, "
              f"{_size(result.fallback_bytes)}")
    if result.profiled:
        print(f"profiled routing on {calib}")
    if result.search is not None:
        _print_budget(result, metric)


def _print_budget(result, metric: str) -> None:
    s = result.search
    uniform = ", ".join(f"INT{b} {v:+.4f}" for b, v in s.uniform_loss.items())
    print(f"budget {metric} <= {s.budget:.4f}: calibration loss {s.loss:.4f} (bound {s.loss_bound:.4f})"
          + (f", held-out loss {result.heldout_loss:.4f}" if result.heldout_loss is not None else "")
          + f" (uniform: {uniform}; floor INT{s.floor}, ceiling INT{s.ceiling}, {s.moved_down} experts at the floor, "
          f"ranked by {s.importance_method} importance)")
    if not s.feasible:
        print("warning: even INT8 everywhere exceeds the budget on the calibration text; wrote all INT8")


def _budget(text: str, metric: str) -> float:
    """--budget as a fraction; ppl and top1 losses are shares (at most 100%), kl is in nats."""
    from .convert.budget import parse_budget

    limit = parse_budget(text)
    if limit <= 0 or (metric != "kl" and limit > 1):
        expected = "a loss above 0" if metric == "kl" else "a loss in (0%, 100%]"
        raise options.OptionError("--budget", text, f"expected {expected} for --metric {metric} (a budget that "
                                  f"allows every expert at INT2 is --bits 2)")
    return limit


@app.command()
def inspect(
    store: Path = typer.Argument(..., help="Store directory."),
    ram: Optional[str] = _ram_option(None, help_text="Show where experts would be placed with this RAM capacity "
                                     "(bytes, a share of the expert bytes, or auto: the budget `edgemoe run` "
                                     "would choose here, and why)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Draw the width map (layer x expert) to this PNG "
                                        "(needs matplotlib: pip install 'edgemoe[plot]')."),
    as_json: bool = typer.Option(False, "--json"),
    force: bool = _force_option("--plot file"),
):
    """Summarise a store: model, sizes per layer and width, bits per weight, the width map, placement."""
    import json

    from edgemoe.store import inspect_store, parse_bytes

    parse_bytes(ram, "--ram", allow_share=True, allow_auto=True)
    if plot is not None:
        _refuse_overwrite(plot, [store], force)
    budget = _auto_ram_of(store) if ram == "auto" else None
    summary = inspect_store(store, ram=budget[0] if budget else ram)
    if budget:
        summary["ram_auto"] = budget[1]
    if plot is not None:
        from .plots import plot_width_map
        plot_width_map(summary, plot)
    if as_json:
        print(json.dumps(summary, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m = summary["model"]
    console.print(f"{store}: {m['model_type']}, {m['layers']} layers, {m['experts']} experts/layer, top-{m['top_k']}, "
                  f"hidden {m['hidden']}, expert hidden {m['expert_hidden']}; format v{summary['version']}, "
                  f"{_quantization_text(summary['quantization'])}")
    console.print(f"experts {_size(summary['expert_bytes'])} at {summary['bits_per_weight']:.3f} bits/weight, "
                  f"dense {_size(summary['dense_bytes'])}")
    if budget:
        console.print(_ram_breakdown_text(budget[1]))
    if summary["fallback"]:
        f = summary["fallback"]
        console.print(f"fallback copies: {f['experts']} experts at INT{f['bits']}, {_size(f['bytes'])}")
    table = Table("layer", *[f"INT{b}" for b in (2, 4, 8)], "bytes", *(["in RAM"] if ram else []))
    for row in summary["layers"]:
        table.add_row(str(row["layer"]), *[str(row["widths"].get(str(b), 0)) for b in (2, 4, 8)],
                      _size(row["bytes"]), *([str(row["resident"])] if ram else []))
    console.print(table)
    width_map = Table("layer", *[f"e{e}" for e in range(m["experts"])], title="bits per expert")
    for layer, bits in summary["widths"].items():
        width_map.add_row(layer, *[str(b) for b in bits])
    console.print(width_map)
    if plot is not None:
        console.print(f"width map drawn to {plot}")


def _quantization_text(q: dict) -> str:
    group = f"groups of {q['group_size']}" if q.get("group_size") else "one group per row"
    return f"quantized by {q.get('method', '?')}, {group}"


def _bundled_text(model: Path, name: str) -> Optional[Path]:
    """The bundled model's calib.txt / eval.txt when `model` is the bundled checkpoint."""
    from .bundled import BUNDLED_DIR

    return BUNDLED_DIR / name if model.resolve() == BUNDLED_DIR and (BUNDLED_DIR / name).exists() else None


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


@app.command()
def trace(
    model: Path = typer.Argument(..., help="Store or checkpoint directory."),
    text: Path = typer.Option(..., "--text", help="UTF-8 text to run through the model."),
    out: Path = typer.Option(..., "--out", "-o", help="Trace file to write (JSON lines, docs/trace-format.md)."),
    context: Optional[int] = typer.Option(None, callback=_checked(options.integer_at_least, 2),
                                          help="Window length in tokens (default: as edgemoe eval)."),
    threads: Optional[int] = _threads_option(),
    quiet: bool = _quiet_option(),
    force: bool = _force_option("trace file"),
):
    """Record the routers' choices over a text as a trace."""
    import edgemoe
    from edgemoe.scheduling.profile import write_trace
    from .loader import is_store
    from .tracing import trace_text
    from .progress import progress_bar

    _refuse_overwrite(out, [model, text], force)
    content = _read_text(text)
    m = edgemoe.load(model, threads=threads, **({"preload": "none"} if is_store(model) else {}))
    options.window_length(context, "--context", m.context_length)
    with progress_bar("tracing", quiet) as report:
        records = trace_text(m, content, context, report)
    write_trace(out, records)
    print(f"wrote {out}: {len(records)} records ({len({(r.seq, r.token) for r in records})} tokens)")


@app.command()
@_refuse_options_that_cannot_act
def profile(
    store: Path = typer.Argument(..., help="Store directory."),
    text: Optional[Path] = typer.Option(None, "--text", help="Calibration text to run through the store."),
    trace_file: Optional[Path] = typer.Option(None, "--trace", help="Or: build the profile from this trace."),
    context: Optional[int] = typer.Option(None, callback=_checked(options.integer_at_least, 2),
                                          help="Window length in tokens."),
    min_count: int = typer.Option(3, "--min-count", callback=_checked(options.integer_at_least, 1),
                                  help="Back off from a correlation key seen fewer times."),
    threads: Optional[int] = _threads_option(),
    quiet: bool = _quiet_option(),
    force: bool = _force_option("profile.json (convert --calib writes one)"),
):
    """Store the routing profile (popularity, correlation table) used for placement and preload."""
    from edgemoe.store import read_manifest
    from edgemoe.store.format import PROFILE
    from .loader import is_store
    from .tracing import profile_store
    from .progress import progress_bar

    if (text is None) == (trace_file is None):
        raise EdgeMoEError("profile: give --text or --trace (exactly one)")
    if not is_store(store):
        raise EdgeMoEError(f"{store}: not a store; a routing profile belongs to a store (make one with "
                           f"edgemoe convert, which profiles it when given --calib)")
    _refuse_overwrite(store / PROFILE, [text, trace_file], force)
    spec = read_manifest(store).spec
    options.window_length(context, "--context", spec.max_position_embeddings)
    content = _read_text(text) if text else None
    with progress_bar("profiling routing", quiet) as report:
        result = profile_store(store, content, trace_file, context, min_count, threads, report)
    print(f"profiled {store}: {sum(result.counts[result.moe_layers[0]]) // result.top_k} tokens, "
          f"{sum(len(t) for t in result.given_prev2.values())} correlation keys; saved to {store / PROFILE}")


@app.command()
@_refuse_options_that_cannot_act
def bench(
    store: Path = typer.Argument(..., help="Store directory."),
    ram: str = _ram_option("25%", "RAM for experts: bytes (e.g. 1GiB) or a share of the store's expert "
                           "bytes (e.g. 25%)."),
    mode: List[str] = typer.Option([], "--mode", callback=_checked(_bench_mode),
                                   help="all-in-ram, on-demand-lru or predictive (repeatable; default: all three)."),
    prefill: List[int] = typer.Option([], "--prefill", callback=_checked(options.integer_at_least, 1),
                                      help="Prompt length in tokens (repeatable; default 512 and 2048, those that "
                                      "fit the model's context)."),
    decode_tokens: int = typer.Option(32, "--decode-tokens", callback=_checked(options.integer_at_least, 1),
                                      help="Timed decode steps per run."),
    warmup_tokens: int = typer.Option(4, "--warmup-tokens", callback=_checked(options.integer_at_least, 0),
                                      help="Decode steps before the timed ones."),
    repeats: int = typer.Option(3, "--repeats", callback=_checked(options.integer_at_least, 1),
                                help="Runs per mode and prompt length (medians reported)."),
    cold: bool = typer.Option(False, "--cold", help="Drop the store's files from the page cache before each run."),
    replay: Optional[Path] = typer.Option(None, "--replay", help="Route by this trace (a random-weight model "
                                          "routed as a real one was); the predictive mode uses the store's profile."),
    routing: str = typer.Option("generated", "--routing", callback=_checked(options.one_of, ("generated", "model")),
                                help="Without --replay: generated (Mixtral-like routing for the model's shape, "
                                "and the profile of another generated text) or model (its own routers)."),
    memory_limit: Optional[str] = typer.Option(None, "--memory-limit", callback=_checked(_byte_size),
                                               help="Run inside a cgroup v1 memory limit of this size, page cache "
                                               "included (Linux, root)."),
    as_json: bool = typer.Option(False, "--json", help="Print the records as JSON."),
    dtype: str = _dtype_option(),
    dense_bits: str = _dense_bits_option(),
    threads: Optional[int] = _threads_option(),
    quiet: bool = _quiet_option(),
    compute: str = STORE_FLAGS["compute"][1](),
    skip_below: float = typer.Option(0.0, "--skip-below", callback=_checked(options.routing_weight),
                                     help="The predictive mode also skips weakly chosen misses (as run --skip-below)."),
    fallback_below: float = typer.Option(0.0, "--fallback-below", callback=_checked(options.routing_weight),
                                         help="The predictive mode also reads weakly chosen misses as their fallback "
                                         "copies (as run --fallback-below)."),
):
    """Time to first token and decode speed with a RAM capacity, per mode, next to the physical limit."""
    import json

    from edgemoe.store import read_manifest
    from .quantized import COMPUTE_CHOICES
    from .bench import (MODES, BenchConfig, bench as run_bench, confine_memory, default_prefill, generated_routing,
                        leave_memory_group, machine_summary, measure_bandwidths, parse_ram)
    from .progress import progress_bar

    from .loader import require_decoder_only

    spec = read_manifest(store).spec
    require_decoder_only(spec, store, "edgemoe bench")
    steps = warmup_tokens + decode_tokens
    lengths = tuple(prefill) or default_prefill(spec.max_position_embeddings, steps)
    profile = None
    if replay is not None:
        routed_by, replayer = f"the trace {replay}", _replay_for(spec, replay)
    elif routing == "generated":
        routed_by = "generated Mixtral-like routing (edgemoe.scheduling.synthetic_routing, model seed 0)"
        replayer, profile = generated_routing(spec, max(lengths) + steps)
    else:
        routed_by, replayer = "the model's own routers", None
    config = BenchConfig(ram=parse_ram(ram, store), modes=tuple(mode) or MODES, prefill_tokens=lengths,
                         decode_tokens=decode_tokens, warmup_tokens=warmup_tokens, repeats=repeats, cold=cold,
                         replay=replayer, dtype=_dtype(dtype), dense_bits=dense_bits, threads=threads,
                         routing_profile=profile, skip_below=skip_below, fallback_below=fallback_below,
                         compute=options.one_of(compute, "--compute", COMPUTE_CHOICES))
    # The bandwidths are measured first, outside the memory limit: their 1 GiB buffer is not the run's.
    bandwidths = measure_bandwidths(store)
    group = confine_memory(memory_limit) if memory_limit is not None else None
    runs = len(config.modes) * len(config.prefill_tokens) * config.repeats
    done = []
    try:
        with progress_bar("benchmark runs", quiet) as report:
            records, _ = run_bench(store, config, on_run=lambda record: (done.append(record),
                                                                         report(len(done), runs)),
                                   bandwidths=bandwidths)
    finally:
        usage = leave_memory_group(group) if group is not None else None
    peak_line = None if usage is None else (f"peak memory of the run, page cache included: {_size(usage[0])}; "
                                            f"limit hit {usage[1]} times (memory.failcnt)")
    if as_json:
        print(json.dumps(records, indent=1))
        if peak_line:
            print(peak_line, file=sys.stderr)
        return
    print(machine_summary(bandwidths, memory_limit))
    print(f"routing: {routed_by}")
    if peak_line:
        print(peak_line)
    _print_bench_table(records)


@app.command()
def simulate(
    trace: Path = typer.Argument(..., help="JSON-lines routing trace (docs/trace-format.md)."),
    cache_experts: List[int] = typer.Option(..., "--cache-experts", callback=_checked(options.integer_at_least, 1),
                                            help="Cache size in experts (repeatable)."),
    profile_from: Optional[Path] = typer.Option(None, "--profile-from", help="Trace to build the routing "
                                                "profile from (default: the first half of TRACE)."),
    preload_k: Optional[int] = typer.Option(None, "--preload-k", callback=_checked(options.integer_at_least, 1),
                                            help="Experts preloaded per layer at most (default: the trace's top-k)."),
    min_count: int = typer.Option(3, "--min-count", callback=_checked(options.integer_at_least, 1),
                                  help="Profile back-off: a history seen fewer times falls back to a coarser table."),
    min_probability: float = typer.Option(0.5, "--min-probability", callback=_checked(_unit_interval),
                                          help="Preload only predictions at least this probable (the runtime's 0.5)."),
    policy: List[str] = typer.Option([], "--policy", callback=_checked(_policy),
                                     help="Eviction policies to compare (repeatable; default all; Belady always)."),
    tokens: Optional[int] = typer.Option(None, "--tokens", callback=_checked(options.integer_at_least, 1),
                                         help="Score only the first N tokens."),
    guard: bool = typer.Option(False, "--guard", help="Also run each scheme with the store's guard against a "
                               "ghost on-demand LRU cache."),
    stats: bool = typer.Option(False, "--stats", help="Print the trace's routing statistics first."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
):
    """Replay a routing trace through the store's expert cache: reads per token per policy and preload."""
    import json

    from .scheduling.profile import read_trace
    from .scheduling.routing_stats import routing_statistics
    from .scheduling.simulate import POLICY_NAMES, simulate_trace, table

    results, note = simulate_trace(trace, cache_experts, profile_from, preload_k, min_count, min_probability,
                                   tuple(policy) or POLICY_NAMES, tokens, guard)
    if stats:
        routing = routing_statistics(read_trace(trace))
        print(json.dumps(routing.to_dict()) if as_json else "\n".join(routing.lines()))
    print(json.dumps(results, indent=1) if as_json else table(results, note))


def _replay_for(spec, trace: Optional[Path]):
    """The trace's routing laid over the model (refused here, naming the file, if it does not fit)."""
    if trace is None:
        return None
    from edgemoe.scheduling.profile import read_trace
    from .replay import RoutingReplay

    return RoutingReplay(read_trace(trace), spec.moe_layer_ids, spec.num_experts, spec.top_k, str(trace))


def _print_bench_table(records: list) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("mode", "RAM", "prompt", "TTFT s", "decode tok/s", "limit tok/s", "of limit", "hit rate",
                  "disk MiB/token")
    for r in records:
        table.add_row(r["mode"], _size(r["ram_bytes"]), str(r["prefill_tokens"]), f"{r['ttft_s']:.2f}",
                      f"{r['decode_tok_s']:.2f}", f"{r['limit_decode_tok_s']:.2f}",
                      f"{r['decode_tok_s'] / r['limit_decode_tok_s']:.0%}", f"{r['hit_rate']:.3f}",
                      f"{r['disk_bytes_per_token'] / 2**20:.1f}")
    Console(width=max(120, Console().width)).print(table)


@app.command("eval")
@_refuse_options_that_cannot_act
@_with_store_options("ram", "vram", "device", "policy", "preload", "skip_below", "fallback_below", "compute")
def eval_(
    model: Optional[Path] = typer.Argument(None, help=MODEL_HELP),
    text: Optional[Path] = typer.Option(None, "--text", help="UTF-8 text file (default with the bundled "
                                        "model: its held-out eval.txt)."),
    reference: Optional[Path] = typer.Option(None, "--reference", help="Also report top-1 agreement and KL "
                                             "divergence against this model."),
    context: Optional[int] = typer.Option(None, callback=_checked(options.integer_at_least, 2),
                                          help="Window length in tokens (default: the model's "
                                          "max_position_embeddings, at most 1024)."),
    stride: Optional[int] = typer.Option(None, callback=_checked(options.integer_at_least, 1),
                                         help="Window step (default: context / 2)."),
    decode: bool = typer.Option(False, "--decode", help="Score token by token through the KV cache, as "
                                "generation runs (slower; for options that act per step: --ram; implied by "
                                "--skip-below and --fallback-below)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    dtype: str = _dtype_option(),
    dense_bits: str = _dense_bits_option(),
    threads: Optional[int] = _threads_option(),
    quiet: bool = _quiet_option(),
    store=None,
):
    """Perplexity over a text (sliding window); with --reference, agreement and KL too."""
    import json

    import edgemoe
    from .evaluate import evaluate_text
    from .progress import progress_bar

    if text is None:
        if model is not None:
            raise EdgeMoEError("--text is required for a model other than the bundled one")
        from .bundled import bundled_text
        text = bundled_text("eval.txt")
    content = _read_text(text)
    from .loader import require_decoder_only

    # Skipping and fallback copies act on misses every token of a step chose weakly: a whole window's
    # tokens choose nearly every expert strongly at least once, so only token by token (as generation
    # runs) measures what they do.
    decode = decode or bool(store.skip_below or store.fallback_below)
    path = _model_path(model)
    m = edgemoe.load(path, _dtype(dtype), threads, store=store, dense_bits=dense_bits, context=context)
    _warn_ram_auto(m)
    require_decoder_only(m.spec, path, "edgemoe eval (next-token perplexity)")
    options.window_length(context, "--context", m.context_length)
    if stride is not None and stride > (context or m.context_length):
        raise options.OptionError("--stride", stride, "expected at most the window length (--context)")
    ref = edgemoe.load(reference, _dtype(dtype), threads) if reference is not None else None
    with progress_bar("evaluating windows", quiet) as report:
        result = evaluate_text(m, content, context=context, stride=stride, reference=ref, on_progress=report,
                               decode=decode)
    store = getattr(m.experts, "store", None)
    reads = {} if store is None else {"disk_bytes_per_token": store.stats.disk_bytes_read / m.timings.tokens,
                                      "skipped_per_token": m.experts.skipped / m.timings.tokens,
                                      "fallback_uses_per_token": m.experts.fallback_uses / m.timings.tokens}
    if as_json:
        print(json.dumps({**result.to_dict(), **reads}))
        return
    print(f"text: {text} ({result.tokens} tokens scored; context {result.context} tokens, stride {result.stride})")
    if reads:
        print(f"store: {reads['disk_bytes_per_token'] / 2**20:.3f} MiB read from disk per token run, "
              f"{reads['skipped_per_token']:.3f} expert choices skipped and "
              f"{reads['fallback_uses_per_token']:.3f} served by fallback copies per token")
    print(f"perplexity: {result.perplexity:.4f}   (nll {result.nll:.4f} nats/token)")
    if ref is not None:
        print(f"reference perplexity: {result.reference_perplexity:.4f}")
        print(f"top-1 agreement with reference: {result.top1_agreement:.4f}")
        print(f"mean KL(reference || model): {result.kl:.6f} nats/token")


def _read_text(path: Path) -> str:
    from .tokenizer import valid_text

    try:
        return valid_text(path.read_bytes(), str(path))
    except FileNotFoundError:
        raise EdgeMoEError(f"{path}: text file not found") from None


def _load_served(model: Optional[Path], dtype: str, dense_bits: str, threads, store):
    """The model for serve and chat, with run's store options (refused for a checkpoint directory)."""
    import edgemoe

    from .loader import require_decoder_only

    path = _model_path(model)
    m = edgemoe.load(path, _dtype(dtype), threads, store=store, dense_bits=dense_bits)
    _warn_ram_auto(m)
    require_decoder_only(m.spec, path, "serving and chat (edgemoe serve / chat)")
    if m.tokenizer is None:
        raise EdgeMoEError(f"{path}: no tokenizer.json, cannot generate text")
    return m


@app.command()
@_refuse_options_that_cannot_act
@_with_store_options("ram", "vram", "device", "policy", "preload")
def serve(
    model: Optional[Path] = typer.Argument(None, help="Checkpoint directory or store (default: the bundled model)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", callback=_checked(_port), help="TCP port (0: any free one)."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="Name clients pass as `model` "
                                             "(default: the directory's name)."),
    max_batch: int = typer.Option(16, "--max-batch", callback=_checked(options.integer_at_least, 1),
                                  help="Requests sharing one forward step at most."),
    max_connections: int = typer.Option(256, "--max-connections", callback=_checked(options.integer_at_least, 1),
                                        help="Connections served at once (a thread each); more wait to be "
                                             "accepted."),
    request_timeout: float = typer.Option(10.0, "--request-timeout", callback=_checked(options.timeout_seconds),
                                          help="Seconds for a request's line, headers and body to arrive from "
                                               "its first byte (and for each write to a client to go out)."),
    keep_alive_timeout: float = typer.Option(5.0, "--keep-alive-timeout",
                                             callback=_checked(options.timeout_seconds),
                                             help="Seconds a connection may sit idle waiting for a request."),
    dtype: str = _dtype_option(),
    dense_bits: str = _dense_bits_option(),
    threads: Optional[int] = _threads_option(),
    store=None,
):
    """OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) with continuous batching."""
    import logging

    from .server import serve as serve_http

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    m = _load_served(model, dtype, dense_bits, threads, store)
    serve_http(m, host, port, model_name=model_name, max_batch=max_batch, max_connections=max_connections,
               request_timeout=request_timeout, keep_alive_timeout=keep_alive_timeout)


@app.command()
@_refuse_options_that_cannot_act
@_with_store_options("ram", "vram", "device", "policy", "preload")
def chat(
    model: Optional[Path] = typer.Argument(None, help="Checkpoint directory or store (default: the bundled model)."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", "-n", callback=_checked(options.integer_at_least, 1),
                                       help="Longest answer, in tokens."),
    temperature: Optional[float] = typer.Option(None, callback=_checked(options.finite_at_least),
                                                help="0 = greedy (default: the model's generation_config)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", callback=_checked(options.integer_at_least, 0)),
    top_p: Optional[float] = typer.Option(None, "--top-p", callback=_checked(options.probability)),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    system: Optional[str] = typer.Option(None, "--system", help="A system message before the conversation."),
    dtype: str = _dtype_option(),
    dense_bits: str = _dense_bits_option(),
    threads: Optional[int] = _threads_option(),
    store=None,
):
    """Chat on stdin/stdout through the tokenizer's chat template (/reset, /exit; Ctrl-C stops an answer)."""
    from .chat import chat_loop
    from .tokenizer import valid_text

    system = None if system is None else valid_text(system, "--system")
    if hasattr(sys.stdin, "reconfigure"):   # a line that is not UTF-8 reaches the loop, which refuses it
        sys.stdin.reconfigure(errors="surrogateescape")
    m = _load_served(model, dtype, dense_bits, threads, store)
    _refuse_sampling_flags_if_greedy(m, _model_path(model), temperature,
                                     {"--top-k": top_k, "--top-p": top_p, "--seed": seed})
    sampling = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p).items() if v is not None}
    chat_loop(m, input, sys.stdout, max_new_tokens=max_new_tokens, system=system, seed=seed, **sampling)


def main() -> None:
    """The console script: one line on stderr and exit status 2 for bad input of any kind."""
    try:
        status = app(standalone_mode=False, prog_name="edgemoe")
    except typer.TyperException as e:   # the command line itself: unknown option, bad type, missing value
        command = e.ctx.command_path if getattr(e, "ctx", None) else "edgemoe"
        _fail(f"{e.format_message()} (see '{command} --help')", getattr(e, "exit_code", 2))
    except (typer.Abort, KeyboardInterrupt):
        _fail("interrupted", 130)
    except options.OptionError as e:   # a library check names the option as Python spells it: here, the flag
        _fail(e.on_command_line(), 2)
    except (EdgeMoEError, ValueError, OSError) as e:   # bad options reaching the library, unreadable files
        _fail(str(e), 2)
    sys.exit(status or 0)


def _fail(message: str, status: int) -> None:
    sys.stdout.flush()
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)
