"""The ef residuals: what an `ef` push of a model continues from, and what it leaves to the next.

One owner of that state: the residual after each model's latest committed version, in memory (its
arrays map its file with a data dir); which one a push continues from (`for_push`); the file a push
stages its new residual in (`stage`); its file written at commit, before the version's (`write`);
the one that is current once the version commits or is restored at start-up (`committed`);
and which file the data dir keeps (`kept`). A GPU keeps its own copy of the residuals
it exported (`device.Exporter.resident`, a cache of these arrays, dropped with a failed GPU).

Loop-owned, except the blocking file I/O (`stage`, `write`), which runs in a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from weightsvc.protocol.selection import holders_by_tensor
from weightsvc.protocol.topology import Group
from weightsvc.rounding import Residual, served_masters
from weightsvc.service.record import VersionFile
from weightsvc.service.versions.disk import VersionFiles
from weightsvc.service.versions.index import VersionIndex


class Residuals:
    def __init__(self, index: VersionIndex, files: VersionFiles | None) -> None:
        self._index = index
        self._files = files
        self._current: dict[str, Residual] = {}  # model -> the residual after its latest committed version

    def current(self, model: str) -> Residual | None:
        """The residual after `model`'s latest `ef` version (None before any)."""
        return self._current.get(model)

    def kept(self, model: str) -> int | None:
        """The version whose residual file is the model's current ef state (the others go)."""
        r = self._current.get(model)
        return None if r is None else r.version

    def for_push(self, model: str, format: str, scaling: str, groups: Mapping[str, Group] | None = None) -> Residual:
        """The residual an `ef` push of `model` continues from: the one of the latest committed
        version if that version was an `ef` export to the same format, else a fresh (zero) one.

        Sharded (`groups`: each pushed tensor's owners): a tensor's residual goes on only if the
        latest version's holders of it are its owners now; else it starts afresh. Every owner of a
        tensor decides the same from the same manifest, so the owners' residuals stay equal, also
        when a replica was left out of a version or the replicas changed."""
        r = self._current.get(model)
        latest = self._index.latest(model)
        if r is None or latest is None or r.version != latest or (r.format, r.scaling) != (format, scaling):
            return Residual(format=format, scaling=scaling)
        if groups is None:
            return r
        held = self._index.find(model, latest)
        if held is None or not held.manifest.parts:
            return Residual(format=format, scaling=scaling)
        holders = holders_by_tensor(held.manifest)
        # A master is held where its elements are (the served naming's inverse: packed codes too).
        elements = {master: served[0] for master, served in served_masters(holders).items()}
        kept = {n: a for n, a in r.tensors.items()
                if n in groups and holders.get(elements.get(n, n)) == groups[n]}
        return Residual(version=r.version, tensors=kept, format=r.format, scaling=r.scaling)

    def stage(self, model: str, step: int, numels: dict[str, int], format: str,
              scaling: str) -> tuple[VersionFile, dict[str, np.ndarray]]:
        """With a data dir: a file for a push's new residual, and each tensor's array mapping it
        (`VersionFiles.stage_residual`). Blocking."""
        assert self._files is not None
        return self._files.stage_residual(model, step, numels, format, scaling)

    def write(self, model: str, residual: Residual, staged: VersionFile | None) -> None:
        """Persist a push's new residual, named by its version, before the version's file: a restart
        pairs it with that version (`VersionFiles.write_residual`). Blocking."""
        assert self._files is not None
        self._files.write_residual(model, residual, staged)

    def committed(self, model: str, residual: Residual) -> None:
        """The version of `residual` committed (or was restored, its file read back at start-up): the
        next `ef` push continues from it."""
        self._current[model] = residual
