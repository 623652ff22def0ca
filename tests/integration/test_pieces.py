"""Where a committed version's bytes lie on a real server (`Version.pieces`, `Pull.pieces`): the pieces
of a tensor, or of a slice of it, joined are `narrow` of the whole pull, in as few pieces as the layout
allows, for every served format; with a data dir and zero_copy they are ranges of the version's file
that read the same bytes; a sharded replica answers for the tensors it holds and refuses the others,
naming their owners."""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import make_masters, serving
from tests.helpers import REDIS_URL, needs_redis
from weightsvc import InferenceClient, LearnerClient
from weightsvc.errors import FailedPrecondition, InvalidArgument, subject
from weightsvc.protocol.manifest import ServedTensor, Slice
from weightsvc.protocol.topology import assign
from weightsvc.server.server import BackgroundServer
from weightsvc.service.api import FileRange, Piece
from weightsvc.service.record import Version

FORMATS = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "mxfp8", "mxfp4", "nvfp4"]  # every served dtype among them


def masters(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of random shapes (1-4 dims, served bf16 or fp16) and two weights a scaled format serves
    scaled (fp8 with its scales; MX and NVFP4 with block scales, FP4 two elements per byte)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shapes = {f"blocks.{i}.param": tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 4))) for i in range(8)}
    shapes["layers.0.mlp.up.weight"] = (160, 256)
    shapes["layers.1.mlp.up.weight"] = (rng.randint(2, 40), 32 * rng.randint(1, 4))
    return {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in shapes.items()}


def narrow(t: torch.Tensor, cut: Slice | None) -> bytes:
    part = t if cut is None else t.narrow(cut.dim, cut.start, cut.stop - cut.start)
    return part.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def cuts(t: ServedTensor, rng: random.Random) -> Iterator[Slice | None]:
    """The whole tensor, then random ranges of every dim (all of it now and then)."""
    yield None
    for dim, size in enumerate(t.shape):
        for _ in range(3):
            start = rng.randrange(size)
            yield Slice(dim, start, rng.randint(start + 1, size))
        yield Slice(dim, 0, size)


def read(pieces: list[Piece]) -> bytes:
    """The bytes of the pieces, joined: views as they are, file ranges as a transport reads them."""
    return b"".join(os.pread(p.file.fileno(), p.count, p.offset) if isinstance(p, FileRange) else bytes(p)
                    for p in pieces)


def check_pieces(v: Version, name: str, cut: Slice | None, expected: bytes, in_file: bool) -> None:
    pieces = v.pieces(name, cut)
    assert all(isinstance(p, memoryview) for p in pieces)
    assert read(pieces) == expected, (name, cut)
    files = v.pieces(name, cut, zero_copy=True)
    assert all(isinstance(p, FileRange if in_file else memoryview) for p in files)
    assert read(files) == expected, (name, cut)
    assert [len(p) for p in files] == [len(p) for p in pieces]


@pytest.fixture(scope="module")
def on_disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    with serving(data_dir=tmp_path_factory.mktemp("data")) as srv:
        yield srv


@pytest.mark.parametrize("fmt", FORMATS)
def test_pieces_are_narrow_of_the_whole_pull_in_as_few_as_the_layout_allows(
    on_disk: BackgroundServer, model: str, fmt: str
) -> None:
    state = masters(FORMATS.index(fmt))
    LearnerClient(on_disk.grpc_target).push(1, state, model=model, format=fmt, rounding="sr")
    with InferenceClient(on_disk.grpc_target) as c:
        whole = c.pull(model, 1)
    v = on_disk.service.index.get(model, 1)
    assert v.file is not None  # a data dir: zero_copy answers ranges of the version's file
    assert whole.keys() == {t.name for t in v.manifest.tensors}
    if fmt in ("mxfp4", "nvfp4"):
        assert "layers.0.mlp.up.weight_packed" in whole  # FP4, two elements per U8 byte
    rng = random.Random(fmt)
    for t in v.manifest.tensors:
        for cut in cuts(t, rng):
            check_pieces(v, t.name, cut, narrow(whole[t.name], cut), in_file=True)
            count = len(v.pieces(t.name, cut))
            if cut is None or cut.dim == 0 or (cut.start, cut.stop) == (0, t.shape[cut.dim]):
                assert count == 1, (t.name, cut)  # contiguous: one piece
            elif len(t.shape) == 2:
                assert count == t.shape[0], (t.name, cut)  # columns of [R, C]: one piece per row
            else:
                assert count <= math.prod(t.shape[: cut.dim]), (t.name, cut)


def test_a_pull_answers_its_versions_pieces_and_refuses_what_the_version_lacks(
    server: BackgroundServer, model: str
) -> None:
    state = make_masters()
    LearnerClient(server.grpc_target).push(1, state, model=model)
    with InferenceClient(server.grpc_target) as c:
        whole = c.pull(model, 1)
    up, qkv = "layers.0.mlp.up.weight", "layers.0.attn.qkv.weight"

    async def through_a_pull() -> tuple[bytes, bytes]:
        # A selection pull holds the version: its pieces are the version's, of any tensor of it.
        pull = await server.service.open_pull(model, None, "grpc", select={up: Slice(1, 0, 16)})
        try:
            return read(pull.pieces(qkv, Slice(1, 8, 40))), read(pull.pieces(up))
        finally:
            pull.close()

    assert server.call(through_a_pull()) == (narrow(whole[qkv], Slice(1, 8, 40)), narrow(whole[up], None))
    v = server.service.index.get(model, 1)
    assert v.file is None and v.readers == 0  # in memory only; the pull let go of the version
    check_pieces(v, up, Slice(0, 10, 20), narrow(whole[up], Slice(0, 10, 20)), in_file=False)
    # What a selection refuses, the pieces refuse as it words it.
    with pytest.raises(InvalidArgument, match=r"version 1 has no tensor 'nope' to select"):
        v.pieces("nope")
    with pytest.raises(InvalidArgument, match=rf"tensor '{qkv}' of shape \[192, 64\] has no dim 2 \(dims 0 to 1\)"):
        v.pieces(qkv, Slice(2, 0, 1))
    with pytest.raises(InvalidArgument, match=r"range \[60, 65\) of dim 1 is empty or outside \[0, 64\)"):
        v.pieces(qkv, Slice(1, 60, 65))


@needs_redis
def test_a_sharded_replica_answers_the_tensors_it_holds_and_refuses_the_others(
    redis_prefix: str, model: str, tmp_path: Path
) -> None:
    # Replication 1: each tensor on one replica (with the default 2, two replicas both hold all).
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix, "replication": 1}
    state = make_masters() | masters(7)
    with serving(**shared, replica_id="r0", data_dir=tmp_path / "r0") as r0, \
            serving(**shared, replica_id="r1", data_dir=tmp_path / "r1") as r1:
        owned = assign(state, InferenceClient(r0.grpc_target).topology())
        assert len(owned) == 2, owned  # each replica owns some of these tensors
        LearnerClient(r0.grpc_target).push(1, state, model=model)
        with InferenceClient(r0.grpc_target) as c:
            whole = c.pull(model, 1)
        rng = random.Random(3)
        for replica, srv in (("r0", r0), ("r1", r1)):
            v = srv.service.index.get(model, 1)
            assert v.part is not None and v.file is not None
            assert {t.name for t in v.manifest.tensors} == set(state)
            for t in v.manifest.tensors:
                if t.name in owned[replica]:  # its part's bytes, at their place in its own file
                    for cut in cuts(t, rng):
                        check_pieces(v, t.name, cut, narrow(whole[t.name], cut), in_file=True)
                else:
                    other = "r1" if replica == "r0" else "r0"
                    with pytest.raises(FailedPrecondition) as info:
                        v.pieces(t.name, None if not t.shape else Slice(0, 0, 1))
                    assert info.value.message.startswith(f"{subject(model, 1, tensor=t.name)} is held by")
                    assert f"({other})" in info.value.message
