"""A publish's checks (service/copies/checks.py): the ranks agreed, each tensor covered once, the tensors
what the server's format makes of some masters, the spec the server's."""

from __future__ import annotations

import math

import pytest

from weightsvc import rounding
from weightsvc.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from weightsvc.protocol.fabric import MemoryRange
from weightsvc.protocol.manifest import DTYPE_SIZES
from weightsvc.protocol.published import PublishedTensor, RankPublish
from weightsvc.service.copies.checks import check_served, check_spec, plan_copy

BF16 = rounding.ExportSpec("bf16", "sr", seed=0)
FP8 = rounding.ExportSpec("fp8_e4m3", "sr", seed=0)
WHERE = "model 'm' step 1"


def tensor(name: str, shape: tuple[int, ...], dtype: str = "BF16", part: tuple[int, int] | None = None
           ) -> PublishedTensor:
    count = part[1] if part is not None else math.prod(shape)
    nbytes = count * DTYPE_SIZES[dtype]
    return PublishedTensor(name, shape, dtype, part, "xxh3_64:0", (MemoryRange(4096, nbytes, 0),) if nbytes else ())


def rank(r: int, world_size: int, *tensors: PublishedTensor, spec: rounding.ExportSpec = BF16) -> RankPublish:
    return RankPublish("m", 1, r, world_size, spec, b"agent", "DRAM", tensors)


def halves(name: str, shape: tuple[int, ...], dtype: str = "BF16") -> list[PublishedTensor]:
    n = math.prod(shape)
    return [tensor(name, shape, dtype, (0, n // 2)), tensor(name, shape, dtype, (n // 2, n - n // 2))]


def test_two_ranks_halves_are_laid_out_as_a_version_wider_dtypes_first() -> None:
    x = [tensor("x.weight", (256, 128), "F8_E4M3", (0, 128 * 128)), tensor("x.weight", (256, 128), "F8_E4M3",
                                                                         (128 * 128, 128 * 128))]
    scale = [tensor("x.weight_scale_inv", (2, 1), "F32", (0, 1)), tensor("x.weight_scale_inv", (2, 1), "F32", (1, 1))]
    b = halves("b", (5,))
    plan = plan_copy(WHERE, {1: rank(1, 2, x[1], scale[1], b[1], spec=FP8), 0: rank(0, 2, x[0], scale[0], b[0],
                                                                                       spec=FP8)}, FP8, 1 << 20)
    assert plan.data_bytes == 256 * 128 + 2 * 4 + 5 * 2
    assert [(n, plan.slots[n].offset) for n in ("x.weight_scale_inv", "b", "x.weight")] == [
        ("x.weight_scale_inv", 0), ("b", 8), ("x.weight", 18)]
    assert [r for r, _ in plan.parts["x.weight"]] == [0, 1]


def test_ranks_that_disagree_on_a_shape_or_dtype_are_named() -> None:
    w = halves("w", (8, 4))
    other = tensor("w", (4, 8), part=w[1].part)
    with pytest.raises(InvalidArgument, match=r"tensor 'w': rank 0 declares BF16 of shape \[8, 4\], rank 1 declares "
                                              r"BF16 of shape \[4, 8\]"):
        plan_copy(WHERE, {0: rank(0, 2, w[0]), 1: rank(1, 2, other)}, BF16, 1 << 20)
    f32 = tensor("w", (8, 4), "F32", w[1].part)
    with pytest.raises(InvalidArgument, match=r"rank 1 declares F32 of shape \[8, 4\]"):
        plan_copy(WHERE, {0: rank(0, 2, w[0]), 1: rank(1, 2, f32)}, BF16, 1 << 20)


def test_a_tensor_one_rank_lacks_is_named_with_both_ranks() -> None:
    w = halves("w", (8, 4))
    with pytest.raises(InvalidArgument, match=r"tensor 'b': rank 1 publishes it, rank 0 does not"):
        plan_copy(WHERE, {0: rank(0, 2, w[0]), 1: rank(1, 2, w[1], tensor("b", (3,)))}, BF16, 1 << 20)


def test_parts_that_overlap_or_leave_a_gap_are_refused() -> None:
    over = [tensor("w", (8,), part=(0, 5)), tensor("w", (8,), part=(4, 4))]
    with pytest.raises(InvalidArgument, match=r"tensor 'w': the part of rank 1 .* overlaps the part of rank 0"):
        plan_copy(WHERE, {0: rank(0, 2, over[0]), 1: rank(1, 2, over[1])}, BF16, 1 << 20)
    gap = [tensor("w", (8,), part=(0, 3)), tensor("w", (8,), part=(4, 4))]
    with pytest.raises(InvalidArgument, match=r"tensor 'w' of shape \[8\]: no rank pushes elements \[3, 4\)"):
        plan_copy(WHERE, {0: rank(0, 2, gap[0]), 1: rank(1, 2, gap[1])}, BF16, 1 << 20)


def test_a_version_over_the_byte_limit_is_refused() -> None:
    with pytest.raises(ResourceExhausted, match="--max-version-bytes"):
        plan_copy(WHERE, {0: rank(0, 1, tensor("w", (8, 4)))}, BF16, 63)


def test_the_served_tensors_must_be_what_the_format_makes_of_their_masters() -> None:
    fp8 = {"x.weight": ((256, 128), "F8_E4M3"), "x.weight_scale_inv": ((2, 1), "F32"), "norm.weight": ((128,), "BF16")}
    check_served("m", 1, fp8, {}, FP8)
    with pytest.raises(InvalidArgument, match=r"tensor 'x.weight': fp8_e4m3 serves this master of shape \[256, 128\] "
                                              r"as 'x.weight' \(F8_E4M3 \[256, 128\]\), 'x.weight_scale_inv' \(F32 "
                                              r"\[2, 1\]\); the publish has 'x.weight' \(BF16 \[256, 128\]\)"):
        check_served("m", 1, {"x.weight": ((256, 128), "BF16")}, {}, FP8)
    with pytest.raises(InvalidArgument, match=r"tensor 'x.weight':.* the publish has 'x.weight' \(F8_E4M3"):
        check_served("m", 1, {"x.weight": ((256, 128), "F8_E4M3")}, {}, FP8)  # its scales missing
    with pytest.raises(InvalidArgument, match=r"tensor 'x.weight':.* the publish has 'x.weight' \(F8_E4M3"):
        check_served("m", 1, {"x.weight": ((256, 128), "F8_E4M3")}, {}, BF16)  # fp8 where the server serves bf16


def test_an_alias_must_name_a_published_tensor() -> None:
    check_served("m", 1, {"embed.weight": ((4, 4), "BF16")}, {"lm_head.weight": "embed.weight"}, BF16)
    with pytest.raises(InvalidArgument, match=r"alias 'lm_head\.weight' must name a published tensor"):
        check_served("m", 1, {"embed.weight": ((4, 4), "BF16")}, {"lm_head.weight": "other"}, BF16)


def test_a_spec_not_the_servers_is_refused_naming_both_the_scaling_only_where_it_counts() -> None:
    check_spec(rank(0, 1, spec=rounding.ExportSpec("bf16", "sr", 0, "tensor")), BF16)  # (no scales in bf16)
    with pytest.raises(FailedPrecondition, match=r"rank 0: the copy was exported with rounding 'rtn' \(the "
                                                 r"server's: 'sr'\); seed 3 \(the server's: 0\)"):
        check_spec(rank(0, 1, spec=rounding.ExportSpec("bf16", "rtn", 3)), BF16)
    with pytest.raises(FailedPrecondition, match=r"scaling 'tensor' \(the server's: 'block'\)"):
        check_spec(rank(0, 1, spec=rounding.ExportSpec("fp8_e4m3", "sr", 0, "tensor")), FP8)
