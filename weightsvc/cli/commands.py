"""`weightsvc push`, `pull`, `demo` and `bench`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from weightsvc.cli._common import (
    DEFAULT_TARGET,
    CaCert,
    Token,
    fail,
    note,
    one_source,
    print_table,
    progress_bar,
    say,
)
from weightsvc.cli.files import check_base_file, load_masters, read_file_header
from weightsvc.errors import WeightsvcError


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


def pull(
    ctx: typer.Context,
    output: Annotated[Path, typer.Option("-o", "--output", help="Output safetensors file.")],
    model: Annotated[str, typer.Option(help="Model name.")] = "default",
    version: Annotated[str, typer.Option(help="Version number or 'latest'.")] = "latest",
    base: Annotated[
        int | None, typer.Option(help="Delta pull: OUTPUT holds this version; fetch only what changed.")
    ] = None,
    target: Annotated[str, typer.Option(envvar="WEIGHTSVC_TARGET", help="gRPC HOST:PORT.")] = DEFAULT_TARGET,
    url: Annotated[str | None, typer.Option(
        help="HTTP base URL, e.g. http://HOST:8080, or an object store, s3://BUCKET/PREFIX (instead of --target)."
    )] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    token: Token = None,
    ca_cert: CaCert = None,
) -> None:
    """Pull a served version into a safetensors file (checksums verified)."""
    one_source(ctx, url)
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
    from weightsvc.cli.bench import PARTS

    figures = None if only is None else {x.strip() for x in only.split(",")}
    unknown = sorted((figures or set()) - set(PARTS))
    if unknown:
        raise typer.BadParameter(f"unknown figure(s) {', '.join(unknown)}; known: {', '.join(PARTS)}",
                                 param_hint="--only")
    counts = _ints("--s1-tensors", s1_tensors)
    if len(set(counts)) < 2:
        raise typer.BadParameter("give two different counts at least: S1 is a slope", param_hint="--s1-tensors")
    # the parts load torch and the clients: only once the flags are known to be good
    from weightsvc._log import configure_logging
    from weightsvc.cli.bench.run import run_bench
    from weightsvc.cli.bench.soak import soak as run_soak

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
