"""`weightsvc status`: the models, their versions with lag metrics and the trainer-rollout mismatch
learners reported, the inference clients, and the files the server set aside as damaged."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from weightsvc.cli._common import DEFAULT_TARGET, CaCert, Token, fail, note, print_table, say
from weightsvc.errors import DeadlineExceeded, WeightsvcError


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
                     "lag (steps)", "visibility", "churn", "rel. error", "tokens", "k3 KL", "|Δlogp|",
                     "out of band", title="versions")
    for m in report:
        for i, v in enumerate(m["versions"]):
            latest = " (latest)" if v["version"] == m["latest_version"] else ""
            lag = v["lag"] or {}
            visibility = lag.get("update_visibility")
            mismatch = v.get("mismatch")  # reported by learners (`LearnerClient.report_mismatch`)
            versions.add_row(
                m["model"] if i == 0 else "", f"{v['version']}{latest}", v["format"], v["rounding"],
                str(v["tensor_count"]), f"{v['data_bytes']:,}", _when(v["committed_unix"]),
                str(lag.get("lag_steps", "-")), "-" if visibility is None else f"{visibility:.2f}",
                f"{lag['churn']:.3f}" if lag else "-", f"{lag['relative_error']:.2e}" if lag else "-",
                *((f"{mismatch['tokens']:,}", f"{mismatch['k3_kl']:.2e}", f"{mismatch['mean_abs_logp_delta']:.2e}",
                   f"{mismatch['outside_band']:.2%}") if mismatch else ("-",) * 4),
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
