"""Sliced pulls: an inference worker of a tensor-parallel engine pulls only the tensors, and the rows
or columns of tensors, that it needs, over gRPC and HTTP, and gets exactly `narrow` of the whole pull,
verified by checksums of what was sent."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
import torch
from safetensors.torch import load

from tests.conftest import TRANSPORTS, make_masters, serving, target
from tests.integration.test_push_pull import http_get
from tests.integration.test_registry import REDIS_URL, needs_redis
from tests.integration.test_resume import CuttingProxy
from weightsvc.client import InferenceClient, LearnerClient, Slice
from weightsvc.errors import InvalidArgument
from weightsvc.protocol.digest import checksum
from weightsvc.protocol.manifest import manifest_from_header
from weightsvc.protocol.safetensors import read_safetensors_header
from weightsvc.protocol.topology import assign
from weightsvc.server.server import BackgroundServer
from weightsvc.v1 import weightsvc_pb2 as pb
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc

Select = dict[str, Slice | None]


def masters(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "layers.0.attn.qkv.weight": (256, 128),
        "layers.0.mlp.down.weight": (128, 96),
        "layers.0.conv.weight": (8, 6, 10),
        "layers.0.norm.weight": (64,),
        "scalar": (),
    }
    return {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in shapes.items()}


def narrowed(whole: dict[str, torch.Tensor], select: Select) -> dict[str, torch.Tensor]:
    return {n: whole[n] if s is None else whole[n].narrow(s.dim, s.start, s.stop - s.start) for n, s in select.items()}


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bits(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert raw(got[name]).equal(raw(t)), name


def whole_pull(server: BackgroundServer, model: str, version: int | str = "latest") -> dict[str, torch.Tensor]:
    with InferenceClient(server.grpc_target) as c:
        return c.pull(model, version)


def test_rows_columns_and_whole_tensors_are_narrow_of_the_whole_pull(
    server: BackgroundServer, learner: LearnerClient, client: InferenceClient, model: str
) -> None:
    learner.push(1, masters(), model=model)
    whole = whole_pull(server, model)
    select: Select = {
        "layers.0.attn.qkv.weight": Slice(0, 64, 128),  # rows: (64, 128)
        "layers.0.mlp.down.weight": Slice(1, 0, 32),  # columns: (128, 32)
        "layers.0.norm.weight": None,
        "scalar": None,
    }
    pulled = client.pull(model, 1, select=select)
    assert_bits(pulled, narrowed(whole, select))
    assert pulled["layers.0.attn.qkv.weight"].shape == (64, 128)
    assert pulled["layers.0.mlp.down.weight"].shape == (128, 32)
    assert client.last_pull_bytes == sum(t.numel() * 2 for t in pulled.values())
    assert client.held(model) is None  # a selection is no delta base
    assert dict(client.iter_weights(model, 1, select={"scalar": None})).keys() == {"scalar"}

    manifest, data = client.pull_data(model, "latest", select=select)
    assert manifest.version == 1 and manifest.data_bytes == len(data) == client.last_pull_bytes
    assert {t.name: t.slice for t in manifest.tensors} == select
    for t in manifest.tensors:  # each checksum is of exactly the bytes sent
        assert t.checksum == checksum(raw(narrowed(whole, select)[t.name]).numpy())


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_any_dim_of_a_3d_tensor(
    server: BackgroundServer, learner: LearnerClient, client: InferenceClient, model: str, dim: int
) -> None:
    learner.push(1, masters(), model=model)
    select: Select = {"layers.0.conv.weight": Slice(dim, 1, 4)}
    pulled = client.pull(model, select=select)
    assert pulled["layers.0.conv.weight"].shape == [(3, 6, 10), (8, 3, 10), (8, 6, 3)][dim]
    assert_bits(pulled, narrowed(whole_pull(server, model), select))


def tp_model(seed: int = 2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.mlp.up.weight": torch.randn(512, 256, generator=gen) * 0.02 for i in range(4)}


@pytest.mark.parametrize("tp", [2, 4])
def test_a_tensor_parallel_rank_moves_its_share_of_the_bytes(
    server: BackgroundServer, learner: LearnerClient, client: InferenceClient, model: str, tp: int
) -> None:
    state = tp_model()
    learner.push(1, state, model=model)
    whole = client.pull(model)
    whole_bytes = client.last_pull_bytes
    rows = 512 // tp
    for rank in range(tp):
        select: Select = {name: Slice(0, rank * rows, (rank + 1) * rows) for name in state}
        pulled = client.pull(model, select=select)
        assert_bits(pulled, narrowed(whole, select))
        assert client.last_pull_bytes == whole_bytes // tp  # 524,288 (tp 2) or 262,144 (tp 4) of 1,048,576
    assert client.last_pull_bytes <= (0.3 if tp == 4 else 0.55) * whole_bytes


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_formats(
    server: BackgroundServer, learner: LearnerClient, client: InferenceClient, model: str, fmt: str
) -> None:
    learner.push(1, masters() | tp_model(), model=model, format=fmt, rounding="sr")
    whole = whole_pull(server, model)
    name = "layers.1.mlp.up.weight"
    dtype = torch.float8_e4m3fn if fmt.startswith("fp8") else torch.bfloat16
    assert whole[name].dtype == dtype
    select: Select = {name: Slice(0, 128, 256), "layers.0.mlp.down.weight": Slice(1, 48, 96), "scalar": None}
    if fmt.startswith("fp8"):  # the scales are tensors like any other: the caller selects what it needs
        scales = name + "_scale_inv"
        assert whole[scales].dtype == torch.float32
        select[scales] = Slice(0, 1, 2) if whole[scales].shape[0] > 1 else None
    pulled = client.pull(model, select=select)
    assert_bits(pulled, narrowed(whole, select))


def test_http_selection_is_a_safetensors_file_with_ranges(
    server: BackgroundServer, learner: LearnerClient, model: str
) -> None:
    learner.push(1, masters(), model=model)
    whole = whole_pull(server, model)
    path = f"/v1/models/{model}/versions/1/safetensors"
    query = "?select=layers.0.attn.qkv.weight@1:32:96&select=layers.0.norm.weight&select=layers.0.conv.weight@2:0:5"
    status, headers, body = http_get(server.http_url, path + query)
    assert status == 200 and headers["content-length"] == str(len(body))
    assert headers["content-disposition"] == f'attachment; filename="{model}-1-selection.safetensors"'
    select: Select = {"layers.0.attn.qkv.weight": Slice(1, 32, 96), "layers.0.norm.weight": None,
                      "layers.0.conv.weight": Slice(2, 0, 5)}
    assert_bits(load(body), narrowed(whole, select))  # a plain safetensors reader
    manifest = manifest_from_header(read_safetensors_header(body)[1])  # the selection's manifest, in __metadata__
    assert {t.name: t.slice for t in manifest.tensors} == select
    assert [t.dtype for t in manifest.tensors] == ["BF16"] * 3
    # Its own ETag: not the whole file's, not another selection's; Range and If-Range as for the file.
    etag = headers["etag"]
    assert etag not in {http_get(server.http_url, path)[1]["etag"],
                        http_get(server.http_url, path + "?select=scalar")[1]["etag"]}
    status, headers, tail = http_get(server.http_url, path + query, {"Range": "bytes=100-", "If-Range": etag})
    assert status == 206 and tail == body[100:] and headers["content-range"] == f"bytes 100-{len(body) - 1}/{len(body)}"
    status, _, again = http_get(server.http_url, path + query, {"Range": "bytes=100-", "If-Range": '"stale"'})
    assert status == 200 and again == body


@pytest.fixture(scope="module")
def big() -> Iterator[tuple[BackgroundServer, dict[str, torch.Tensor]]]:
    with serving() as srv, InferenceClient(srv.grpc_target) as c:
        LearnerClient(srv.grpc_target).push(1, {"w": torch.randn(4096, 2048) * 0.02})  # 16 MiB served
        yield srv, c.pull()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_broken_selection_pull_resumes_from_its_offset(
    big: tuple[BackgroundServer, dict[str, torch.Tensor]], transport: str
) -> None:
    srv, whole = big
    port = int(target(srv, transport).rsplit(":", 1)[1])
    proxy = CuttingProxy(("127.0.0.1", port), cut_after=8 << 20)
    select: Select = {"w": Slice(1, 0, 1280)}  # 10 MiB of columns: gathered, cut after 8 MiB
    try:
        url = f"127.0.0.1:{proxy.port}" if transport == "grpc" else f"http://127.0.0.1:{proxy.port}"
        with InferenceClient(url) as c:
            pulled = c.pull(select=select, progress=proxy.progress)
            assert c.last_pull_bytes == 4096 * 1280 * 2
        assert_bits(pulled, narrowed(whole, select))
        proxy.assert_resumed(4096 * 1280 * 2)
    finally:
        proxy.close()


def test_grpc_offset_is_into_the_selections_data_section(big: tuple[BackgroundServer, dict[str, torch.Tensor]]) -> None:
    srv, whole = big
    rows = pb.TensorSelect(tensor="w", slice=pb.TensorSlice(dim=0, start=10, stop=12))
    request = pb.PullRequest(model="default", version="1", offset=1000, select=[rows])
    with grpc.insecure_channel(srv.grpc_target) as channel:
        first, *chunks = pb_grpc.WeightServiceStub(channel).Pull(request)
    (t,) = first.manifest.tensors
    assert (list(t.shape), t.offset, t.nbytes, first.manifest.data_bytes) == ([2, 2048], 0, 8192, 8192)
    assert (t.slice.dim, t.slice.start, t.slice.stop) == (0, 10, 12)
    assert chunks[0].chunk.offset == 1000
    sent = b"".join(c.chunk.data for c in chunks)
    assert sent == raw(whole["w"][10:12]).numpy().tobytes()[1000:]


QKV, DOWN = "layers.0.attn.qkv.weight", "layers.0.mlp.down.weight"
BAD: list[tuple[Select, str]] = [
    ({"nope": None}, r"version 1 has no tensor 'nope' to select"),
    ({QKV: Slice(2, 0, 1)}, rf"tensor '{QKV}' of shape \[256, 128\] has no dim 2 \(dims 0 to 1\)"),
    ({QKV: Slice(-1, 0, 1)}, rf"tensor '{QKV}' of shape \[256, 128\] has no dim -1"),
    ({"scalar": Slice(0, 0, 1)}, r"tensor 'scalar' of shape \[\] has no dim 0 \(no dims: select it whole\)"),
    ({DOWN: Slice(1, 90, 97)}, rf"'{DOWN}' of shape \[128, 96\]: range \[90, 97\) of dim 1 is empty or outside \[0,"),
    ({DOWN: Slice(0, 5, 5)}, rf"tensor '{DOWN}' of shape \[128, 96\]: range \[5, 5\) of dim 0 is empty"),
    ({DOWN: Slice(0, -1, 5)}, rf"tensor '{DOWN}' of shape \[128, 96\]: range \[-1, 5\) of dim 0 is empty or outside"),
]


@pytest.mark.parametrize(("select", "message"), BAD)
def test_bad_selections_are_refused_naming_what_is_wrong(
    learner: LearnerClient, client: InferenceClient, model: str, select: Select, message: str
) -> None:
    learner.push(1, masters(), model=model)
    with pytest.raises(InvalidArgument, match=message):
        client.pull(model, select=select)


def test_a_selection_is_not_a_delta_nor_empty(
    server: BackgroundServer, learner: LearnerClient, client: InferenceClient, model: str
) -> None:
    learner.push(1, masters(), model=model)
    client.pull(model)
    with pytest.raises(InvalidArgument, match="a selection cannot be pulled as a delta"):
        client.pull(model, select={"scalar": None}, base=1)
    with pytest.raises(InvalidArgument, match="the selection is empty"):
        client.pull(model, select={})
    # The server refuses them too.
    request = pb.PullRequest(model=model, base="1", select=[pb.TensorSelect(tensor="scalar")])
    with grpc.insecure_channel(server.grpc_target) as channel, pytest.raises(grpc.RpcError) as info:
        list(pb_grpc.WeightServiceStub(channel).Pull(request))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "a selection cannot be pulled as a delta (base 1)" in (info.value.details() or "")
    twice = pb.PullRequest(model=model, select=[pb.TensorSelect(tensor="scalar")] * 2)
    with grpc.insecure_channel(server.grpc_target) as channel, pytest.raises(grpc.RpcError) as info:
        list(pb_grpc.WeightServiceStub(channel).Pull(twice))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensor 'scalar' is selected twice" in (info.value.details() or "")
    path = f"/v1/models/{model}/versions/1/safetensors?select=scalar&select=scalar"
    status, _, body = http_get(server.http_url, path)
    assert status == 400 and "tensor 'scalar' is selected twice" in json.loads(body)["error"]["message"]
    status, _, body = http_get(server.http_url, f"/v1/models/{model}/versions/1/safetensors?select=x@0:1:2")
    assert status == 400 and "has no tensor 'x'" in json.loads(body)["error"]["message"]


@needs_redis
def test_a_selection_of_a_sharded_version_comes_from_each_owner(redis_prefix: str, model: str) -> None:
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix}
    state = make_masters() | tp_model()
    with serving(**shared, replica_id="r0") as r0, serving(**shared, replica_id="r1") as r1:
        owned = assign(state, InferenceClient(r0.grpc_target).topology())
        assert len(owned) == 2, owned  # each replica owns some of these tensors
        LearnerClient(r0.grpc_target).push(1, state, model=model)
        whole = whole_pull(r0, model, 1)
        select: Select = {name: Slice(0, 1, 3) for name in state if name not in ("scalar", "layers.0.norm.weight")}
        select["scalar"] = None
        for srv in (r0, r1):
            for transport in TRANSPORTS:
                with InferenceClient(target(srv, transport)) as c:
                    assert_bits(c.pull(model, select=select), narrowed(whole, select))
                    assert c.last_pull_bytes == sum(narrowed(whole, select)[n].numel() * 2 for n in select)
        # One owner's tensors alone come from the replica asked, when it holds them all.
        mine = {name: None for name in owned["r1"]}
        with InferenceClient(r1.grpc_target) as c:
            assert_bits(c.pull(model, select=mine), narrowed(whole, mine))  # type: ignore[arg-type]
