"""The object store's names, commit markers and retention, without a store."""

from __future__ import annotations

import dataclasses

import pytest

from weightsvc.errors import DataLoss, InvalidArgument
from weightsvc.protocol.manifest import Manifest, ServedTensor
from weightsvc.store import Marker, StoreUrl
from weightsvc.store.layout import DELTA, FULL, chain, marker_name, version_of
from weightsvc.store.writer import StoredModel, expired


def marker(version: int, base: int | None, chain_length: int = 0) -> Marker:
    """A marker of a version of one BF16 tensor of 10 elements: full (a header of 8 bytes), or a delta."""
    m = Manifest("m", version, "bf16", "sr", 0, 0.0, 20, "digest", (ServedTensor("w", (10,), "BF16", 0, 20),))
    if base is None:
        return Marker(m, FULL, None, chain_length, 28, "xxh3_64:0", 8)
    return Marker(m, DELTA, base, chain_length, 29, "xxh3_64:0")


def test_names_sort_as_versions_and_read_back() -> None:
    names = [marker_name("m", v) for v in (2, 10, 100)]
    assert sorted(names) == names
    assert [version_of("m", n) for n in names] == [2, 10, 100]
    assert version_of("m", "versions/m/00000000000000000002.delta") is None
    for stray in (f"versions/m/{2:025d}.json", "versions/m/2.json", "versions/m/0000000000000000000\u0662.json",
                  "versions/mm/00000000000000000002.json", "versions/m/x/00000000000000000002.json"):
        assert version_of("m", stray) is None, stray  # a marker's name has the 20 ASCII digits written


def test_retention_keeps_the_newest_and_the_chains_they_are_built_on() -> None:
    # 1 full, 2-3 deltas, 4 full, 5-6 deltas; 7 a full whose base was dropped from the queue.
    stored = StoredModel({1: marker(1, None), 2: marker(2, 1, 1), 3: marker(3, 2, 2), 4: marker(4, None),
                          5: marker(5, 4, 1), 6: marker(6, 5, 2), 7: marker(7, None)})
    assert expired(stored, 2) == [1, 2, 3]  # 6 and 7 kept; 6 needs 5 and 4
    assert expired(stored, 1) == [1, 2, 3, 4, 5, 6]
    assert expired(stored, 5) == []  # 3 is retained, and built on 2 and 1
    assert chain(stored.markers[6], stored.markers.get) == [stored.markers[v] for v in (4, 5, 6)]
    with pytest.raises(DataLoss, match="lost version 4"):
        chain(stored.markers[6], {5: stored.markers[5]}.get)


def test_a_marker_that_is_not_the_version_asked_for_is_refused() -> None:
    raw = marker(3, 2, 1).to_json()
    assert Marker.from_json(raw, "m", 3) == marker(3, 2, 1)
    with pytest.raises(DataLoss, match="version 4"):
        Marker.from_json(raw, "m", 4)
    with pytest.raises(DataLoss, match="not one weightsvc writes"):
        Marker.from_json(b"{not json", "m", 3)
    bad = dataclasses.replace(marker(3, 2, 1), base=None)  # a delta without its base
    with pytest.raises(DataLoss):
        Marker.from_json(bad.to_json(), "m", 3)


def test_a_delta_chain_that_loops_or_lies_about_its_length_is_damaged() -> None:
    """Versions only go up: a delta is on an earlier version, so every chain ends; and each marker says
    how far it is from its full version, so a walk takes that many steps at most."""
    for base in (3, 4):  # on itself; on a later version (two markers on each other)
        with pytest.raises(DataLoss, match=f"its delta is on version {base}"):
            Marker.from_json(marker(3, base, 1).to_json(), "m", 3)
    with pytest.raises(DataLoss, match="its delta is on version 2, 0 deltas after"):
        Marker.from_json(marker(3, 2, 0).to_json(), "m", 3)
    with pytest.raises(DataLoss, match="full version is 2 deltas after one"):
        Marker.from_json(marker(3, None, 2).to_json(), "m", 3)
    # Its object's size follows from its manifest: nothing larger is read for it.
    assert Marker.from_json(marker(3, 2, 1).to_json(), "m", 3).nbytes == 29  # a dense delta of its one tensor
    for lie in (dataclasses.replace(marker(3, 2, 1), nbytes=30), dataclasses.replace(marker(3, None), nbytes=29),
                dataclasses.replace(marker(3, None), data_start=0, nbytes=20)):
        with pytest.raises(DataLoss, match=r"is damaged: a (delta|full version) of"):
            Marker.from_json(lie.to_json(), "m", 3)
    with pytest.raises(DataLoss, match="versions are steps in"):
        Marker.from_json(dataclasses.replace(marker(3, None), manifest=dataclasses.replace(
            marker(3, None).manifest, version=10**19)).to_json(), "m", 10**19)
    looped = {1: marker(1, None), 2: marker(2, 1, 5), 3: marker(3, 2, 6)}  # 2 says 5 deltas on a full version
    with pytest.raises(DataLoss, match="version 2 says it is 5 deltas after a full version, that of version 1"):
        chain(looped[3], looped.get)
    calls = []

    def lookup(v: int) -> Marker:  # a store that answers every version with a marker on the one before
        calls.append(v)
        return marker(v, v - 1, 10**9)

    with pytest.raises(DataLoss, match="deltas after a full version"):
        chain(marker(10**9, 10**9 - 1, 10**9), lookup)
    assert len(calls) == 1


def test_store_urls() -> None:
    assert StoreUrl.parse("s3://weights/runs/a/") == StoreUrl("weights", "runs/a")
    assert StoreUrl.parse("s3://weights").key("x") == "x"
    for bad in ("weights/x", "s3://B/x", "s3://a/x"):
        with pytest.raises(InvalidArgument, match=r"bucket|s3://"):
            StoreUrl.parse(bad)
