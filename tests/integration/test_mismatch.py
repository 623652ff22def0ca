"""The trainer-rollout mismatch learners report, against real services: reports over gRPC and HTTP add up
per version, token-weighted; the version listing (both transports), `weightsvc status` and /metrics
show it; bad reports name what was wrong and record nothing; replicas on one Redis share the records."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import torch
from typer.testing import CliRunner

from tests.conftest import make_masters, serving, target
from tests.helpers import REDIS_URL, PrivateRedis, http_get, needs_redis
from weightsvc import InferenceClient, LearnerClient
from weightsvc.cli.main import app
from weightsvc.client import RolloutMismatch, rollout_mismatch
from weightsvc.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from weightsvc.protocol.mismatch import MAX_TOKENS
from weightsvc.server.server import BackgroundServer
from weightsvc.v1 import weightsvc_pb2 as pb
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc

FIELDS = ("tokens", "mean_abs_logp_delta", "k3_kl", "outside_band")


@pytest.fixture(scope="module")
def srv() -> Iterator[BackgroundServer]:
    with serving(retain=2) as s:
        yield s


def post(url: str, path: str, body: object) -> tuple[int, dict[str, Any]]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    answer = json.loads(resp.read())
    conn.close()
    return resp.status, answer


def listed(target: str, model: str) -> dict[int, tuple[RolloutMismatch | None, int | None]]:
    with InferenceClient(target) as client:
        return {v.version: (v.mismatch, v.mismatch_step) for v in client.versions(model)}


def same(a: RolloutMismatch, b: RolloutMismatch) -> None:
    assert a.tokens == b.tokens
    for field in FIELDS[1:]:
        assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-12), field


def test_reports_add_up_and_show_everywhere(srv: BackgroundServer, model: str) -> None:
    learner = LearnerClient(srv.grpc_target)
    for step in (1, 2):
        learner.push(step, make_masters(seed=step), model=model, rounding="rtn" if step == 1 else "sr")
    gen = torch.Generator().manual_seed(0)
    engine = torch.log(torch.rand(4, 64, generator=gen))
    learner_lp = engine + 0.05 * torch.randn(4, 64, generator=gen)
    versions = torch.tensor([1, 2]).repeat_interleave(128).reshape(4, 64)  # a request paused across the update
    mask = torch.rand(4, 64, generator=gen) > 0.1
    first = rollout_mismatch(learner_lp[:2], engine[:2], versions[:2], mask=mask[:2])  # version 1, one batch
    second = rollout_mismatch(learner_lp, engine, versions, mask=mask)  # both versions, the next batch
    assert first.keys() == {1} and second.keys() == {1, 2}

    assert learner.report_mismatch(model, first, step=10)[1] == first[1]
    status, answer = post(srv.http_url, f"/v1/models/{model}/mismatch",
                          {"versions": {str(v): m.as_dict() for v, m in second.items()}, "step": 11})
    assert status == 200, answer
    whole = first[1] + second[1]
    same(RolloutMismatch(**answer["versions"]["1"]), whole)
    for to in (srv.grpc_target, srv.http_url):
        shown = listed(to, model)
        assert shown.keys() == {1, 2}
        same(shown[1][0] or whole, whole)
        assert shown[1][0] is not None and shown[1][1] == 11
        assert shown[2][0] == second[2] and shown[2][1] == 11

    report = CliRunner().invoke(app, ["status", "--target", srv.grpc_target, "--model", model, "--json"])
    assert report.exit_code == 0, report.output
    (shown_model,) = json.loads(report.output)["models"]
    by_version = {v["version"]: v for v in shown_model["versions"]}
    assert by_version[2]["mismatch"] == second[2].as_dict() and by_version[2]["mismatch_step"] == 11
    table = CliRunner().invoke(app, ["status", "--target", srv.http_url, "--model", model])
    assert table.exit_code == 0, table.output
    row = next(line for line in table.output.splitlines() if "2 (latest)" in line)
    assert f"{second[2].tokens:,}" in row and f"{second[2].k3_kl:.2e}" in row

    metrics = http_get(srv.http_url, "/metrics")[2].decode()

    def sample(name: str, rounding: str) -> float:
        line = re.search(rf'^{name}\{{format="bf16",model="{model}",rounding="{rounding}"\}} (\S+)$', metrics, re.M)
        assert line, name
        return float(line.group(1))

    assert sample("weightsvc_rollout_mismatch_tokens_total", "rtn") == whole.tokens
    assert sample("weightsvc_rollout_mismatch_tokens_total", "sr") == second[2].tokens
    assert sample("weightsvc_rollout_mismatch_k3_kl_sum_total", "rtn") == pytest.approx(whole.k3_kl * whole.tokens)
    assert sample("weightsvc_rollout_mismatch_outside_band_tokens_total", "sr") == pytest.approx(
        second[2].outside_band * second[2].tokens)
    assert sample("weightsvc_rollout_mismatch_k3_kl", "sr") == pytest.approx(second[2].k3_kl)
    assert sample("weightsvc_rollout_mismatch_abs_logp_delta", "sr") == pytest.approx(second[2].mean_abs_logp_delta)
    assert not re.search(r'weightsvc_rollout_mismatch_k3_kl\{[^}]*rounding="rtn"', metrics)  # the latest export's
    assert "version=" not in "".join(ln for ln in metrics.splitlines() if "rollout_mismatch" in ln)


def _raw_report(target: str, request: pb.ReportMismatchRequest) -> grpc.RpcError:
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.WeightServiceStub(channel).ReportMismatch(request)
    return info.value  # type: ignore[return-value]


GOOD = {"tokens": 5, "mean_abs_logp_delta": 0.1, "k3_kl": 0.01, "outside_band": 0.2}
BAD_VALUES = [
    ({"tokens": 0}, "tokens must be > 0"),
    ({"tokens": -3}, "tokens must be > 0"),
    ({"k3_kl": float("nan")}, "k3_kl must be finite and >= 0, not nan"),
    ({"mean_abs_logp_delta": float("inf")}, "mean_abs_logp_delta must be finite and >= 0, not inf"),
    ({"k3_kl": -0.5}, "k3_kl must be finite and >= 0, not -0.5"),
    ({"outside_band": 1.5}, "outside_band is a share of tokens"),
]


@pytest.mark.parametrize(("change", "words"), BAD_VALUES)
def test_a_bad_value_is_refused_and_nothing_recorded(srv: BackgroundServer, model: str, change: dict[str, float],
                                                     words: str) -> None:
    learner = LearnerClient(srv.grpc_target)
    learner.push(1, make_masters(), model=model)
    learner.push(2, make_masters(seed=2), model=model)
    bad = {**GOOD, **change}
    # gRPC: version 1 fine, version 2 bad -> neither recorded
    versions = {1: pb.RolloutMismatch(**GOOD), 2: pb.RolloutMismatch(**bad)}
    request = pb.ReportMismatchRequest(model=model, versions=versions)
    e = _raw_report(srv.grpc_target, request)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"model {model!r} version 2: {words}" in (e.details() or ""), e.details()
    # HTTP: the same, 400 (JSON has no NaN or Infinity: those go as the non-standard literals Python writes)
    status, answer = post(srv.http_url, f"/v1/models/{model}/mismatch", {"versions": {"1": GOOD, "2": bad}})
    assert status == 400, answer
    assert answer["error"]["code"] == "INVALID_ARGUMENT" and model in answer["error"]["message"], answer
    if "tokens" in change or change.get("k3_kl") == -0.5 or "outside_band" in change:
        assert f"version 2: {words}" in answer["error"]["message"], answer
    assert listed(srv.grpc_target, model) == {1: (None, None), 2: (None, None)}


# Reports past the bounds. Each answered 500, or was stored and from then on failed every listing of the
# model and every later report of the version (a sum overflowed to inf; tokens past int64) until it retired.
BEYOND = [
    ({"1": {**GOOD, "tokens": 10, "k3_kl": 1e308}}, "version 1: k3_kl must be at most 1e+100, not 1e+308"),
    ({"1": {**GOOD, "mean_abs_logp_delta": 1e300}}, "version 1: mean_abs_logp_delta must be at most 1e+100"),
    ({"1": {**GOOD, "tokens": 10**30}}, f"version 1: tokens must be at most {MAX_TOKENS}, not {10**30}"),
    ({"1": {**GOOD, "tokens": 2**63 - 1}}, f"version 1: tokens must be at most {MAX_TOKENS}"),
    ({"1": {**GOOD, "tokens": 10**400}}, "tokens must be at most 9007199254740991, not 10000000000000000000... "
                                         "(401 digits)"),
    ({"1" * 5000: GOOD}, "version 11111111111111111111... (5000 digits) is outside [0, "),
]


@pytest.mark.parametrize("registry", ["memory", pytest.param("redis", marks=needs_redis)])
def test_a_report_past_the_bounds_is_refused_and_the_model_stays_listable(registry: str, redis_prefix: str,
                                                                           model: str) -> None:
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix} if registry == "redis" else {}
    with serving(**shared) as srv:
        LearnerClient(srv.grpc_target).push(1, make_masters(), model=model)
        for versions, words in BEYOND:
            status, answer = post(srv.http_url, f"/v1/models/{model}/mismatch", {"versions": versions})
            assert (status, answer["error"]["code"]) == (400, "INVALID_ARGUMENT"), answer
            assert f"model {model!r}" in answer["error"]["message"] and words in answer["error"]["message"], answer
        for bad in ({"k3_kl": 1e308, "tokens": 10}, {"tokens": 2**63 - 1}):
            e = _raw_report(srv.grpc_target, pb.ReportMismatchRequest(
                model=model, versions={1: pb.RolloutMismatch(**{**GOOD, **bad})}))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
            assert f"model {model!r} version 1: " in (e.details() or ""), e.details()
        good = RolloutMismatch(**GOOD)  # type: ignore[arg-type]
        assert LearnerClient(srv.grpc_target).report_mismatch(model, {1: good}, step=3) == {1: good}
        for to in (srv.grpc_target, srv.http_url):
            assert listed(to, model) == {1: (good, 3)}
        report = CliRunner().invoke(app, ["status", "--target", srv.http_url, "--model", model, "--json"])
        assert report.exit_code == 0, report.output
        assert json.loads(report.output)["models"][0]["versions"][0]["mismatch"] == good.as_dict()


@needs_redis
def test_totals_recorded_past_the_bounds_before_they_were_refused_leave_the_listing_whole(
        redis_prefix: str, model: str) -> None:
    """A registry may hold totals an earlier server recorded past what a record holds: that version is
    listed without them, the others with theirs."""
    with serving(redis_url=REDIS_URL, redis_prefix=redis_prefix) as srv:
        learner = LearnerClient(srv.grpc_target)
        for step in (1, 2):
            learner.push(step, make_masters(seed=step), model=model)
        good = RolloutMismatch(**GOOD)  # type: ignore[arg-type]
        learner.report_mismatch(model, {2: good})
        redis.Redis.from_url(REDIS_URL).hset(f"{redis_prefix}:{{{model}}}:mismatch",
                                             mapping={"1:tokens": 2**63 - 1, "1:k3": 1.0})
        for to in (srv.grpc_target, srv.http_url):
            assert listed(to, model) == {1: (None, None), 2: (good, None)}
        with pytest.raises(FailedPrecondition, match=r"would take the mismatch totals of version\(s\) \[1\] past"):
            learner.report_mismatch(model, {1: good, 2: good})
        assert listed(srv.http_url, model)[2] == (good, None)


def test_unknown_model_and_versions_not_retained(srv: BackgroundServer, model: str, push_transport: str) -> None:
    learner = LearnerClient(target(srv, push_transport))
    one = {7: RolloutMismatch(**GOOD)}  # type: ignore[arg-type]
    with pytest.raises(NotFound, match=rf"NOT_FOUND: unknown model '{model}'"):
        learner.report_mismatch(model, one)
    status, answer = post(srv.http_url, f"/v1/models/{model}/mismatch", {"versions": {"7": GOOD}})
    assert (status, answer["error"]["code"]) == (404, "NOT_FOUND") and model in answer["error"]["message"]
    for step in (1, 2, 3):  # retain=2: version 1 is retired
        learner.push(step, make_masters(seed=step), model=model)
    for version in (1, 9):  # retired; never committed
        report = {2: RolloutMismatch(**GOOD), version: RolloutMismatch(**GOOD)}  # type: ignore[arg-type]
        with pytest.raises(NotFound, match=rf"model '{model}': version\(s\) \[{version}\] not retained "
                                           r"\(retired, or never committed; retained: \[2, 3\]\); nothing"):
            learner.report_mismatch(model, report, step=4)
        status, answer = post(srv.http_url, f"/v1/models/{model}/mismatch",
                              {"versions": {"2": GOOD, str(version): GOOD}})
        assert status == 404 and f"[{version}] not retained" in answer["error"]["message"], answer
    assert listed(srv.grpc_target, model) == {2: (None, None), 3: (None, None)}


@pytest.mark.parametrize(("body", "words"), [
    ({"versions": {}}, "names no version"),
    ({"versions": {"seven": GOOD}}, "version 'seven' is not a version number"),
    ({"versions": {"-1": GOOD}}, "version '-1' is not a version number"),
    ({"versions": {"1": {"tokens": 3}}}, "version 1: missing ['mean_abs_logp_delta', 'k3_kl', 'outside_band']"),
    ({"versions": {"1": {**GOOD, "kl": 0.1}}}, "version 1: unknown fields ['kl']"),
    ({"versions": {"1": {**GOOD, "tokens": 2.5}}}, "version 1: tokens must be an integer"),
    ({"versions": {"1": {**GOOD, "k3_kl": "0.1"}}}, "version 1: k3_kl must be a number"),
    ({"versions": {"1": GOOD}, "step": "soon"}, "step"),
    (b"{not json", "the mismatch report of model"),
])
def test_http_malformed_reports(srv: BackgroundServer, model: str, body: object, words: str) -> None:
    LearnerClient(srv.grpc_target).push(1, make_masters(), model=model)
    status, answer = post(srv.http_url, f"/v1/models/{model}/mismatch", body)
    assert (status, answer["error"]["code"]) == (400, "INVALID_ARGUMENT"), answer
    assert words in answer["error"]["message"], answer
    assert listed(srv.http_url, model) == {1: (None, None)}


def test_client_refuses_what_is_not_a_report(srv: BackgroundServer) -> None:
    with pytest.raises(TypeError, match="version 1: report a RolloutMismatch, not a dict"):
        LearnerClient(srv.grpc_target).report_mismatch("m", {1: GOOD})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgument, match="the report names no version"):
        LearnerClient(srv.grpc_target).report_mismatch("m", {})


@needs_redis
def test_replicas_on_one_redis_share_the_records(redis_prefix: str, model: str) -> None:
    """A learner reports to whichever replica it reaches; every replica lists the same totals."""
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix}
    with serving(**shared, replica_id="r0") as r0, serving(**shared, replica_id="r1") as r1:
        LearnerClient(r0.grpc_target).push(1, make_masters(), model=model)
        with InferenceClient(r1.grpc_target) as follower:
            assert next(iter(follower.watch(model))).version == 1  # r1 holds it too
        a, b = RolloutMismatch(10, 0.1, 0.01, 0.0), RolloutMismatch(30, 0.3, 0.05, 0.5)
        LearnerClient(r0.grpc_target).report_mismatch(model, {1: a}, step=1)
        status, answer = post(r1.http_url, f"/v1/models/{model}/mismatch", {"versions": {"1": b.as_dict()}, "step": 2})
        assert status == 200, answer
        for srv in (r0, r1):
            for target in (srv.grpc_target, srv.http_url):
                ((m, step),) = listed(target, model).values()
                assert m is not None and step == 2
                same(m, a + b)


@pytest.mark.parametrize("registry", ["memory", pytest.param("redis", marks=needs_redis)])
def test_a_report_with_another_band_than_its_version_had_is_refused(registry: str, redis_prefix: str,
                                                                     model: str) -> None:
    """Shares of tokens outside two different bands do not add up: the version keeps its first band."""
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix} if registry == "redis" else {}
    with serving(**shared) as srv:
        learner = LearnerClient(srv.grpc_target)
        for step in (1, 2):
            learner.push(step, make_masters(seed=step), model=model)
        wide = RolloutMismatch(10, 0.1, 0.01, 0.1, band=(0.2, 5.0))
        learner.report_mismatch(model, {1: wide})
        with pytest.raises(FailedPrecondition, match=rf"model '{model}': the report's IcePop band differs from the "
                                                     r"version's \(version 1: reported with \[0.2, 5.0\], this "
                                                     r"report \[0.5, 2.0\]\)"):
            learner.report_mismatch(model, {1: RolloutMismatch(10, 0.1, 0.01, 0.3),
                                            2: RolloutMismatch(5, 0.1, 0.01, 0.0)})
        status, answer = post(srv.http_url, f"/v1/models/{model}/mismatch",
                              {"versions": {"1": {**wide.as_dict(), "band": [0.5, 2.0]}, "2": wide.as_dict()}})
        assert (status, answer["error"]["code"]) == (409, "FAILED_PRECONDITION"), answer
        assert "version 1: reported with [0.2, 5.0], this report [0.5, 2.0]" in answer["error"]["message"]
        assert listed(srv.grpc_target, model) == {1: (wide, None), 2: (None, None)}  # nothing of either report
        learner.report_mismatch(model, {1: wide, 2: wide})  # its own band still adds up
        assert listed(srv.http_url, model)[1][0] == wide + wide


def test_without_its_registry_a_report_is_refused_and_the_listing_goes_on(tmp_path: Path, model: str) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server on PATH: the test starts and kills a Redis of its own")
    private = PrivateRedis(tmp_path, persist=False)
    private.start()
    try:
        with serving(redis_url=private.url) as srv:
            LearnerClient(srv.grpc_target).push(1, make_masters(), model=model)
            private.kill()
            with pytest.raises(Unavailable, match=rf"UNAVAILABLE: registry {private.url} unreachable while "
                                                  rf"recording the mismatch of model '{model}'"):
                LearnerClient(srv.grpc_target).report_mismatch(model, {1: RolloutMismatch(4, 0.1, 0.01, 0.0)})
            assert listed(srv.http_url, model) == {1: (None, None)}  # served from what the replica holds
    finally:
        if private.proc is not None and private.proc.poll() is None:
            private.kill()
