"""The error-feedback residual of one model: fp32 per tensor, and the version it belongs to.

EF serves s_t = RTN(m_t + e_{t-1}) and keeps e_t = m_t + e_{t-1} - s_t. The residual must move in
step with committed versions: a learner or the service reads the residual of version t-1 and
produces the one of version t; saving records that version so a restart cannot pair a residual
with the wrong step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# The file's metadata (the service writes residual files of the same layout itself: `weightsvc.service.versions.disk`).
RESIDUAL_VERSION_KEY = "weightsvc.residual.version"
RESIDUAL_FORMAT_KEY = "weightsvc.residual.format"
RESIDUAL_SCALING_KEY = "weightsvc.residual.scaling"


@dataclass
class Residual:
    version: int | None = None  # the version whose export produced these residuals (None: fresh)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)  # flat float32 per tensor name
    format: str = ""  # the export it continues: a residual only carries over to the same one
    scaling: str = ""

    def tensor(self, name: str, numel: int) -> np.ndarray:
        """The residual of `name` (zeros the first time; reset if the tensor changed size)."""
        r = self.tensors.get(name)
        if r is None or r.size != numel:
            r = np.zeros(numel, np.float32)
            self.tensors[name] = r
        return r

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.tensors.values())

    def save(self, path: str | Path) -> None:
        """Write atomically as safetensors (temporary file, fsync, rename)."""
        from safetensors.numpy import save

        path = Path(path)
        meta = {
            RESIDUAL_VERSION_KEY: "" if self.version is None else str(self.version),
            RESIDUAL_FORMAT_KEY: self.format,
            RESIDUAL_SCALING_KEY: self.scaling,
        }
        raw = save(dict(self.tensors), metadata=meta)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path) -> Residual:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            tensors = {k: np.ascontiguousarray(f.get_tensor(k), dtype=np.float32).reshape(-1) for k in f.keys()}  # noqa: SIM118
        raw = meta.get(RESIDUAL_VERSION_KEY, "")
        return cls(
            int(raw) if raw else None, tensors, meta.get(RESIDUAL_FORMAT_KEY, ""), meta.get(RESIDUAL_SCALING_KEY, "")
        )
