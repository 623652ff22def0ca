"""Acks against a real server over both transports: a client id belongs to the token that acked under it
first, and a flood of acks under new client ids stays bounded and cannot clear a stuck client's alert."""

from __future__ import annotations

import json
import urllib.parse
from http.client import HTTPConnection

import pytest

from tests.conftest import make_masters, serving, target
from weightsvc import InferenceClient, LearnerClient
from weightsvc.errors import PermissionDenied
from weightsvc.service.replicas.registry import ACKS_KEPT

MODEL = "acked"


def test_a_client_id_belongs_to_the_token_that_acked_under_it_first(transport: str) -> None:
    with serving(pull_tokens="pull-a,pull-b", push_tokens="push-c") as srv:
        LearnerClient(srv.grpc_target, token="push-c").push(1, make_masters(), model=MODEL)
        with InferenceClient(target(srv, transport), token="pull-a") as a, \
                InferenceClient(target(srv, transport), token="pull-b") as b:
            assert a.ack(MODEL, 1, "pod-7") == 1
            with pytest.raises(PermissionDenied, match=r"model 'acked': client id 'pod-7' acks for another caller"):
                b.ack(MODEL, 1, "pod-7")
            assert b.ack(MODEL, 1, "pod-8") == 1  # an id of its own
            assert a.ack(MODEL, 1, "pod-7") == 1  # the owner still may
        u = urllib.parse.urlsplit(srv.http_url)
        conn = HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", f"/v1/models/{MODEL}/acks", json.dumps({"version": 1, "client_id": "pod-7"}),
                     {"authorization": "Bearer pull-b", "content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 403 and b"client id 'pod-7'" in resp.read()


def lag_versions(srv_url: str) -> float:
    u = urllib.parse.urlsplit(srv_url)
    conn = HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/metrics")
    line = next(x for x in conn.getresponse().read().decode().splitlines()
                if x.startswith(f'weightsvc_client_lag_versions{{model="{MODEL}"}}'))
    return float(line.split()[-1])


def test_a_flood_of_new_client_ids_is_bounded_and_leaves_a_stuck_clients_alert() -> None:
    with serving() as srv:
        with LearnerClient(srv.grpc_target) as learner:
            learner.push(1, make_masters(), model=MODEL)
            InferenceClient(srv.http_url).ack(MODEL, 1, "stuck-0")
            learner.push(2, make_masters(), model=MODEL)
        assert lag_versions(srv.http_url) == 1
        u = urllib.parse.urlsplit(srv.http_url)
        conn = HTTPConnection(u.hostname, u.port, timeout=30)  # one connection: a flood as fast as it comes
        for i in range(ACKS_KEPT + 50):
            conn.request("POST", f"/v1/models/{MODEL}/acks", json.dumps({"version": 2, "client_id": f"flood-{i}"}),
                         {"content-type": "application/json"})
            assert conn.getresponse().read() == b'{"latest_version":2}'
        assert lag_versions(srv.http_url) == 1  # the stuck client is still tracked, and its alert fires
        clients = srv.service.clients(MODEL)
        assert len(clients) == ACKS_KEPT and "stuck-0" in {c.client_id for c in clients}
        assert len(srv.call(srv.service.registry.acks(MODEL))) == ACKS_KEPT  # the registry's copy is bounded too
