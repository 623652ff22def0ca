"""The `vllm` overlay: vLLM inference pods following weightsvc with `weightsvc follow` as a sidecar.
It renders, validates strictly, and its pieces fit each other and the code: the sidecar's flags are
the command's, it reaches the engine and the relays where they listen, the engine selects
weightsvc's backend, the pod's readiness is the sidecar's /ready, and its metrics are scraped."""

from __future__ import annotations

import json
from typing import Any

import pytest
import typer

from tests.integration.test_deploy_k8s import by_kind, kubectl, render, selects
from weightsvc import Settings
from weightsvc.cli.main import app
from weightsvc.integrations.vllm.plugin import BACKEND

pytestmark = pytest.mark.skipif(kubectl is None, reason="needs kubectl on PATH to render the kustomize overlays")


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render("vllm")


def flags(args: list[str]) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in args if a.startswith("--") and "=" in a)


def test_every_object_validates_strictly(docs: list[dict[str, Any]]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (the dev extra)")
    for doc in docs:
        if doc["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(doc, "1.30", strict=True)


def test_the_sidecar_follows_its_engine_from_the_relays(docs: list[dict[str, Any]]) -> None:
    pod = by_kind(docs, "Deployment")["vllm"]["spec"]["template"]
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    engine, follow = containers["vllm"], containers["follow"]
    # The engine: weightsvc's backend, the RL routes, the generate route that carries weight versions.
    assert json.loads(flags(engine["args"])["weight-transfer-config"]) == {"backend": BACKEND}
    assert "--enable-scale-out" in engine["args"]
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in engine["env"]
    engine_port = {p["name"]: p["containerPort"] for p in engine["ports"]}["http"]
    assert flags(engine["args"])["port"] == str(engine_port)
    # The sidecar's flags are those of `weightsvc follow` (parsed by the command itself).
    assert follow["args"][0] == "follow"
    command = typer.main.get_command(app).get_command(None, "follow")  # type: ignore[attr-defined, arg-type]
    command.make_context("follow", list(follow["args"][1:]), resilient_parsing=False)
    args = flags(follow["args"])
    assert args["engine"] == f"http://127.0.0.1:{engine_port}"  # the engine of its own pod
    relay, port = args["target"].split(":")
    relays = by_kind(docs, "Service")[relay]
    assert int(port) == Settings().grpc_port in {p["port"] for p in relays["spec"]["ports"]}
    # Ready = the engine serves the latest version within --max-lag: the sidecar's /ready.
    follower_port = {p["name"]: p["containerPort"] for p in follow["ports"]}["follower"]
    assert args["listen"] == f"0.0.0.0:{follower_port}"  # the kubelet and Prometheus reach it
    assert follow["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "follower"}
    assert int(args["max-lag"]) >= 0
    # weightsvc's NetworkPolicy lets the pods in as clients.
    policy = by_kind(docs, "NetworkPolicy")["weightsvc"]
    clients = [peer["podSelector"]["matchLabels"] for rule in policy["spec"]["ingress"] for peer in rule["from"]
               if "podSelector" in peer]
    assert any(selects(c, pod["metadata"]["labels"]) for c in clients)


def test_the_sidecars_metrics_are_scraped(docs: list[dict[str, Any]]) -> None:
    pod = by_kind(docs, "Deployment")["vllm"]["spec"]["template"]
    monitor = by_kind(docs, "ServiceMonitor")["vllm-follower"]
    (service,) = [s for s in by_kind(docs, "Service").values()
                  if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))]
    assert selects(service["spec"]["selector"], pod["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert port["targetPort"] == "follower"
