"""Where a push's export runs: the CPU kernels, or the Triton kernels on a GPU (`--device`).

Both take the same arguments as `rounding.export_array` (host arrays: the chunk as received, the
served bytes' slot in the version, the ef residuals the service keeps) and give the same bits, so
the staging code does not change with the device. On a GPU, each call copies the master (and the
residual) in through pinned buffers on the service's CUDA stream, runs the kernel, and copies the
served bytes (and the new residual) back; the bytes the GPU holds meanwhile are reported
(`weightsvc_gpu_staged_bytes`). With ef, a committed version's residual also stays on the GPU for
the next push (`Exporter.resident`).

With `TRITON_INTERPRET=1` (Triton's own interpreter), `--device cuda` runs the same device code on
CPU tensors: that is how it is tested on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from weightsvc import rounding
from weightsvc.errors import Unavailable

if TYPE_CHECKING:
    import torch

log = logging.getLogger("weightsvc.device")


class HostBuffers:
    """Reusable host buffers that chunks pass through on their way to and from the GPU. On a GPU they
    are pinned (page-locked), so each copy is a DMA at the bus's speed, asynchronous on the export
    stream; from pageable memory the driver would stage every copy through a bounce buffer of its
    own. Sizes are rounded up to a power of two so that chunks of one push reuse the same buffers;
    at most `max_bytes` are kept for reuse."""

    def __init__(self, pin: bool, max_bytes: int = 256 << 20) -> None:
        self.pin = pin
        self.max_bytes = max_bytes
        self.free: dict[int, list[torch.Tensor]] = {}
        self.kept = 0  # bytes of the free buffers

    def take(self, nbytes: int) -> torch.Tensor:
        import torch

        size = 1 << max(12, (nbytes - 1).bit_length())
        free = self.free.get(size)
        if free:
            self.kept -= size
            return free.pop()[:nbytes]
        # One larger than all the kept buffers together (a whole fp8 tensor) is not pinned: pinning
        # costs more than it saves on a buffer used once.
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin and size <= self.max_bytes)[:nbytes]

    def give(self, buf: torch.Tensor) -> None:
        whole = buf._base if buf._base is not None else buf
        size = whole.numel()
        if self.kept + size <= self.max_bytes:
            self.free.setdefault(size, []).append(whole)
            self.kept += size


# An ef residual chunk kept on the GPU: the host array it equals (held, so that its memory is not
# reused while the entry lives) and its copy on the device, by the host array's address.
Resident = dict[int, tuple[np.ndarray, "torch.Tensor"]]


def _nbytes(resident: Resident) -> int:
    return sum(host.nbytes for host, _ in resident.values())


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


@dataclass
class Exporter:
    """The export on one device and its state: the GPU's resident ef residuals, its staging buffers,
    whether it failed. `name`: what the ready line and /readyz say (no spaces)."""

    name: str = "cpu"
    torch_device: str = ""  # "" for the CPU kernels; "cuda" (or "cpu" under the interpreter) for Triton
    staged: Callable[[int], None] = lambda n: None  # bytes the device holds for exports in progress
    failed: bool = False  # a GPU error happened: the service goes back to the CPU kernels
    # ef: each model's residual of its latest version, kept on the GPU so that the next push does
    # not copy it in again (it is on the host too, where it is persisted). Bounded by `resident_max`.
    resident: dict[str, Resident] = field(default_factory=dict)
    resident_max: int = 0
    resident_bytes: Callable[[int], None] = lambda n: None
    residual_found: Callable[[str], None] = lambda source: None  # "device" or "host", per ef chunk
    _buffers: HostBuffers | None = field(default=None, repr=False)
    _stream: Any = field(default=None, repr=False)
    _in_flight: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list, repr=False)

    @property
    def on_gpu(self) -> bool:
        return bool(self.torch_device)

    def export_array(self, master: np.ndarray, out: np.ndarray, spec: rounding.ExportSpec, *, version: int, name: str,
                     fmt: rounding.Format, offset: int = 0, scales: rounding.Scales | None = None,
                     residual: np.ndarray | None = None, new_residual: np.ndarray | None = None,
                     model: str = "", keep: Resident | None = None) -> rounding.ExportStats:
        """`rounding.export_array` on this device: the same bits. With ef on a GPU, the residual is
        taken from `model`'s resident one when it holds this chunk, and the new residual is recorded
        in `keep` (the push's, made resident if it commits: `keep_resident`)."""
        if not self.on_gpu:
            return rounding.export_array(master, out, spec, version=version, name=name, fmt=fmt, offset=offset,
                                         scales=scales, residual=residual, new_residual=new_residual)
        return self._export(master, out, spec, version, name, fmt, offset, scales, None, residual, new_residual,
                            model, keep)[0]

    def export_whole(self, master: np.ndarray, out: np.ndarray, spec: rounding.ExportSpec, *, version: int,
                     name: str, fmt: rounding.Format, shape: tuple[int, ...], residual: np.ndarray | None = None,
                     new_residual: np.ndarray | None = None, model: str = "", keep: Resident | None = None,
                     group_amax: float | None = None) -> tuple[rounding.ExportStats, rounding.Scales]:
        """A whole scaled tensor of this `shape`: its scales from the master (plus the ef residual: ef
        quantizes m + e), computed where the export runs, then its export. Returns the scales too.
        `group_amax`: NVFP4's global scale from the max |value| of the tensors that share it."""
        if not self.on_gpu:
            values = master if residual is None else master + residual
            scales = rounding.fp8_scales(values.reshape(shape), fmt, spec.scaling, group_amax)
            stats = rounding.export_array(master, out, spec, version=version, name=name, fmt=fmt, scales=scales,
                                          residual=residual, new_residual=new_residual)
            return stats, scales
        return self._export(master, out, spec, version, name, fmt, 0, None, (shape, group_amax), residual,
                            new_residual, model, keep)

    def _export(self, master: np.ndarray, out: np.ndarray, spec: rounding.ExportSpec, version: int, name: str,
                fmt: rounding.Format, offset: int, scales: rounding.Scales | None,
                whole: tuple[tuple[int, ...], float | None] | None,
                residual: np.ndarray | None, new_residual: np.ndarray | None, model: str,
                keep: Resident | None) -> tuple[rounding.ExportStats, rounding.Scales]:
        """The GPU side of `export_array` and `export_whole` (with `whole`, the tensor's shape and group max:
        the scales computed here)."""
        import torch

        if whole is None:  # (a whole tensor's scales are computed below)
            rounding.check_export(master, out, spec, fmt, name=name, offset=offset, scales=scales,
                                  residual=residual, new_residual=new_residual)
        ef = spec.rounding == "ef" and residual is not None
        counted = np.zeros(2, np.int64)
        with self._on_device(f"tensor {name!r}", master.nbytes * (3 if ef else 1) + out.nbytes) as dev:
            m = self._upload(master, dev).view(torch.float32)
            served = torch.empty(out.nbytes, dtype=torch.uint8, device=dev)
            res_in = res_out = None
            if ef and residual is not None:
                res_in = self._resident(model, residual)
                self.residual_found("host" if res_in is None else "device")
                if res_in is None:
                    res_in = self._upload(residual, dev).view(torch.float32)
                res_out = torch.empty_like(m)
            if whole is not None:  # the maxima on the GPU, exact, so the scales are the CPU's
                shape, group_amax = whole
                scales = rounding.fp8_scales_torch((m if res_in is None else m + res_in).reshape(shape), fmt,
                                                   spec.scaling, group_amax)
            sc = scales or rounding.Scales(np.ones(1, np.float32))
            counts = rounding.export_tensor(m, served, spec, fmt, version=version, name=name, offset=offset,
                                            scales=scales, residual=res_in, new_residual=res_out)
            # Into the version's slot (and the residual the service persists), with the counters.
            self._download(served, out)
            self._download(counts, counted)
            if res_out is not None and new_residual is not None:
                self._download(res_out, new_residual)
                if keep is not None:
                    keep[_address(new_residual)] = (new_residual, res_out)
        return rounding.ExportStats(int(counted[0]), int(counted[1])), sc

    def export_runs(self, master: np.ndarray, starts: np.ndarray, served: np.ndarray, spec: rounding.ExportSpec, *,
                    version: int, names: list[str], offsets: list[int],
                    outs: np.ndarray) -> list[rounding.ExportStats]:
        """`rounding.export_runs` on this device. On a GPU the runs (small tensors) go in with one
        copy, are exported by one kernel launch (each run with its own keys) and come back with one
        copy: a launch and a wait per small tensor would cost more than its export."""
        if not self.on_gpu:
            return rounding.export_runs(master, starts, served, spec, version=version, names=names, offsets=offsets,
                                        outs=outs)
        import torch

        keys = rounding.run_keys(master, starts, spec, version, names, outs)
        counts = np.zeros((len(names), 2), np.int64)
        codes = np.empty(master.size, np.uint16)
        with self._on_device(f"tensors {names[0]!r} and {len(names) - 1} more", master.nbytes * 3 // 2) as dev:
            m = self._upload(master, dev).view(torch.float32)
            bits = torch.empty(master.size, dtype=torch.int16, device=dev)
            on_gpu = rounding.export_runs_tensor(m, bits, spec, starts=starts, offsets=offsets, keys=keys)
            self._download(bits, codes)
            self._download(on_gpu, counts)
        for j in range(len(names)):
            a, b = int(starts[j]), int(starts[j + 1])
            served[int(outs[j]) : int(outs[j]) + b - a] = codes[a:b]
        return [rounding.ExportStats(int(nf), int(sat)) for nf, sat in counts.tolist()]

    def keep_resident(self, model: str, keep: Resident) -> None:
        """A push of `model` committed: its new residuals, recorded by `export_array`, replace the
        model's resident ones (those beyond `resident_max` bytes are dropped: read from the host)."""
        self.resident_bytes(-_nbytes(self.resident.pop(model, {})))
        room = self.resident_max - sum(_nbytes(r) for r in self.resident.values())
        kept: Resident = {}
        for address, (host, on_gpu) in keep.items():
            if host.nbytes <= room:
                kept[address] = (host, on_gpu)
                room -= host.nbytes
        if kept:
            self.resident[model] = kept
            self.resident_bytes(_nbytes(kept))

    def _resident(self, model: str, residual: np.ndarray) -> torch.Tensor | None:
        """The GPU copy of this residual chunk, if `model`'s resident residual holds exactly it."""
        entry = self.resident.get(model, {}).get(_address(residual))
        if entry is None or entry[0].nbytes != residual.nbytes:
            return None
        return entry[1]

    def _upload(self, host: np.ndarray, dev: torch.device) -> torch.Tensor:
        """`host`'s bytes on the GPU: on a GPU through a pinned buffer, asynchronous on the export stream."""

        assert self._buffers is not None
        src = host.reshape(-1).view(np.uint8)  # (read-only, as received: copied by numpy, not wrapped by torch)
        buf = self._buffers.take(src.size)
        buf.numpy()[:] = src
        self._in_flight.append((buf, None))  # given back once the stream has copied it
        return buf.to(dev, non_blocking=True, copy=True)

    def _download(self, on_gpu: torch.Tensor, host: np.ndarray) -> None:
        """The GPU tensor's bytes into `host` (same size): on a GPU through a pinned buffer, copied
        into `host` once the stream is done (`_on_device`)."""
        import torch

        dst = torch.from_numpy(host.reshape(-1).view(np.uint8))
        src = on_gpu.reshape(-1).view(torch.uint8)
        assert self._buffers is not None
        buf = self._buffers.take(dst.numel())
        buf.copy_(src, non_blocking=True)
        self._in_flight.append((buf, dst))

    def _wait(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    @contextlib.contextmanager
    def _on_device(self, what: str, nbytes: int) -> Iterator[torch.device]:
        """An export on the GPU, on the export stream, holding `nbytes` there meanwhile: the copies
        and kernels are queued, and one wait at the end hands the results over. Any error in it
        refuses the push and sends the next ones to the CPU."""
        import torch

        self.staged(nbytes)
        try:
            dev = torch.device(self.torch_device)
            cuda = dev.type == "cuda"  # (else Triton's interpreter: CPU tensors, no stream, unpinned buffers)
            if self._buffers is None:
                self._buffers = HostBuffers(pin=cuda)
                self._stream = torch.cuda.Stream() if cuda else None
            try:
                with torch.cuda.stream(self._stream) if cuda else contextlib.nullcontext():
                    yield dev
                self._wait()
                for buf, dst in self._in_flight:
                    if dst is not None:
                        dst.copy_(buf)
            finally:
                self._wait()  # (after an error too: a buffer goes back only once the stream is done with it)
                for buf, _ in self._in_flight:
                    self._buffers.give(buf)
                self._in_flight.clear()
        except Exception as e:
            self.failed = True
            raise Unavailable(f"{what}: the export on {self.name} failed ({type(e).__name__}: {e}); this push is "
                              "refused, the next ones export on the CPU") from e
        finally:
            self.staged(-nbytes)


def exporter_for(setting: str, staged: Callable[[int], None] = lambda n: None, **residuals: Any) -> Exporter:
    """The kernels `--device` asks for (`rounding.export_device`): `cpu`; `cuda` (refused with a
    clear error when no GPU is visible, or Triton is missing); `auto`: the GPU when one is visible,
    else the CPU. `residuals`: the GPU's bound and counters of its resident ef residuals (`Exporter`)."""
    where = rounding.export_device(setting)
    if where == "cuda":
        import torch

        log.info("exporting on %s", torch.cuda.get_device_name())
        return Exporter(f"cuda:{torch.cuda.current_device()}", "cuda", staged, **residuals)
    if where == "interpreted":
        log.info("exporting with the Triton kernels on the CPU (TRITON_INTERPRET=1): for tests")
        return Exporter("cuda-interpreted", "cpu", staged, **residuals)
    return Exporter("cpu", "", staged, **residuals)
