"""The `weightsvc` command line. Exit code 0 on success; otherwise one line on stderr and 1 (2: a usage error).

Start-up stays light: torch, numba and the server are imported inside the commands that use them,
so `status`, `pull`, `push` and every usage error answer at once.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from typer.core import TyperGroup

from weightsvc.errors import DeadlineExceeded, WeightsvcError
from weightsvc.protocol.safetensors import header_length

if TYPE_CHECKING:
    from weightsvc.settings import Settings

try:  # typer 0.29 carries its own copy of click; earlier releases use click itself
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:
    from click.exceptions import ClickException, NoArgsIsHelpError  # type: ignore[assignment]

DEFAULT_TARGET = "127.0.0.1:50051"


class _Commands(TyperGroup):
    """`serve` takes its flags from `Settings` (pydantic-settings): the command is built only when it
    is asked for, so the other commands do not import the settings."""

    # The context and command types are click's, of the copy this typer carries (typer.core's).
    def list_commands(self, ctx: Any) -> list[str]:
        return ["serve", *(name for name in super().list_commands(ctx) if name != "serve")]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name == "serve" and "serve" not in self.commands:
            self.add_command(_serve_command(), "serve")
        return super().get_command(ctx, cmd_name)


app = typer.Typer(
    name="weightsvc",
    cls=_Commands,
    help="Weight broadcast for RL fine-tuning: fp32 masters in, Fair Cast served copies out.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def say(message: str) -> None:
    """A line on stdout (plain text: rich is loaded only by the commands that draw tables or bars)."""
    print(message, flush=True)


def note(message: str) -> None:
    """A line on stderr: progress of long commands."""
    print(message, file=sys.stderr, flush=True)


def fail(message: str) -> NoReturn:
    note(f"error: {message}")
    raise typer.Exit(1)


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


# ---- serve -----------------------------------------------------------------------------------


def serve(settings: Settings) -> None:
    """Run the service (gRPC + HTTP) on the embedded default: in-memory registry, CPU export."""
    import asyncio
    import gc
    import logging
    import signal

    from weightsvc._log import configure_logging
    from weightsvc.server.server import Server

    configure_logging(settings.log_level)

    async def run() -> None:
        server = Server(settings)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await server.start()
        # A push of 100,000 tensors makes millions of objects, and each full collection of the
        # cyclic GC (which holds the GIL, so the event loop, for 0.3 s and more) walks all of them:
        # collect the oldest generation 100 times less often, and never walk what start-up loaded.
        gc.freeze()
        gc.set_threshold(700, 10, 1000)
        # One machine-readable line on stdout, for scripts that started us with port 0.
        print(f"weightsvc ready grpc={server.grpc_target} http={server.http_url} "
              f"device={server.device}", flush=True)
        await stop.wait()
        logging.getLogger("weightsvc").info("shutting down")
        await server.stop()

    try:
        asyncio.run(run())
    except OSError as e:
        fail(str(e))
    except WeightsvcError as e:  # a setting that cannot be had here (--device cuda without a GPU)
        fail(e.message)


def _serve_command() -> Any:
    from weightsvc.cli.flags import settings_command

    one = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    one.command("serve", epilog=_SERVE_EPILOG)(settings_command(serve))
    return typer.main.get_command(one)


_SERVE_EPILOG = (
    "Every flag can also be set by its WEIGHTSVC_* variable; a flag wins over its variable. Bearer tokens "
    "come from WEIGHTSVC_PULL_TOKENS, WEIGHTSVC_PUSH_TOKENS and WEIGHTSVC_ADMIN_TOKENS (comma-separated) "
    "or --auth-file, never from flags."
)


# ---- files -----------------------------------------------------------------------------------

# The first bytes of the files torch.save writes: a zip archive, or a pickle (protocol 2 to 5).
_TORCH_MAGIC = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


def read_file_header(path: Path) -> tuple[int, dict[str, Any]]:
    """Where the data of a safetensors file starts, and its JSON header; or an error naming the file
    and what it holds instead."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            length = header_length(prefix) if len(prefix) == 8 else -1
            raw = f.read(length) if 0 < length <= size - 8 else b""
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    if prefix.startswith(_TORCH_MAGIC):
        fail(f"{path} is not a safetensors file: it is a torch.save checkpoint; convert it with "
             f"safetensors.torch.save_file(torch.load(...), 'masters.safetensors')")
    if not raw:
        fail(f"{path} is not a safetensors file: its first 8 bytes give a header of {length} bytes "
             f"in a file of {size} bytes")
    try:
        header = json.loads(raw)
    except ValueError:
        header = None
    if not isinstance(header, dict):
        fail(f"{path} is not a safetensors file: its header is not a JSON object")
    return 8 + length, header


def check_base_file(path: Path, model: str, base: int) -> None:
    """`pull --base`: the output file must hold that version of the model, as a previous pull wrote it."""
    from weightsvc.protocol.manifest import manifest_from_header

    if not path.exists():
        fail(f"--base {base}: {path} does not exist; pull model {model!r} version {base} into it first "
             f"(without --base)")
    _, header = read_file_header(path)
    try:
        held = manifest_from_header(header)
    except WeightsvcError as e:
        fail(f"--base {base}: {path} was not written by `weightsvc pull` ({e}); pull model {model!r} "
             f"version {base} into it first (without --base)")
    if (held.model, held.version) != (model, base):
        fail(f"--base {base}: {path} holds model {held.model!r} version {held.version}, "
             f"not model {model!r} version {base}")


# ---- push, pull, export ----------------------------------------------------------------------


def load_masters(path: Path, data_start: int, header: dict[str, Any]) -> dict[str, Any]:
    """The tensors of a safetensors file as numpy arrays (no torch). numpy has no bfloat16: a bf16
    tensor is widened to fp32 from its bits, which is exact."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load_file

    entries = {name: e for name, e in header.items() if name != "__metadata__"}
    if all(e.get("dtype") != "BF16" for e in entries.values()):
        return load_file(path)
    masters: dict[str, Any] = {}
    with safe_open(path, framework="numpy") as f:
        for name, e in entries.items():
            if e["dtype"] != "BF16":
                masters[name] = f.get_tensor(name)
                continue
            start, end = e["data_offsets"]
            bits = np.fromfile(path, dtype="<u2", count=(end - start) // 2, offset=data_start + start)
            masters[name] = (bits.astype("<u4") << 16).view("<f4").reshape(e["shape"])
    return masters


@app.command()
def push(
    file: Annotated[Path, typer.Argument(help="fp32 (or exactly widenable bf16/fp16) safetensors file.")],
    step: Annotated[int, typer.Option(help="The learner's step: the version number.")],
    model: Annotated[str, typer.Option(help="Model name.")] = "default",
    target: Annotated[str, typer.Option(envvar="WEIGHTSVC_TARGET", help="gRPC HOST:PORT.")] = DEFAULT_TARGET,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    tie: Annotated[
        list[str] | None,
        typer.Option(help="ALIAS=TENSOR: a tied name (e.g. lm_head.weight=model.embed_tokens.weight), served "
                     "with TENSOR's bytes. Repeatable."),
    ] = None,
    token: Token = None,
    ca_cert: CaCert = None,
) -> None:
    """Push fp32 master weights; prints the committed version."""
    tied = {}
    for t in tie or []:
        alias, eq, name = t.partition("=")
        if not (alias and eq and name):
            fail(f"--tie takes ALIAS=TENSOR, got {t!r}")
        tied[alias] = name
    data_start, header = read_file_header(file)  # a clear error before anything heavy loads
    from safetensors import SafetensorError

    from weightsvc.client import LearnerClient

    try:
        state = load_masters(file, data_start, header)
    except (OSError, SafetensorError, ValueError, KeyError) as e:
        fail(f"cannot read {file}: {e}")
    total = sum(a.size * 4 for a in state.values())
    try:
        with (
            LearnerClient(target, token=token, ca_cert=ca_cert) as client,
            progress_bar(f"push step {step}", total, progress) as bar,
        ):
            info = client.push(step, state, model=model, progress=bar, tied=tied)
    except (WeightsvcError, TypeError, ValueError) as e:
        fail(str(e))
    verb = "committed" if info.created else "already committed (identical content)"
    say(
        f"{verb}: model {info.model} version {info.version} ({info.tensor_count} tensors, "
        f"{info.data_bytes} served bytes, {info.format}/{info.rounding})"
    )


@app.command()
def pull(
    ctx: typer.Context,
    output: Annotated[Path, typer.Option("-o", "--output", help="Output safetensors file.")],
    model: Annotated[str, typer.Option(help="Model name.")] = "default",
    version: Annotated[str, typer.Option(help="Version number or 'latest'.")] = "latest",
    base: Annotated[
        int | None, typer.Option(help="Delta pull: OUTPUT holds this version; fetch only what changed.")
    ] = None,
    target: Annotated[str, typer.Option(envvar="WEIGHTSVC_TARGET", help="gRPC HOST:PORT.")] = DEFAULT_TARGET,
    url: Annotated[str | None, typer.Option(help="HTTP base URL, e.g. http://HOST:8080 (instead of --target).")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    token: Token = None,
    ca_cert: CaCert = None,
) -> None:
    """Pull a served version into a safetensors file (checksums verified)."""
    source = ctx.get_parameter_source("target")
    if url is not None and source is not None and source.name == "COMMANDLINE":
        fail("give exactly one of --target HOST:PORT (gRPC) or --url http://HOST:PORT (HTTP)")
    if base is not None:
        check_base_file(output, model, base)
    from weightsvc.client import InferenceClient

    try:
        with InferenceClient(url or target, token=token, ca_cert=ca_cert) as client:
            size = client.manifest(model, version).data_bytes
            with progress_bar(f"pull {model}@{version}", size, progress) as bar:
                manifest = client.pull_file(output, model, version, base=base, progress=bar)
    except (WeightsvcError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot read or write {output}: {e}")
    say(
        f"pulled model {manifest.model} version {manifest.version} -> {output} "
        f"({len(manifest.tensors)} tensors, checksums verified)"
    )


@app.command()
def export(
    input: Annotated[Path, typer.Argument(help="fp32 masters (safetensors).")],
    output: Annotated[Path, typer.Argument(help="Where to write the served copy (safetensors).")],
    step: Annotated[int, typer.Option(help="The version the served copy is keyed by.")],
    format: Annotated[str, typer.Option(help="bf16, fp16, fp8_e4m3 or fp8_e5m2.")] = "bf16",
    rounding: Annotated[str, typer.Option(help="rtn, sr, sr-sticky or ef.")] = "sr",
    seed: Annotated[int, typer.Option(help="Seed of the rounding RNG.")] = 0,
    scaling: Annotated[str, typer.Option(help="fp8 scales: tensor, channel or block.")] = "block",
    residual: Annotated[
        Path | None, typer.Option(help="ef: the residual file, read when it exists and rewritten.")
    ] = None,
) -> None:
    """Fair Cast a checkpoint offline: the same bits the service serves for the same keys."""
    read_file_header(input)
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    from weightsvc.rounding import ExportSpec, Residual, export_state_dict

    try:
        spec = ExportSpec(format, rounding, seed, scaling)
    except ValueError as e:
        fail(str(e))
    if spec.rounding == "ef" and residual is None:
        fail("--rounding ef needs --residual FILE (created when missing)")
    try:
        masters = load_file(str(input))
        state = Residual.load(residual) if residual is not None and residual.exists() else None
    except (OSError, SafetensorError) as e:
        fail(f"cannot read {input if residual is None or not residual.exists() else residual}: {e}")
    if spec.rounding == "ef":
        state = state or Residual()
        if state.version is not None and step <= state.version:
            fail(f"the residual in {residual} is of step {state.version}; --step must be above it")
    try:
        served = export_state_dict(masters, spec, version=step, residual=state)
    except (TypeError, ValueError) as e:
        fail(str(e))
    meta = {"format": spec.format, "rounding": spec.rounding, "seed": str(seed), "version": str(step)}
    save_file(served, str(output), metadata=meta)
    if state is not None and residual is not None:
        state.save(residual)
    say(f"exported {len(masters)} tensors at step {step} ({spec.format}/{spec.rounding}) -> {output}")


# ---- status ----------------------------------------------------------------------------------


def status_report(
    target: str, model: str | None, token: str | None, ca_cert: Path | None, timeout: float
) -> dict[str, Any]:
    """Each model with its retained versions and its inference clients, and the files the server
    set aside as damaged at start-up, as `status --json` prints them. Fields that are the same on
    every version of a listing (its model, `created`, `served`) are left out."""
    from weightsvc.client import InferenceClient

    with InferenceClient(target, token=token, ca_cert=ca_cert, timeout=timeout) as client:
        damaged = [d for d in client.damaged_files() if model is None or d["model"] == model]
        models = [m for m in client.models() if model is None or m["model"] == model]
        if model is not None and not models:
            aside = "".join(f"; damaged file set aside at start-up: {d['file']} ({d['reason']})" for d in damaged)
            fail(f"NOT_FOUND: unknown model {model!r}: nothing has been committed for it{aside}")
        report = []
        for m in models:
            versions = [
                {k: v for k, v in dataclasses.asdict(info).items() if k not in ("model", "created", "served")}
                for info in client.versions(m["model"])
            ]
            clients = [dataclasses.asdict(c) for c in client.clients(m["model"])]
            report.append(
                {"model": m["model"], "latest_version": m["latest_version"], "versions": versions, "clients": clients}
            )
    return {"models": report, "damaged_files": damaged}


def _when(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


@app.command()
def status(
    target: Annotated[
        str, typer.Option(envvar="WEIGHTSVC_TARGET", help="gRPC HOST:PORT or http://HOST:PORT.")
    ] = DEFAULT_TARGET,
    model: Annotated[str | None, typer.Option(help="Only this model.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the server's answer.")] = 5.0,
    token: Token = None,
    ca_cert: CaCert = None,
) -> None:
    """Models, their retained versions with lag metrics, the inference clients with their lag, and
    the damaged files the server set aside at start-up (a warning line each)."""
    try:
        full = status_report(target, model, token, ca_cert, timeout)
    except DeadlineExceeded:  # a server that is up but stuck, or an address that drops packets
        fail(f"DEADLINE_EXCEEDED: {target} did not answer within {timeout:g} s")
    except WeightsvcError as e:
        fail(str(e))
    if json_out:
        print(json.dumps(full, indent=2))
        return
    for d in full["damaged_files"]:
        note(f"warning: model {d['model']}: damaged file set aside at start-up: {d['file']}: {d['reason']}")
    report = full["models"]
    if not report:
        say("no models committed yet")
        return
    from rich.table import Table

    versions = Table("model", "version", "format", "rounding", "tensors", "served bytes", "committed (UTC)",
                     "lag (steps)", "visibility", "churn", "rel. error", title="versions")
    for m in report:
        for i, v in enumerate(m["versions"]):
            latest = " (latest)" if v["version"] == m["latest_version"] else ""
            lag = v["lag"] or {}
            visibility = lag.get("update_visibility")
            versions.add_row(
                m["model"] if i == 0 else "", f"{v['version']}{latest}", v["format"], v["rounding"],
                str(v["tensor_count"]), f"{v['data_bytes']:,}", _when(v["committed_unix"]),
                str(lag.get("lag_steps", "-")), "-" if visibility is None else f"{visibility:.2f}",
                f"{lag['churn']:.3f}" if lag else "-", f"{lag['relative_error']:.2e}" if lag else "-",
                end_section=i == len(m["versions"]) - 1,
            )
    print_table(versions)
    if not any(m["clients"] for m in report):
        say("no inference client has acked a version yet")
        return
    clients = Table("model", "client", "version", "behind (versions)", "last ack (UTC)", "connected", title="clients")
    for m in report:
        for i, c in enumerate(m["clients"]):
            clients.add_row(
                m["model"] if i == 0 else "", c["client_id"], str(c["version"]), str(c["lag_versions"]),
                _when(c["last_seen_unix"]), "yes" if c["connected"] else "no",
                end_section=i == len(m["clients"]) - 1,
            )
    print_table(clients)


# ---- demo, bench -----------------------------------------------------------------------------


@app.command()
def demo(
    steps: Annotated[int, typer.Option(help="RL steps per rounding mode.")] = 300,
    lr: Annotated[float, typer.Option(help="Adam learning rate.")] = 1e-5,
    format: Annotated[
        str, typer.Option("--format", help="Served format: a name in weightsvc.rounding.FORMATS (bf16, fp8_e4m3, ...).")
    ] = "bf16",
    png: Annotated[Path | None, typer.Option(help="Also plot lag and reward per step into this PNG.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the table as JSON keyed by mode.")] = False,
) -> None:
    """The paper's experiment: RL fine-tuning per rounding mode through the service; lag and reward."""
    from weightsvc import rounding
    from weightsvc._log import configure_logging
    from weightsvc.cli.demo import COLUMNS, REWARD_THRESHOLD, REWARD_WINDOW, as_rows, run_demo

    if format not in rounding.FORMATS:
        raise typer.BadParameter(f"unknown format {format!r}; choose one of {', '.join(rounding.FORMATS)}",
                                 param_hint="--format")
    configure_logging("warning")
    results = run_demo(steps=steps, lr=lr, format=format, png=png, log=None if json_out else note)
    if json_out:
        print(json.dumps(results, indent=2))
        return
    from rich.table import Table

    table = Table("mode", *COLUMNS.values(), title=f"{format}, Adam lr {lr:g}, {steps} steps")
    for row in as_rows(results):
        table.add_row(*row)
    print_table(table)
    note(f"steps to reward: the first step whose mean reward over the last {REWARD_WINDOW} steps reaches "
         f"{REWARD_THRESHOLD:g} (chance 1/8); reward AUC: the mean reward over all steps")


def _ints(flag: str, text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers, e.g. `--pullers 1,8`."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of positive integers", param_hint=flag)
    return values


@app.command()
def bench(
    size_mib: Annotated[int, typer.Option(help="fp32 model size in MiB (T, E1, P1, S2).")] = 1024,
    repeat: Annotated[int, typer.Option(help="Runs per figure; the best is kept.")] = 5,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object keyed by figure id.")] = False,
    only: Annotated[
        str | None,
        typer.Option(help="Comma-separated figure ids to measure, e.g. E1,S1 (default: all)."),
    ] = None,
    pullers: Annotated[str, typer.Option(help="E1: numbers of watching pullers, comma-separated.")] = "1,8",
    s1_mib: Annotated[int, typer.Option(help="S1: total fp32 MiB, split into each count of --s1-tensors.")] = 64,
    s1_tensors: Annotated[
        str, typer.Option(help="S1: tensor counts, comma-separated (two at least: the slope).")
    ] = "100,10000,100000",
    s2_retain: Annotated[str, typer.Option(help="S2: --retain values of the server, comma-separated.")] = "1,2,4",
    soak: Annotated[
        float | None,
        typer.Option(help="Instead: SECONDS of one learner pushing and 8 pullers; RSS must stay within 10%."),
    ] = None,
) -> None:
    """Transfer and export benchmarks: sync time, pull, push and fan-out vs raw TCP loopback, per-tensor
    cost, server RSS, kernels."""
    from weightsvc._log import configure_logging
    from weightsvc.cli.bench import PARTS, run_bench
    from weightsvc.cli.bench import soak as run_soak

    figures = None if only is None else {x.strip() for x in only.split(",")}
    unknown = sorted((figures or set()) - set(PARTS))
    if unknown:
        raise typer.BadParameter(f"unknown figure(s) {', '.join(unknown)}; known: {', '.join(PARTS)}",
                                 param_hint="--only")
    counts = _ints("--s1-tensors", s1_tensors)
    if len(set(counts)) < 2:
        raise typer.BadParameter("give two different counts at least: S1 is a slope", param_hint="--s1-tensors")
    configure_logging("warning")
    if soak is not None:
        result = run_soak(soak, size_mib=min(size_mib, 64), log=None if json_out else note)
        print(json.dumps(result, indent=2))
        if not result["ok"]:
            raise typer.Exit(1)
        return
    result = run_bench(size_mib=size_mib, repeat=repeat, only=figures, pullers=_ints("--pullers", pullers),
                       s1_mib=s1_mib, s1_tensors=counts, s2_retains=_ints("--s2-retain", s2_retain),
                       log=None if json_out else note)
    report = result.pop("report")
    if json_out:
        print(json.dumps(result, indent=2))
        return
    from rich.table import Table

    table = Table("id", "figure", "value", "target")
    for key, row in report.items():
        table.add_row(key, row["what"], row["value"], row["target"])
    print_table(table)


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
