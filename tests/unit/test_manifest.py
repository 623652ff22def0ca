from __future__ import annotations

import pytest
import torch
from safetensors.torch import load

from weightsvc.errors import InvalidArgument
from weightsvc.protocol.manifest import Manifest, ServedTensor, manifest_from_header
from weightsvc.protocol.refs import check_model_name, parse_version_ref
from weightsvc.protocol.safetensors import read_safetensors_header


def test_header_is_valid_safetensors_and_carries_the_manifest() -> None:
    a = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    b = torch.ones(4, dtype=torch.bfloat16)
    data = a.view(torch.uint8).reshape(-1).numpy().tobytes() + b.view(torch.uint8).numpy().tobytes()
    m = Manifest(
        "m",
        3,
        "bf16",
        "sr",
        0,
        1.5,
        len(data),
        "xxh3_128:0",
        (ServedTensor("a", (2, 3), "BF16", 0, 12), ServedTensor("b", (4,), "BF16", 12, 8)),
    )
    header = m.safetensors_header()
    assert len(header) % 8 == 0
    loaded = load(header + data)
    assert torch.equal(loaded["a"], a) and torch.equal(loaded["b"], b)
    start, parsed = read_safetensors_header(header)
    assert start == len(header)
    assert manifest_from_header(parsed) == m


@pytest.mark.parametrize("ref, expected", [("latest", None), ("", None), (None, None), ("12", 12), (7, 7)])
def test_version_refs(ref: object, expected: int | None) -> None:
    assert parse_version_ref(ref) == expected  # type: ignore[arg-type]


def test_bad_version_ref() -> None:
    with pytest.raises(InvalidArgument, match="'v3' is neither a version number nor 'latest'"):
        parse_version_ref("v3")


@pytest.mark.parametrize("name", ["", "../etc", "a/b", ".hidden", "x" * 129, "sp ace", "nl\n"])
def test_model_names_that_cannot_be_paths_are_refused(name: str) -> None:
    with pytest.raises(InvalidArgument, match="model name"):
        check_model_name(name)


def test_manifest_json_and_header_are_the_text_json_dumps_writes() -> None:
    """Both are written tensor by tensor, for speed: they must stay byte for byte what
    `json.dumps` makes (names to escape, every dtype, empty shapes, a selection's slices)."""
    import json
    import random
    import struct

    from weightsvc.protocol.lag import LagMetrics
    from weightsvc.protocol.manifest import METADATA_KEY, Slice

    rng = random.Random(1)
    names = ["a", 'é\u2603"q\\b\nnl', "model.layers.0.w", "\x00ctl", "\U0001d518nicode"]
    tensors, offset = [], 0
    for i in range(3000):
        shape = tuple(rng.randint(0, 9999) for _ in range(rng.randint(0, 3)))
        cut = Slice(0, 1, 3) if i % 777 == 5 else None
        tensors.append(ServedTensor(f"{rng.choice(names)}{i}", shape, rng.choice(["BF16", "F8_E4M3", "F32"]), offset,
                                    2 * i, f"xxh3_64:{rng.getrandbits(64):016x}", cut))
        offset += 2 * i
    m = Manifest("m", 3, "bf16", "sr", 0, 1.5, offset, "xxh3_128:0", tuple(tensors),
                 lag=LagMetrics(0.1, None, 3, 0.2, 0, 10, False))
    for separators in ((", ", ": "), (",", ":")):
        assert m.json(separators) == json.dumps(m.to_dict(), separators=separators)
    entries = {t.name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.offset, t.offset + t.nbytes]}
               for t in m.tensors}
    raw = json.dumps({"__metadata__": {METADATA_KEY: m.json()}, **entries}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    assert m.safetensors_header() == struct.pack("<Q", len(raw)) + raw
