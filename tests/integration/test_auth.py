"""Auth tokens with roles on every gRPC method and HTTP route, and TLS with a certificate made here."""

from __future__ import annotations

import http.client
import json
import logging
import re
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import make_masters, serving
from weightsvc import InferenceClient, LearnerClient
from weightsvc.client._nixl_publish import published
from weightsvc.errors import PermissionDenied, Unauthenticated, Unavailable
from weightsvc.protocol.published import publish_to_dict, publish_to_proto
from weightsvc.rounding import ExportSpec
from weightsvc.server.server import BackgroundServer
from weightsvc.transport.http import create_app
from weightsvc.v1 import weightsvc_pb2 as pb
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc

TOKENS = {"pull": "pull-secret-1", "push": "push-secret-2", "admin": "admin-secret-3"}
MODEL = "authed"
PUBLISHED = "authed-published"  # (a model of its own: its versions do not push MODEL's out of retention)


@pytest.fixture(scope="module")
def authed() -> Iterator[BackgroundServer]:
    with serving(nixl=True, **{f"{role}_tokens": token for role, token in TOKENS.items()}) as srv:
        learner = LearnerClient(srv.grpc_target, token=TOKENS["push"])
        for step in (1, 2):  # the same masters, rounded to nearest: a delta from 1 to 2 changes nothing
            learner.push(step, make_masters(), model=MODEL, rounding="rtn")
        yield srv


def _metadata(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


def _push_requests(step: int) -> Iterator[pb.PushRequest]:
    spec = pb.TensorSpec(name="w", shape=[4], dtype="F32")
    yield pb.PushRequest(header=pb.PushHeader(model=MODEL, step=step, tensors=[spec]))
    yield pb.PushRequest(chunk=pb.Chunk(tensor="w", offset=0, data=torch.ones(4).numpy().tobytes()))
    yield pb.PushRequest(commit=pb.PushCommit())


def _latest(stub: pb_grpc.WeightServiceStub) -> int:
    """The latest version, asked with the admin's token (the pushes of these tests move it)."""
    versions = stub.ListVersions(pb.ListVersionsRequest(model=MODEL), metadata=_metadata(TOKENS["admin"])).versions
    return int(versions[-1].version)


def _report(version: int) -> pb.ReportMismatchRequest:
    m = pb.RolloutMismatch(tokens=8, mean_abs_logp_delta=0.01, k3_kl=1e-4, outside_band=0.0)
    return pb.ReportMismatchRequest(model=MODEL, versions={version: m})


def _lease(stub: pb_grpc.WeightServiceStub) -> pb.VersionLease:
    return stub.LeaseVersion(pb.LeaseVersionRequest(model=MODEL), metadata=_metadata(TOKENS["admin"]))


def _release(stub: pb_grpc.WeightServiceStub, lease: pb.VersionLease) -> None:
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.lease_id), metadata=_metadata(TOKENS["admin"]))


def _publish(stub: pb_grpc.WeightServiceStub, md: list[tuple[str, str]]) -> pb.PushResponse:
    """A publish of a version of one tensor (its memory registered while the call lasts)."""
    w = torch.ones(4, dtype=torch.bfloat16)
    with published({"w": (w, 0, None)}, model=PUBLISHED, step=next(_steps), rank=0, world_size=1, spec=ExportSpec(),
                   master_digest="", aliases={}) as request:
        return stub.Publish(publish_to_proto(request), metadata=md)


_steps = iter(range(100, 10_000))
CALLS: dict[str, Callable[[pb_grpc.WeightServiceStub, list[tuple[str, str]]], Any]] = {
    "ListModels": lambda s, md: s.ListModels(pb.ListModelsRequest(), metadata=md),
    "ListVersions": lambda s, md: s.ListVersions(pb.ListVersionsRequest(model=MODEL), metadata=md),
    "GetManifest": lambda s, md: s.GetManifest(pb.GetManifestRequest(model=MODEL), metadata=md),
    "Pull": lambda s, md: next(iter(s.Pull(pb.PullRequest(model=MODEL), metadata=md))),
    "Watch": lambda s, md: next(iter(s.Watch(pb.WatchRequest(model=MODEL), metadata=md))),
    "Ack": lambda s, md: s.Ack(pb.AckRequest(model=MODEL, version=1, client_id=f"c-{md}"), metadata=md),  # one a token
    "Push": lambda s, md: s.Push(_push_requests(next(_steps)), metadata=md),
    "GetTopology": lambda s, md: s.GetTopology(pb.GetTopologyRequest(), metadata=md),
    "ListClients": lambda s, md: s.ListClients(pb.ListClientsRequest(model=MODEL), metadata=md),
    "ReportMismatch": lambda s, md: s.ReportMismatch(_report(_latest(s)), metadata=md),
    # (each lease released: the one taken with the admin's token, or the one the caller took)
    "LeaseVersion": lambda s, md: _release(s, s.LeaseVersion(pb.LeaseVersionRequest(model=MODEL), metadata=md)),
    "ReleaseLease": lambda s, md: s.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=_lease(s).lease_id), metadata=md),
    "Publish": _publish,
}
# What each credential may do: None = nothing; the roles nest (pull < push < admin).
ALLOWED = {
    None: set(),
    "not-a-token": set(),
    "pull": set(CALLS) - {"Push", "ReportMismatch", "Publish"},
    "push": set(CALLS),
    "admin": set(CALLS),
}


def test_the_grpc_service_covers_every_method() -> None:
    assert set(CALLS) == {m.name for m in pb.DESCRIPTOR.services_by_name["WeightService"].methods}


@pytest.mark.parametrize("method", sorted(CALLS))
@pytest.mark.parametrize("who", [None, "not-a-token", "pull", "push", "admin"])
def test_every_grpc_method_checks_the_token_role(authed: BackgroundServer, method: str, who: str | None) -> None:
    token = TOKENS.get(who or "", who)
    with grpc.insecure_channel(authed.grpc_target) as channel:
        stub = pb_grpc.WeightServiceStub(channel)
        try:
            CALLS[method](stub, _metadata(token))
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
    if method in ALLOWED[who]:
        assert code == grpc.StatusCode.OK, code
    elif who in ("pull",):
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert details == f"{method} needs role push; this token has role pull"
    else:
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert method in details and (who is None or "not valid" in details)


def test_grpc_health_stays_open(authed: BackgroundServer) -> None:
    with grpc.insecure_channel(authed.grpc_target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _routes(srv: BackgroundServer) -> list[str]:
    app = create_app(srv.service)
    paths = sorted({r.path for r in app.routes if "GET" in getattr(r, "methods", set())})  # type: ignore[attr-defined]
    routes = [p.replace("{model}", MODEL).replace("{version}", "1") for p in paths]
    return [p.replace("/1/delta", "/2/delta?base=1") for p in routes]


def _get(
    url: str, path: str, token: str | None, method: str = "GET", body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **headers} if body else headers)
    resp = conn.getresponse()
    streamed = (resp.getheader("content-type") or "").startswith("text/event-stream")
    body = b"" if streamed else resp.read()  # an event stream goes on: its answer is enough
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body


def test_every_http_route_checks_the_token_and_probes_stay_open(authed: BackgroundServer) -> None:
    routes = _routes(authed)
    assert {
        "/healthz",
        "/readyz",
        "/metrics",
        f"/v1/models/{MODEL}/versions/1/safetensors",
        f"/v1/models/{MODEL}/versions/2/delta?base=1",
        f"/v1/models/{MODEL}/watch",
    } <= set(routes)
    for path in routes:
        if path in ("/healthz", "/readyz", "/metrics"):
            assert _get(authed.http_url, path, None)[0] == 200, path
            continue
        status, headers, body = _get(authed.http_url, path, None)
        assert (status, headers.get("www-authenticate")) == (401, 'Bearer realm="weightsvc"'), path
        assert b'"UNAUTHENTICATED"' in body and b"needs a bearer token" in body
        assert _get(authed.http_url, path, "not-a-token")[0] == 401, path
        for role in ("pull", "push", "admin"):
            assert _get(authed.http_url, path, TOKENS[role])[0] == 200, (path, role)


def test_http_ack_needs_role_pull(authed: BackgroundServer) -> None:
    path = f"/v1/models/{MODEL}/acks"
    for token, status in [(None, 401), ("not-a-token", 401), *((TOKENS[role], 200) for role in TOKENS)]:
        ack = json.dumps({"version": 1, "client_id": f"pod-{token}"}).encode()  # a client id of each token's own
        got, _, body = _get(authed.http_url, path, token, "POST", ack)
        assert got == status, (token, body)
    assert json.loads(body) == {"latest_version": authed.service.index.get(MODEL, None).manifest.version}


def test_http_leases_need_role_pull(authed: BackgroundServer) -> None:
    path = f"/v1/models/{MODEL}/versions/latest/lease"
    for token, status in [(None, 401), ("not-a-token", 401), *((TOKENS[role], 200) for role in TOKENS)]:
        got, _, body = _get(authed.http_url, path, token, "POST", b"{}")
        assert got == status, (token, body)
        if got == 200:
            release = f"/v1/leases/{json.loads(body)['lease_id']}"
            assert _get(authed.http_url, release, None, "DELETE")[0] == 401
            assert _get(authed.http_url, release, token, "DELETE")[0] == 204


def test_http_mismatch_report_needs_role_push(authed: BackgroundServer) -> None:
    path = f"/v1/models/{MODEL}/mismatch"
    version = authed.service.index.latest(MODEL)
    report = json.dumps({"versions": {str(version): {"tokens": 4, "mean_abs_logp_delta": 0.0, "k3_kl": 0.0,
                                                     "outside_band": 0.0}}}).encode()
    for token, status in [(None, 401), ("not-a-token", 401), (TOKENS["pull"], 403), (TOKENS["push"], 200),
                          (TOKENS["admin"], 200)]:
        got, _, body = _get(authed.http_url, path, token, "POST", report)
        assert got == status, (token, body)
    assert b"needs role push; this token has role pull" in _get(authed.http_url, path, TOKENS["pull"], "POST",
                                                                report)[2]


def test_http_publish_needs_role_push(authed: BackgroundServer) -> None:
    w = torch.ones(4, dtype=torch.bfloat16)
    for token, status in [(None, 401), ("not-a-token", 401), (TOKENS["pull"], 403), (TOKENS["push"], 200),
                          (TOKENS["admin"], 200)]:
        step = next(_steps)
        with published({"w": (w, 0, None)}, model=PUBLISHED, step=step, rank=0, world_size=1, spec=ExportSpec(),
                       master_digest="", aliases={}) as request:
            body = json.dumps(publish_to_dict(request)).encode()
            path = f"/v1/models/{PUBLISHED}/versions/{step}/publish"
            got, _, answer = _get(authed.http_url, path, token, "POST", body)
        assert got == status, (token, answer)


def test_clients_carry_tokens_and_get_clear_errors(
    authed: BackgroundServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(PermissionDenied, match=r"PERMISSION_DENIED: Push needs role push; this token has role pull"):
        LearnerClient(authed.grpc_target, token=TOKENS["pull"]).push(20_000, make_masters(), model=MODEL)
    denied = rf"POST /v1/models/{MODEL}/push needs role push; this token has role pull"
    with pytest.raises(PermissionDenied, match=denied):
        LearnerClient(authed.http_url, token=TOKENS["pull"]).push(20_000, make_masters(), model=MODEL)
    with pytest.raises(Unauthenticated, match=r"UNAUTHENTICATED: Pull needs a bearer token"):
        InferenceClient(authed.grpc_target, token="").pull(MODEL)
    with pytest.raises(Unauthenticated, match=r"GET /v1/models needs a bearer token \(role pull or above\)"):
        InferenceClient(authed.http_url, token="").models()
    pusher = LearnerClient(authed.grpc_target, token=TOKENS["push"])
    info = pusher.push(20_000, make_masters(), model=MODEL, return_served=True)
    assert info.served is not None
    monkeypatch.setenv("WEIGHTSVC_TOKEN", TOKENS["pull"])  # the default for clients, as for the CLI
    assert InferenceClient(authed.http_url).pull(MODEL, 20_000).keys() == info.served.keys()
    assert InferenceClient(authed.grpc_target).manifest(MODEL).version == 20_000
    for token in TOKENS.values():  # never logged, never in the settings' repr
        assert token not in caplog.text and token not in repr(authed.server.settings)


# ---- TLS ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl on PATH: it makes the TLS certificates of these tests")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return cert, key


def test_tls_on_grpc_and_http_with_a_self_signed_certificate(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    with serving(tls_cert=cert, tls_key=key, push_tokens=TOKENS["push"]) as srv:
        assert srv.grpc_target.startswith("grpcs://") and srv.http_url.startswith("https://")
        masters = make_masters()
        LearnerClient(srv.grpc_target, ca_cert=cert, token=TOKENS["push"], timeout=30).push(1, masters, model="m")
        over_https = LearnerClient(srv.http_url, ca_cert=cert, token=TOKENS["push"], timeout=30)
        assert over_https.push(1, masters, model="m-https", return_served=True).served is not None
        over_grpc = InferenceClient(srv.grpc_target, ca_cert=cert, token=TOKENS["push"]).pull("m")
        over_http = InferenceClient(srv.http_url, ca_cert=cert, token=TOKENS["push"]).pull("m")
        assert all(torch.equal(over_grpc[n].view(torch.int16), over_http[n].view(torch.int16)) for n in masters)
        # A client that does not trust the certificate, or speaks in clear, gets nowhere.
        with pytest.raises(Unavailable):
            InferenceClient(srv.grpc_target, token=TOKENS["push"], timeout=5).manifest("m")
        with pytest.raises(Unavailable, match=re.escape("CERTIFICATE_VERIFY_FAILED")):
            InferenceClient(srv.http_url, token=TOKENS["push"], timeout=5).manifest("m")
        with pytest.raises(Unavailable):
            InferenceClient(srv.grpc_target.removeprefix("grpcs://"), token=TOKENS["push"], timeout=5).manifest("m")
        stopping = time.monotonic()
    # The HTTPS learner above (`over_https`) still holds its idle connection: the server stops without waiting out
    # asyncio's 30 s for a close_notify they never send (it waited so before).
    assert time.monotonic() - stopping < 15


def test_tls_needs_both_files(certificate: tuple[Path, Path]) -> None:
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        serving(tls_cert=certificate[0])


def test_several_authorization_values_are_refused_not_picked(authed: BackgroundServer) -> None:
    u = urllib.parse.urlsplit(authed.http_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.putrequest("GET", "/v1/models")
    conn.putheader("Authorization", "Bearer not-a-token")
    conn.putheader("Authorization", f"Bearer {TOKENS['pull']}")
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 401 and b"2 authorization values; send one bearer token" in resp.read()
    conn.close()
    with grpc.insecure_channel(authed.grpc_target) as channel:
        metadata = [("authorization", "Bearer not-a-token"), ("authorization", f"Bearer {TOKENS['pull']}")]
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.WeightServiceStub(channel).ListModels(pb.ListModelsRequest(), metadata=metadata)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "2 authorization values" in (e.value.details() or "")


def test_an_http_request_without_a_valid_token_loses_its_connection(authed: BackgroundServer) -> None:
    u = urllib.parse.urlsplit(authed.http_url)
    for token in (None, "not-a-token", TOKENS["pull"]):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        resp.read()
        assert (resp.status, resp.getheader("connection")) == ((200, None) if token == TOKENS["pull"] else
                                                               (401, "close"))
        assert (conn.sock is None) == (token != TOKENS["pull"])  # http.client closes on "connection: close"
        conn.close()
