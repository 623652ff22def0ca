"""Keys of the counter-based RNG: the served bits are a pure function of the master and these keys.

The random bits of element i of a tensor are a pure function of (seed, version, tensor name, i):
the 64-bit key below is derived once per tensor on the host, and the per-element hash in the
kernels mixes it with the flat element index. No global generator is ever touched, so any
chunking, any split across ranks and any device gives the same bits.
"""

from __future__ import annotations

import hashlib


def tensor_key(seed: int, version: int | None, name: str) -> tuple[int, int]:
    """Two uint32 words keyed by (seed, version, name); `version=None` leaves the version out."""
    if seed < 0 or seed >= 1 << 64:
        raise ValueError(f"seed {seed} is outside [0, 2**64)")
    tag = f"{seed}\x00{'' if version is None else version}\x00{name}".encode()
    digest = hashlib.blake2b(tag, digest_size=8, person=b"weightsvc-rng").digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")
