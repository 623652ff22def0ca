"""How the parts of several learner ranks combine, and the split-independent master digest."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from weightsvc.errors import InvalidArgument
from weightsvc.protocol.digest import DIGEST_BLOCK, MasterDigest, StreamedChecksum, checksum
from weightsvc.protocol.manifest import TensorSpec
from weightsvc.service.push.shards import merge_shards


def spec(name: str, shape: tuple[int, ...], part: tuple[int, int] | None = None) -> TensorSpec:
    return TensorSpec(name, shape, part=part)


def test_parts_in_any_order_and_empty_ones_merge_into_whole_tensors_in_declaration_order() -> None:
    merged = merge_shards(
        "m",
        {
            1: (spec("b", (10,), (4, 6)), spec("c", (2, 3))),
            0: (spec("a", (5,)), spec("b", (10,), (0, 4)), spec("c", (2, 3), (6, 0))),
        },
    )
    assert merged == (spec("a", (5,)), spec("b", (10,)), spec("c", (2, 3)))


@pytest.mark.parametrize(
    ("ranks", "message"),
    [
        (
            {0: (spec("w", (10,), (0, 4)),), 1: (spec("w", (10,), (5, 5)),)},
            r"'w' of shape \[10\]: no rank pushes elements \[4, 5\)",
        ),
        ({0: (spec("w", (10,), (0, 4)),)}, r"no rank pushes elements \[4, 10\)"),
        (
            {0: (spec("w", (10,), (0, 6)),), 1: (spec("w", (10,), (4, 6)),)},
            r"rank 1 \(elements \[4, 10\)\) overlaps the part of rank 0",
        ),
        ({0: (spec("w", (10,)),), 1: (spec("w", (5, 2)),)}, r"rank 0 declares shape \[10\], rank 1 declares \[5, 2\]"),
    ],
    ids=["gap", "tail", "overlap", "shape"],
)
def test_parts_that_do_not_cover_a_tensor_exactly_once_are_refused(
    ranks: dict[int, tuple[TensorSpec, ...]], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        merge_shards("model 'm' step 1", ranks)


def test_master_digest_is_the_same_for_any_chunking_and_split() -> None:
    data = np.random.default_rng(0).standard_normal(3 * DIGEST_BLOCK // 4 + 123).astype(np.float32).view(np.uint8)
    whole = MasterDigest(data.size)
    whole.update(0, data)
    rng = np.random.default_rng(1)
    for _ in range(5):
        cuts = np.unique(np.concatenate([[0, data.size], rng.integers(0, data.size // 4, 12) * 4]))
        pieces = list(itertools.pairwise(cuts))
        rng.shuffle(pieces)  # ranks' chunks interleave in any order
        split = MasterDigest(data.size)
        for lo, hi in pieces:
            split.update(int(lo), data[lo:hi])
        assert split.hexdigest() == whole.hexdigest()
    changed = data.copy()
    changed[DIGEST_BLOCK + 5] ^= 1
    other = MasterDigest(data.size)
    other.update(0, changed)
    assert other.hexdigest() != whole.hexdigest()


def test_served_checksum_streamed_in_order_or_not_is_the_one_shot_checksum() -> None:
    data = np.random.default_rng(2).integers(0, 256, 3 << 20, dtype=np.uint8)
    cuts = [0, 1 << 20, (2 << 20) + 6, data.size]
    in_order, shuffled = StreamedChecksum(), StreamedChecksum()
    for lo, hi in itertools.pairwise(cuts):
        in_order.update(lo, data[lo:hi])
    for lo, hi in [(cuts[1], cuts[2]), (cuts[0], cuts[1]), (cuts[2], cuts[3])]:  # a rank's part first
        shuffled.update(lo, data[lo:hi])
    assert in_order.value(data) == shuffled.value(data) == checksum(data)
    changed = data.copy()
    changed[-1] ^= 1
    assert StreamedChecksum().value(changed) != checksum(data)


def test_master_digest_of_an_incomplete_tensor_is_refused() -> None:
    d = MasterDigest(DIGEST_BLOCK + 8)
    d.update(0, bytes(DIGEST_BLOCK))
    with pytest.raises(AssertionError, match="incomplete"):
        d.hexdigest()
