"""Values given on the command line (or by any caller), checked once, where they enter.

Each check takes the value and the option's name as the user wrote it ("--ram", or "ram=" from
Python) and returns the typed value, or raises OptionError naming that option, the value and what
is expected. The CLI wraps them as typer callbacks; the library calls the same checks for its own
arguments, so both give the same message.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Sequence

from .errors import EdgeMoEError, option_message


class OptionError(EdgeMoEError):
    """An option's value that cannot be used."""

    def __init__(self, option: str, value, expected: str):
        super().__init__(option_message(option, value, expected))
        self.option, self.value, self.expected = option, value, expected

    def on_command_line(self) -> str:
        """The message with the option spelled as its flag ("fallback_bits=" -> "--fallback-bits"): a
        library check reached from the command line names what the user typed."""
        if not self.option.endswith("="):
            return str(self)
        return option_message(cli_flag(self.option[:-1]), self.value, self.expected)


def cli_flag(option: str) -> str:
    """A Python option name as its command-line flag: "skip_below" -> "--skip-below"."""
    return "--" + option.replace("_", "-")


def finite_at_least(value: float | None, option: str, low: float = 0.0) -> float | None:
    """A finite number >= low (None passes: the option was not given)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < low:
        raise OptionError(option, value, f"expected a finite number >= {low:g}")
    return float(value)


def timeout_seconds(value: float | None, option: str) -> float | None:
    """A timeout: a finite number of seconds, at least 0.01 (a shorter one would cut off any client)."""
    return finite_at_least(value, option, 0.01)


def finite_number(value: float | None, option: str) -> float | None:
    """Any finite number (a length penalty may be negative)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise OptionError(option, value, "expected a finite number")
    return float(value)


def probability(value: float | None, option: str) -> float | None:
    """A number in (0, 1] (top-p, a share)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise OptionError(option, value, "expected a number in (0, 1]")
    return float(value)


def routing_weight(value: float, option: str) -> float:
    """A threshold on routing weights, in [0, 1) (0: off): --skip-below, --fallback-below."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise OptionError(option, value, "expected a routing weight in [0, 1)")
    return float(value)


def integer_at_least(value: int | None, option: str, low: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise OptionError(option, value, f"expected an integer >= {low}")
    return int(value)


def kernel_thread_limit() -> int:
    """The most threads the kernels can run: numba's thread pool, NUMBA_NUM_THREADS or by default
    the machine's CPUs (read as numba reads them, without importing numba: the command line checks
    --threads before loading anything)."""
    return int(os.environ.get("NUMBA_NUM_THREADS") or os.cpu_count() or 1)


def thread_count(value: int | None, option: str) -> int | None:
    """A kernel thread count, 1 .. kernel_thread_limit() (None passes: the default, idle cores)."""
    value = integer_at_least(value, option, 1)
    limit = kernel_thread_limit()
    if value is not None and value > limit:
        raise OptionError(option, value, f"expected an integer in 1..{limit} (the kernels' thread pool: "
                                         f"NUMBA_NUM_THREADS, by default this machine's CPUs)")
    return value


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


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(value: int | str | None, option: str, share_of: int | None = None,
              allow_share: bool = False, allow_auto: bool = False) -> int | str | None:
    """'512MiB', '2GB', '1.5G', 1048576 -> bytes; '25%' -> that share of `share_of` bytes (a store's
    expert bytes). Without `share_of`, a valid share is returned as given (allow_share), to be resolved
    where the total is known. None stays None (no limit). allow_auto: 'auto' is returned as given (a
    RAM budget chosen when the store opens: edgemoe.loader.auto_ram)."""
    if value is None or (allow_auto and value == "auto"):
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value < 0:
            raise OptionError(option, value, "expected a size >= 0")
        return int(value)
    text = str(value).strip().lower()
    if text.endswith("%") and (allow_share or share_of is not None):
        share = _finite(text[:-1])
        if share is None or not 0 <= share <= 100:
            raise OptionError(option, value, "expected a percentage in [0, 100]")
        return text if share_of is None else int(share / 100 * share_of)
    number = text.rstrip("kmgtib")
    amount, unit = _finite(number), _UNITS.get(text[len(number):])
    if amount is None or unit is None or amount < 0:
        shares = " or a share of the store's expert bytes like 25%" if allow_share or share_of is not None else ""
        auto = ", or auto" if allow_auto else ""
        raise OptionError(option, value, f"expected a size like 512MiB, 2GB or 1048576{shares}{auto}")
    return int(amount * unit)


def _finite(text: str) -> float | None:
    try:
        x = float(text)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def check_device(value, option: str):
    """The VRAM tier's device, one this build of torch can use ('cuda', 'cuda:1', 'mps'; 'cpu' is a
    stand-in for tests). A torch.device or name; returned unchanged."""
    import torch   # here, not at the top: the option checks stay light for the command line

    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise OptionError(option, value, "not a torch device name (e.g. cuda, cuda:0, cpu)") from None
    if device.type == "cpu":
        return value
    module = getattr(torch, device.type, None)
    available = getattr(module, "is_available", None)
    if available is None or not available():
        raise OptionError(option, value, f"this torch build ({torch.__version__}) has no usable "
                                         f"{device.type} device")
    if device.index is not None and device.index >= module.device_count():
        raise OptionError(option, value, f"there are {module.device_count()} {device.type} devices")
    return value


def dense_bits(value: str, option: str) -> int | str | None:
    """--dense-bits: "auto" as it is, "none" as None (as loaded), "8" or "4" as the width."""
    one_of(value, option, ("auto", "none", "8", "4"))
    return {"auto": "auto", "none": None}[value] if value in ("auto", "none") else int(value)
