"""The `weightsvc` command line. Exit code 0 on success; otherwise one line on stderr and 1."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
from rich.table import Table

from weightsvc._log import configure_logging
from weightsvc.errors import WeightsvcError

app = typer.Typer(
    name="weightsvc",
    help="Weight broadcast for RL fine-tuning: fp32 masters in, Fair Cast served copies out.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
out = Console(width=None if sys.stdout.isatty() else 200)  # pipes and files get whole table cells
err = Console(stderr=True)


def fail(message: str) -> None:
    err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(1)


@contextmanager
def progress_bar(description: str, total: int, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """A rich transfer bar on stderr; yields the callback that advances it by a byte count."""
    if not enabled or not err.is_terminal:
        yield lambda _n: None
        return
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
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


@app.command()
def serve(
    host: Annotated[str, typer.Option(envvar="WEIGHTSVC_HOST", help="Address to bind.")] = "127.0.0.1",
    grpc_port: Annotated[int, typer.Option(envvar="WEIGHTSVC_GRPC_PORT", help="gRPC port (0 picks one).")] = 50051,
    http_port: Annotated[int, typer.Option(envvar="WEIGHTSVC_HTTP_PORT", help="HTTP port (0 picks one).")] = 8080,
    data_dir: Annotated[
        Path | None, typer.Option(envvar="WEIGHTSVC_DATA_DIR", help="Persist committed versions here.")
    ] = None,
    format: Annotated[str, typer.Option(envvar="WEIGHTSVC_FORMAT", help="bf16, fp16, fp8_e4m3 or fp8_e5m2.")] = "bf16",
    rounding: Annotated[str, typer.Option(envvar="WEIGHTSVC_ROUNDING", help="rtn, sr, sr-sticky or ef.")] = "sr",
    scaling: Annotated[
        str, typer.Option(envvar="WEIGHTSVC_SCALING", help="fp8 scales: tensor, channel or block.")
    ] = "block",
    seed: Annotated[int, typer.Option(envvar="WEIGHTSVC_SEED", help="Seed of the rounding RNG.")] = 0,
    device: Annotated[str, typer.Option(envvar="WEIGHTSVC_DEVICE", help="Export device.")] = "auto",
    retain: Annotated[int, typer.Option(envvar="WEIGHTSVC_RETAIN", help="Versions kept per model.")] = 4,
    allow_nonfinite: Annotated[
        bool, typer.Option(envvar="WEIGHTSVC_ALLOW_NONFINITE", help="Accept masters with NaN/Inf.")
    ] = False,
    push_idle_timeout_s: Annotated[
        float, typer.Option(envvar="WEIGHTSVC_PUSH_IDLE_TIMEOUT_S", help="Abandon a push silent this long.")
    ] = 120.0,
    push_rank_timeout_s: Annotated[
        float,
        typer.Option(
            envvar="WEIGHTSVC_PUSH_RANK_TIMEOUT_S",
            help="Abandon a multi-rank push whose ranks have not all joined this long after the first.",
        ),
    ] = 60.0,
    auth_file: Annotated[
        Path | None,
        typer.Option(envvar="WEIGHTSVC_AUTH_FILE", help='Tokens per role, JSON {"pull": [...], "push": [...]}.'),
    ] = None,
    auth_open_paths: Annotated[
        str, typer.Option(envvar="WEIGHTSVC_AUTH_OPEN_PATHS", help="HTTP paths that need no token.")
    ] = "/healthz,/readyz,/metrics",
    tls_cert: Annotated[Path | None, typer.Option(envvar="WEIGHTSVC_TLS_CERT", help="PEM certificate chain.")] = None,
    tls_key: Annotated[Path | None, typer.Option(envvar="WEIGHTSVC_TLS_KEY", help="PEM private key.")] = None,
    redis_url: Annotated[
        str | None,
        typer.Option(envvar="WEIGHTSVC_REDIS_URL", help="Shared registry for replicas (redis://host:6379/0)."),
    ] = None,
    relay_from: Annotated[
        str | None,
        typer.Option(envvar="WEIGHTSVC_RELAY_FROM", help="Mirror this upstream weightsvc (gRPC HOST:PORT): a relay."),
    ] = None,
    redis_prefix: Annotated[str | None, typer.Option(help="Key prefix in Redis (deployments sharing it).")] = None,
    replica_id: Annotated[str | None, typer.Option(help="This replica's stable name (default HOST-GRPCPORT).")] = None,
    advertise_host: Annotated[str | None, typer.Option(help="The host clients reach this replica by.")] = None,
    max_version_bytes: Annotated[int | None, typer.Option(help="Master bytes of one version.")] = None,
    max_tensor_bytes: Annotated[int | None, typer.Option(help="Master bytes of one tensor.")] = None,
    max_tensors: Annotated[int | None, typer.Option(help="Tensors of one version.")] = None,
    max_staged_bytes: Annotated[int | None, typer.Option(help="Served bytes staged by pushes in progress.")] = None,
    max_pushes: Annotated[int | None, typer.Option(help="Push streams at once.")] = None,
    max_pulls: Annotated[int | None, typer.Option(help="Pulls at once.")] = None,
    max_rss_bytes: Annotated[int | None, typer.Option(help="Memory high-water mark for new pushes.")] = None,
    pull_stall_timeout_s: Annotated[
        float | None, typer.Option(help="Drop a pull that reads nothing this long.")
    ] = None,
    log_level: Annotated[str, typer.Option(envvar="WEIGHTSVC_LOG_LEVEL")] = "info",
) -> None:
    """Run the service (gRPC + HTTP) on the embedded default: in-memory registry, CPU export."""
    from weightsvc.server.server import Server
    from weightsvc.settings import Settings

    limits: dict[str, Any] = {
        "redis_prefix": redis_prefix,
        "replica_id": replica_id,
        "advertise_host": advertise_host,
        "max_version_bytes": max_version_bytes,
        "max_tensor_bytes": max_tensor_bytes,
        "max_tensors": max_tensors,
        "max_staged_bytes": max_staged_bytes,
        "max_pushes": max_pushes,
        "max_pulls": max_pulls,
        "max_rss_bytes": max_rss_bytes,
        "pull_stall_timeout_s": pull_stall_timeout_s,
    }
    try:
        settings = Settings(
            host=host,
            grpc_port=grpc_port,
            http_port=http_port,
            data_dir=data_dir,
            format=format,
            rounding=rounding,
            scaling=scaling,
            seed=seed,
            device=device,
            retain=retain,
            allow_nonfinite=allow_nonfinite,
            push_idle_timeout_s=push_idle_timeout_s,
            push_rank_timeout_s=push_rank_timeout_s,
            auth_file=auth_file,
            auth_open_paths=auth_open_paths,
            tls_cert=tls_cert,
            tls_key=tls_key,
            redis_url=redis_url,
            relay_from=relay_from,
            log_level=log_level,
            # Limits: given on the command line, else WEIGHTSVC_* or the defaults of Settings.
            **{k: v for k, v in limits.items() if v is not None},
        )
    except ValidationError as e:
        first = e.errors()[0]
        fail(f"--{'-'.join(str(p) for p in first['loc']).replace('_', '-')}: {first['msg']}")
    configure_logging(settings.log_level)

    async def run() -> None:
        server = Server(settings)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await server.start()
        # One machine-readable line on stdout, for scripts that started us with port 0.
        print(f"weightsvc ready grpc={server.grpc_target} http={server.http_url}", flush=True)
        await stop.wait()
        logging.getLogger("weightsvc").info("shutting down")
        await server.stop()

    try:
        asyncio.run(run())
    except OSError as e:
        fail(str(e))


@app.command()
def push(
    file: Annotated[Path, typer.Argument(help="fp32 (or exactly widenable bf16/fp16) safetensors file.")],
    step: Annotated[int, typer.Option(help="The learner's step: the version number.")],
    model: Annotated[str, typer.Option(help="Model name.")] = "default",
    target: Annotated[str, typer.Option(envvar="WEIGHTSVC_TARGET", help="gRPC HOST:PORT.")] = "127.0.0.1:50051",
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    token: Token = None,
    ca_cert: CaCert = None,
) -> None:
    """Push fp32 master weights; prints the committed version."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from weightsvc.client import LearnerClient

    try:
        state = load_file(str(file))
    except (OSError, SafetensorError) as e:
        fail(f"cannot read {file}: {e}")
    total = sum(t.numel() * 4 for t in state.values())
    try:
        with (
            LearnerClient(target, token=token, ca_cert=ca_cert) as client,
            progress_bar(f"push step {step}", total, progress) as bar,
        ):
            info = client.push(step, state, model=model, progress=bar)
    except (WeightsvcError, TypeError) as e:
        fail(str(e))
    verb = "committed" if info.created else "already committed (identical content)"
    out.print(
        f"{verb}: model {info.model} version {info.version} ({info.tensor_count} tensors, "
        f"{info.data_bytes} served bytes, {info.format}/{info.rounding})",
        highlight=False,
    )


@app.command()
def pull(
    output: Annotated[Path, typer.Option("-o", "--output", help="Output safetensors file.")],
    model: Annotated[str, typer.Option(help="Model name.")] = "default",
    version: Annotated[str, typer.Option(help="Version number or 'latest'.")] = "latest",
    base: Annotated[
        int | None, typer.Option(help="Delta pull: OUTPUT holds this version; fetch only what changed (gRPC).")
    ] = None,
    target: Annotated[str | None, typer.Option(envvar="WEIGHTSVC_TARGET", help="gRPC HOST:PORT.")] = None,
    url: Annotated[str | None, typer.Option(help="HTTP base URL, e.g. http://HOST:8080.")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    token: Token = None,
    ca_cert: CaCert = None,
) -> None:
    """Pull a served version into a safetensors file (checksums verified)."""
    from weightsvc.client import InferenceClient

    if (target is None) == (url is None):
        fail("give exactly one of --target HOST:PORT (gRPC) or --url http://HOST:PORT (HTTP)")
    try:
        with InferenceClient(url or target or "", token=token, ca_cert=ca_cert) as client:
            size = client.manifest(model, version).data_bytes
            with progress_bar(f"pull {model}@{version}", size, progress) as bar:
                manifest = client.pull_file(output, model, version, base=base, progress=bar)
    except (WeightsvcError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot read or write {output}: {e}")
    out.print(
        f"pulled model {manifest.model} version {manifest.version} -> {output} "
        f"({len(manifest.tensors)} tensors, checksums verified)",
        highlight=False,
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
    out.print(
        f"exported {len(masters)} tensors at step {step} ({spec.format}/{spec.rounding}) -> {output}", highlight=False
    )


@app.command()
def status(
    target: Annotated[
        str, typer.Option(envvar="WEIGHTSVC_TARGET", help="gRPC HOST:PORT or http://HOST:PORT.")
    ] = "127.0.0.1:50051",
    model: Annotated[str | None, typer.Option(help="Only this model.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    token: Token = None,
    ca_cert: CaCert = None,
) -> None:
    """Models and their retained versions."""
    from weightsvc.client import InferenceClient

    try:
        with InferenceClient(target, token=token, ca_cert=ca_cert) as client:
            models = [m for m in client.models() if model is None or m["model"] == model]
            if model is not None and not models:
                fail(f"NOT_FOUND: unknown model {model!r}: nothing has been committed for it")
            report: list[dict[str, Any]] = [
                {**m, "versions": [dataclasses.asdict(v) for v in client.versions(m["model"])]} for m in models
            ]
    except WeightsvcError as e:
        fail(str(e))
    if json_out:
        print(json.dumps({"models": report}, indent=2))
        return
    if not report:
        out.print("no models committed yet")
        return
    table = Table("model", "version", "format", "rounding", "tensors", "served bytes", "committed",
                  "lag (steps)", "visibility", "churn", "rel. error")  # fmt: skip
    for m in report:
        for v in m["versions"]:
            when = dt.datetime.fromtimestamp(v["committed_unix"], dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
            latest = " (latest)" if v["version"] == m["latest_version"] else ""
            lag = v["lag"] or {}
            visibility = lag.get("update_visibility")
            table.add_row(
                m["model"], f"{v['version']}{latest}", v["format"], v["rounding"], str(v["tensor_count"]),
                f"{v['data_bytes']:,}", when, str(lag.get("lag_steps", "-")),
                "-" if visibility is None else f"{visibility:.2f}",
                f"{lag['churn']:.3f}" if lag else "-", f"{lag['relative_error']:.2e}" if lag else "-",
            )  # fmt: skip
    out.print(table)


@app.command()
def demo(
    steps: Annotated[int, typer.Option(help="RL steps per rounding mode.")] = 300,
    lr: Annotated[float, typer.Option(help="Adam learning rate.")] = 3e-6,
    png: Annotated[Path, typer.Option(help="Where to write the plot of lag and reward.")] = Path("demo.png"),
    json_out: Annotated[bool, typer.Option("--json", help="Print the table as JSON keyed by mode.")] = False,
) -> None:
    """The paper's experiment: RL fine-tuning per rounding mode through the service; lag and reward."""
    from weightsvc.cli.demo import as_rows, run_demo

    configure_logging("warning")
    results = run_demo(steps=steps, lr=lr, png=png, log=None if json_out else err.print)
    if json_out:
        print(json.dumps(results, indent=2))
        return
    table = Table("mode", "first change (step)", "lag max", "lag mean", "visibility mean", "churn mean",
                  "final reward")  # fmt: skip
    for row in as_rows(results):
        table.add_row(*row)
    out.print(table)


@app.command()
def bench(
    size_mib: Annotated[int, typer.Option(help="fp32 model size in MiB.")] = 1024,
    repeat: Annotated[int, typer.Option(help="Runs per figure; the best is kept.")] = 5,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object keyed by figure id.")] = False,
    soak: Annotated[
        float | None,
        typer.Option(help="Instead: SECONDS of one learner pushing and 8 pullers; RSS must stay within 10%."),
    ] = None,
) -> None:
    """Transfer benchmarks (DESIGN §8): T1 pull and T2 push vs raw TCP loopback, M1 server RSS."""
    from weightsvc.cli.bench import run_bench
    from weightsvc.cli.bench import soak as run_soak

    configure_logging("warning")
    if soak is not None:
        result = run_soak(soak, size_mib=min(size_mib, 64), log=None if json_out else err.print)
        print(json.dumps(result, indent=2))
        if not result["ok"]:
            raise typer.Exit(1)
        return
    result = run_bench(size_mib=size_mib, repeat=repeat, log=None if json_out else err.print)
    report = result.pop("report")
    if json_out:
        print(json.dumps(result, indent=2))
        return
    table = Table("id", "figure", "value", "target")
    for key, row in report.items():
        table.add_row(key, row["what"], row["value"], row["target"])
    out.print(table)


def main() -> None:
    # gRPC's C core may print its own log lines (a refused connection, say) on stderr; a client
    # command reports errors itself, in one line. The server keeps gRPC's errors.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR" if sys.argv[1:2] == ["serve"] else "NONE")
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
