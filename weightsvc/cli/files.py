"""Reading the files the commands are given: safetensors headers, masters, the base of a delta pull.
Each failure is one line naming the file and what it holds instead."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from weightsvc.cli._common import fail
from weightsvc.errors import WeightsvcError, subject
from weightsvc.protocol.safetensors import header_length

# The first bytes of the files torch.save writes: a zip archive, or a pickle (protocol 2 to 5).
_TORCH_MAGIC = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


def read_file_header(path: Path) -> tuple[int, dict[str, Any]]:
    """Where the data of a safetensors file starts, and its JSON header; or an error naming the file
    and what it holds instead."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            length = header_length(prefix) if len(prefix) == 8 else -1
            raw = f.read(length) if 0 < length <= size - 8 else b""
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    if prefix.startswith(_TORCH_MAGIC):
        fail(f"{path} is not a safetensors file: it is a torch.save checkpoint; convert it with "
             f"safetensors.torch.save_file(torch.load(...), 'masters.safetensors')")
    if not raw:
        fail(f"{path} is not a safetensors file: its first 8 bytes give a header of {length} bytes "
             f"in a file of {size} bytes")
    try:
        header = json.loads(raw)
    except ValueError:
        header = None
    if not isinstance(header, dict):
        fail(f"{path} is not a safetensors file: its header is not a JSON object")
    return 8 + length, header


def check_base_file(path: Path, model: str, base: int) -> None:
    """`pull --base`: the output file must hold that version of the model, as a previous pull wrote it."""
    from weightsvc.protocol.manifest import manifest_from_header

    if not path.exists():
        fail(f"--base {base}: {path} does not exist; pull {subject(model, base)} into it first "
             f"(without --base)")
    _, header = read_file_header(path)
    try:
        held = manifest_from_header(header)
    except WeightsvcError as e:
        fail(f"--base {base}: {path} was not written by `weightsvc pull` ({e}); pull model {model!r} "
             f"version {base} into it first (without --base)")
    if (held.model, held.version) != (model, base):
        fail(f"--base {base}: {path} holds {subject(held.model, held.version)}, "
             f"not {subject(model, base)}")


def load_masters(path: Path, data_start: int, header: dict[str, Any]) -> dict[str, Any]:
    """The tensors of a safetensors file as numpy arrays (no torch). numpy has no bfloat16: a bf16
    tensor is widened to fp32 from its bits, which is exact."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load_file

    entries = {name: e for name, e in header.items() if name != "__metadata__"}
    if all(e.get("dtype") != "BF16" for e in entries.values()):
        return load_file(path)
    masters: dict[str, Any] = {}
    with safe_open(path, framework="numpy") as f:
        for name, e in entries.items():
            if e["dtype"] != "BF16":
                masters[name] = f.get_tensor(name)
                continue
            start, end = e["data_offsets"]
            bits = np.fromfile(path, dtype="<u2", count=(end - start) // 2, offset=data_start + start)
            masters[name] = (bits.astype("<u4") << 16).view("<f4").reshape(e["shape"])
    return masters
