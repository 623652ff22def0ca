"""How a model, a version and a tensor are named: model names become file names and URL segments,
versions are the learner's steps, asked for by number or as "latest", tensor names are keys of a
safetensors header."""

from __future__ import annotations

import re

from weightsvc.errors import InvalidArgument

_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Steps, so versions, are 0 ... MAX_STEP: each one can be asked for by number (18 digits), and a
# model at the last step can still take the pushes above it that int64 leaves room for.
MAX_STEP = 10**18 - 1
_VERSION = re.compile(r"[0-9]{1,18}")
MAX_NAME_CHARS = 1024
RESERVED_NAME = "__metadata__"


def check_model_name(model: str) -> str:
    # Model names become file names and URL segments: keep them plain.
    if not _MODEL_NAME.fullmatch(model):
        raise InvalidArgument(
            f"model name {model!r} is invalid: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
            reason="invalid_header",
        )
    return model


def parse_version_ref(ref: str | int | None) -> int | None:
    """`None` for latest; a positive int for a version number."""
    if ref is None or ref == "" or ref == "latest":
        return None
    if isinstance(ref, int):
        return ref
    if _VERSION.fullmatch(ref):
        return int(ref)
    raise InvalidArgument(f"version {ref!r} is neither a version number nor 'latest'")


def check_tensor_name(where: str, name: str, seen: set[str]) -> None:
    """Refuse a tensor or alias name that is empty, too long, reserved or already in `seen`; else add it."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise InvalidArgument(f"{where}: tensor names must have 1-{MAX_NAME_CHARS} characters", reason="invalid_header")
    if name in seen:
        raise InvalidArgument(f"{where}: tensor {name!r} is declared twice", reason="invalid_header")
    if name == RESERVED_NAME:
        raise InvalidArgument(f"{where}: {RESERVED_NAME!r} is reserved by the safetensors format",
                              reason="invalid_header")
    seen.add(name)
