"""Values given on the command line (or by any caller), checked once, where they enter.

Each check takes the value and the option's name as the user wrote it ("--ram", or "ram=" from
Python) and returns the typed value, or raises OptionError naming that option, the value and what
is expected. The CLI wraps them as typer callbacks; the library calls the same checks for its own
arguments, so both give the same message.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

from .errors import EdgeMoEError, option_message


class OptionError(EdgeMoEError):
    """An option's value that cannot be used."""

    def __init__(self, option: str, value, expected: str):
        super().__init__(option_message(option, value, expected))
        self.option = option


def finite_at_least(value: float | None, option: str, low: float = 0.0) -> float | None:
    """A finite number >= low (None passes: the option was not given)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < low:
        raise OptionError(option, value, f"expected a finite number >= {low:g}")
    return float(value)


def probability(value: float | None, option: str) -> float | None:
    """A number in (0, 1] (top-p, a share)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise OptionError(option, value, "expected a number in (0, 1]")
    return float(value)


def integer_at_least(value: int | None, option: str, low: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise OptionError(option, value, f"expected an integer >= {low}")
    return int(value)


def window_length(value: int | None, option: str, context: int) -> int | None:
    """A window of tokens run as one sequence: 2 .. the model's context (max_position_embeddings)."""
    value = integer_at_least(value, option, 2)
    if value is not None and value > context:
        raise OptionError(option, value, f"longer than the model's context of {context} tokens "
                                         f"(max_position_embeddings)")
    return value


def one_of(value: str | None, option: str, choices: Sequence[str]) -> str | None:
    if value is not None and value not in choices:
        raise OptionError(option, value, f"expected one of {', '.join(map(str, choices))}")
    return value


def unescape(text: str) -> str:
    r"""Shell-typed escapes in a stop string: \n, \t, \r and \\ (a shell passes them literally)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "ntr\\":
            out.append({"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
