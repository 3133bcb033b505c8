"""Options that cannot act where they are given: refused, never silently ignored. One table,
CANNOT_ACT, checked before each command runs (CheckedCommand, the class of every command)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import typer
import typer.core

from edgemoe import options
from edgemoe.errors import EdgeMoEError

from .options import STORE_COMMANDS, flag_of


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
    CannotAct(STORE_COMMANDS, "device", lambda a: not a.given("vram"), "only with --vram (the device holds "
              "the VRAM tier)"),
    *_every(("bench",), ("skip_below", "fallback_below"),
            lambda a: a.given("mode") and "predictive" not in a.mode,
            "only with --mode predictive (the other modes run without quality trade-offs)"),
    CannotAct(("bench",), "ram", lambda a: a.given("mode") and set(a.mode) == {"all-in-ram"}, "cannot act with "
              "only --mode all-in-ram (it holds every expert in RAM)"),
    CannotAct(("bench",), "routing", lambda a: a.given("replay"), "cannot act with --replay (the trace routes "
              "every run)"),
    *_every(("convert",), ("metric", "heldout", "calib_tokens", "confidence", "importance", "search_minutes"),
            lambda a: not a.given("budget"), "only with --budget"),
    CannotAct(("convert",), "bits", lambda a: a.given("widths") or a.given("budget"), "cannot act with --widths "
              "or --budget (they set every expert's width)"),
    *_every(("profile",), ("context", "threads"), lambda a: a.given("trace_file"), "cannot act with --trace "
            "(a profile built from a trace runs no text through the model)"),
)


class CheckedCommand(typer.core.TyperCommand):
    """A command whose arguments are checked against CANNOT_ACT once parsed, before it runs (the
    click context knows which options were given)."""

    def invoke(self, ctx: typer.Context):
        arguments = GivenArguments(ctx, ctx.params)
        for rule in CANNOT_ACT:
            if ctx.info_name in rule.commands and arguments.given(rule.option) and rule.when(arguments):
                raise EdgeMoEError(_cannot_act_message(ctx, rule, ctx.params[rule.option]))
        return super().invoke(ctx)


def refuse_sampling_flags_if_greedy(model, path: Path, temperature, sampling_flags: dict) -> None:
    """CANNOT_ACT's greedy rule where the model decides it: without --temperature, decoding samples
    only if generation_config.json says do_sample; otherwise --top-k, --top-p and --seed cannot act."""
    from edgemoe.generate import defaults_from

    if temperature is not None or defaults_from(model.generation_config).get("temperature", 0) != 0:
        return
    for flag, value in sampling_flags.items():
        if value is not None:
            raise options.OptionError(flag, value, f"cannot act: {path}'s generation_config.json decodes greedily "
                                                   f"(give --temperature above 0 to sample)")


def _cannot_act_message(context, rule: CannotAct, value) -> str:
    flag = flag_of(next(p for p in context.command.params if p.name == rule.option))
    if isinstance(value, bool):          # a switch: no value to show
        return f"{flag}: {rule.why}"
    shown = value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value
    return options.option_message(flag, shown, rule.why)


