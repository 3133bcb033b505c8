"""The `edgemoe` command: the commands of edgemoe/commands/ (one module each) gathered into one typer
app, and `main`, which turns bad input of any kind into one line on stderr and exit status 2."""

from __future__ import annotations

import sys

import typer

from . import options
from .commands import bench, chat, convert, eval as eval_command, inspect, profile, run, serve, simulate, trace
from .commands.cannot_act import CheckedCommand
from .errors import EdgeMoEError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run Mixture-of-Experts LLMs on machines too small to hold them.")


@app.callback()
def _group() -> None:
    """Run Mixture-of-Experts LLMs on machines too small to hold them."""


COMMANDS = {"run": run.run, "convert": convert.convert, "inspect": inspect.inspect, "trace": trace.trace,
            "profile": profile.profile, "bench": bench.bench, "simulate": simulate.simulate,
            "eval": eval_command.eval_, "serve": serve.serve, "chat": chat.chat}
for name, command in COMMANDS.items():
    app.command(name, cls=CheckedCommand)(command)


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
