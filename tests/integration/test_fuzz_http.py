"""Fuzz the HTTP API with schemathesis, from the app's own OpenAPI schema, against a live server:
no 5xx, and every error is the service's JSON error with a message."""

from __future__ import annotations

from typing import Any

import schemathesis
import torch
from hypothesis import HealthCheck, given, settings

from weightsvc import LearnerClient
from weightsvc.server.server import BackgroundServer


def test_every_route_answers_inputs_from_its_schema_without_5xx(server: BackgroundServer) -> None:
    LearnerClient(server.grpc_target).push(1, {"w": torch.ones(4)}, model="default")  # something to find
    schema = schemathesis.openapi.from_url(f"{server.http_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8  # every route of the app, from its own schema

    for operation in operations:
        # A watch answers with an event stream that goes on while the model is idle: schemathesis
        # reads it until the read timeout, so fewer examples with a shorter one.
        streams = "text/event-stream" in operation.definition.raw["responses"].get("200", {}).get("content", {})
        timeout = (30, 3) if streams else 30

        @given(case=operation.as_strategy())
        @settings(max_examples=8 if streams else 25, deadline=None, suppress_health_check=list(HealthCheck))
        def check(case: Any) -> None:
            response = case.call(timeout=timeout)  # noqa: B023 - check() runs within its own iteration
            assert response.status_code < 500, (case.path, case.path_parameters, response.status_code, response.text)
            if response.status_code >= 400 and case.method != "HEAD":  # a HEAD answer has no body
                error = response.json()["error"]
                assert error["code"] and error["message"], response.text

        check()
