"""The `weightsvc` command line. Exit code 0 on success; otherwise one line on stderr and 1 (2: a usage error).

Start-up stays light: torch, numba and the server are imported inside the commands that use them,
so `status`, `pull`, `push` and every usage error answer at once.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperGroup

from weightsvc.cli import commands, follow, status
from weightsvc.cli._common import note

try:  # typer 0.29 carries its own copy of click; earlier releases use click itself
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:
    from click.exceptions import ClickException, NoArgsIsHelpError  # type: ignore[assignment]



def _serve() -> Any:
    from weightsvc.cli import serve

    return serve.click_command()


def _export() -> Any:
    from weightsvc.cli import export

    return export.click_command()


# The commands built only when asked for: they take their flags or choices from `Settings`
# (pydantic-settings) and `weightsvc.rounding` (numpy), which the other commands do not import.
_BUILT_ON_DEMAND: dict[str, Callable[[], Any]] = {"serve": _serve, "export": _export}


class _Commands(TyperGroup):
    """The command group: `serve` first, then the others by name; `serve` and `export` built on demand."""

    # The context and command types are click's, of the copy this typer carries (typer.core's).
    def list_commands(self, ctx: Any) -> list[str]:
        return ["serve", *sorted({*super().list_commands(ctx), *_BUILT_ON_DEMAND} - {"serve"})]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name in _BUILT_ON_DEMAND and cmd_name not in self.commands:
            self.add_command(_BUILT_ON_DEMAND[cmd_name](), cmd_name)
        return super().get_command(ctx, cmd_name)


app = typer.Typer(
    name="weightsvc",
    cls=_Commands,
    help="Weight broadcast for RL fine-tuning: fp32 masters in, Fair Cast served copies out.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


app.command()(commands.push)
app.command()(commands.pull)
app.command()(status.status)
app.command()(commands.demo)
app.command()(commands.bench)
app.command()(follow.follow)


def main(args: list[str] | None = None) -> None:
    """The `weightsvc` entry point: usage errors, like every other error, are one line on stderr."""
    argv = sys.argv[1:] if args is None else args
    # gRPC's C core may print its own log lines (a refused connection, say) on stderr; a client
    # command reports errors itself, in one line. The server keeps gRPC's errors.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR" if argv[:1] == ["serve"] else "NONE")
    command = typer.main.get_command(app)
    try:
        code = command.main(argv, prog_name="weightsvc", standalone_mode=False)
    except NoArgsIsHelpError as e:
        note(e.format_message())
        code = 2
    except ClickException as e:
        ctx = getattr(e, "ctx", None)
        message = e.format_message().rstrip(".")
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        note(f"error: {message}{hint}")
        code = e.exit_code
    except (typer.Abort, KeyboardInterrupt):
        code = 130
    sys.exit(code if isinstance(code, int) else 0)
