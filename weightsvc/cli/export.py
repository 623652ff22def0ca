"""`weightsvc export`: Fair Cast a checkpoint offline. Its help names the choices of
`weightsvc.rounding` itself, so it lists every format there is; the command is built only when asked
for, as `serve` is (the rounding package loads numpy)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import typer

from weightsvc.cli._common import fail, say
from weightsvc.cli.files import read_file_header
from weightsvc.rounding import FORMATS, ROUNDINGS, SCALINGS


def _one_of(choices: Iterable[str]) -> str:
    *first, last = choices
    return f"{', '.join(first)} or {last}"


def export(
    input: Annotated[Path, typer.Argument(help="fp32 masters (safetensors).")],
    output: Annotated[Path, typer.Argument(help="Where to write the served copy (safetensors).")],
    step: Annotated[int, typer.Option(help="The version the served copy is keyed by.")],
    format: Annotated[str, typer.Option(help=f"{_one_of(FORMATS)}.")] = "bf16",
    rounding: Annotated[str, typer.Option(help=f"{_one_of(ROUNDINGS)}.")] = "sr",
    seed: Annotated[int, typer.Option(help="Seed of the rounding RNG.")] = 0,
    scaling: Annotated[str, typer.Option(help=f"fp8 scales: {_one_of(SCALINGS)}.")] = "block",
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


def click_command() -> Any:
    """The `export` command (the command group asks for it by name)."""
    one = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    one.command("export")(export)
    return typer.main.get_command(one)
