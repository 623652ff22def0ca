"""What the commands share: their output (one line, a table, a progress bar), the one-line failure,
and the options every client command takes."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

DEFAULT_TARGET = "127.0.0.1:50051"


def say(message: str) -> None:
    """A line on stdout (plain text: rich is loaded only by the commands that draw tables or bars)."""
    print(message, flush=True)


def note(message: str) -> None:
    """A line on stderr: progress of long commands."""
    print(message, file=sys.stderr, flush=True)


def fail(message: str) -> NoReturn:
    note(f"error: {message}")
    raise typer.Exit(1)


def one_source(ctx: typer.Context, url: str | None) -> None:
    """A command that reads from a server takes --target (gRPC) or --url (HTTP), not both."""
    source = ctx.get_parameter_source("target")
    if url is not None and source is not None and source.name == "COMMANDLINE":
        fail("give exactly one of --target HOST:PORT (gRPC) or --url http://HOST:PORT (HTTP) or s3://BUCKET/PREFIX")


def print_table(table: Any) -> None:
    from rich.console import Console

    Console(width=None if sys.stdout.isatty() else 200).print(table)  # pipes and files get whole cells


@contextmanager
def progress_bar(description: str, total: int, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """A rich transfer bar on stderr; yields the callback that advances it by a byte count."""
    if not enabled or not sys.stderr.isatty():
        yield lambda _n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


# Client credentials: the commands that talk to a server take them as options or from the environment.
Token = Annotated[
    str | None, typer.Option(envvar="WEIGHTSVC_TOKEN", help="Bearer token (role push to push, pull to read).")
]
CaCert = Annotated[
    Path | None, typer.Option(envvar="WEIGHTSVC_CA_CERT", help="PEM CA bundle for grpcs:// and https:// targets.")
]
