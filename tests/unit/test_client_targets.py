"""The one place a target picks its transport: each scheme's transport, each family's class for it,
and a target a family has no transport for refused with what to give."""

from __future__ import annotations

import pytest

from weightsvc.client import (
    GrpcInferenceClient,
    GrpcLearnerClient,
    HttpInferenceClient,
    HttpLearnerClient,
    InferenceClient,
    LearnerClient,
    StoreInferenceClient,
)
from weightsvc.client._targets import client_class, transport_of
from weightsvc.errors import InvalidArgument


@pytest.mark.parametrize(("target", "transport"), [
    ("127.0.0.1:50051", "grpc"), ("grpc://host:1", "grpc"), ("grpcs://host:1", "grpc"),
    ("http://host:8080", "http"), ("https://host/prefix", "http"), ("s3://bucket/prefix", "s3"),
])
def test_the_scheme_names_the_transport(target: str, transport: str) -> None:
    assert transport_of(target) == transport


def test_each_family_has_a_class_per_transport() -> None:
    assert client_class("inference", "host:1") is GrpcInferenceClient
    assert client_class("inference", "https://host") is HttpInferenceClient
    assert client_class("inference", "s3://bucket") is StoreInferenceClient
    assert client_class("learner", "grpcs://host:1") is GrpcLearnerClient
    assert client_class("learner", "http://host:1") is HttpLearnerClient
    assert all(issubclass(c, InferenceClient) for c in (GrpcInferenceClient, HttpInferenceClient, StoreInferenceClient))
    assert all(issubclass(c, LearnerClient) for c in (GrpcLearnerClient, HttpLearnerClient))


def test_a_learner_refuses_an_object_store_and_says_what_to_give() -> None:
    with pytest.raises(InvalidArgument, match=r"s3://bucket/p: a learner client has no s3 transport; give host:port"):
        LearnerClient("s3://bucket/p")


def test_a_transport_class_refuses_another_transports_target() -> None:
    with pytest.raises(InvalidArgument, match=r"s3://bucket is an S3 URL, and the learner pushes over gRPC"):
        GrpcLearnerClient("s3://bucket")
