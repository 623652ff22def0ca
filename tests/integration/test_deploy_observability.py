"""The alert rules and the dashboard refer to metrics the service really exports; promtool agrees."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import serving
from tests.helpers import http_get
from weightsvc import InferenceClient, LearnerClient
from weightsvc.client import RolloutMismatch

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "weightsvc-alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "weightsvc-dashboard.json"


def exported_metrics_text() -> str:
    with serving() as srv:
        LearnerClient(srv.grpc_target).push(1, {"w": torch.randn(64, 64) * 0.02})
        LearnerClient(srv.grpc_target).push(2, {"w": torch.randn(64, 64) * 0.02})
        InferenceClient(srv.grpc_target).ack("default", 1, "pod")
        InferenceClient(srv.http_url).pull()
        LearnerClient(srv.grpc_target).report_mismatch("default", {2: RolloutMismatch(8, 0.01, 1e-4, 0.0)})
        return http_get(srv.http_url, "/metrics")[2].decode()


def referenced_names(text: str) -> set[str]:
    return set(re.findall(r"\bweightsvc_[a-z0-9_]+", text))


def test_rules_and_dashboard_use_exported_metrics() -> None:
    from weightsvc.metrics import FollowerMetrics

    exported = exported_metrics_text() + FollowerMetrics().render().decode()  # the server's and `follow`'s
    names = {line.split("{")[0].split(" ")[0] for line in exported.splitlines() if line.startswith("weightsvc_")}
    used = referenced_names(RULES.read_text()) | referenced_names(DASHBOARD.read_text())
    assert used, "nothing referenced"
    assert used <= names, f"not exported: {sorted(used - names)}"
    dashboard = json.loads(DASHBOARD.read_text())
    assert len(dashboard["panels"]) >= 10


@pytest.fixture
def promtool() -> str:
    """promtool's path. CI installs it (scripts/setup.sh) and sets WEIGHTSVC_REQUIRE_PROMTOOL=1: there a
    missing promtool fails the run instead of skipping every alert's test."""
    found = shutil.which("promtool")
    if found is None:
        message = "needs promtool on PATH (Debian package prometheus)"
        if os.environ.get("WEIGHTSVC_REQUIRE_PROMTOOL") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found


def test_promtool_accepts_rules_and_metrics(promtool: str) -> None:
    rules = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    metrics = subprocess.run([promtool, "check", "metrics"], input=exported_metrics_text(), capture_output=True,
                             text=True)
    assert metrics.returncode == 0, metrics.stdout + metrics.stderr


def test_alert_rules_pass_their_unit_tests(promtool: str) -> None:
    """`weightsvc-alerts.test.yml`: each alert tested fires when, and as often as, its summary says."""
    tests = RULES.with_name("weightsvc-alerts.test.yml")
    result = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    tested = {t["alertname"] for case in yaml.safe_load(tests.read_text())["tests"] for t in case["alert_rule_test"]}
    assert alerts == tested, f"alerts without a test: {sorted(alerts - tested)}"
