"""A push's export jobs, run on the export thread: each chunk of master bytes Fair Cast into its slot
of the data section as it arrives, or, for a scaled format, gathered and exported once whole.

bf16/fp16 export is elementwise with the flat element index as a key, so each chunk is exported
into its slot as it arrives and the master is never assembled. fp8 and fp4 tensors need their
scales first: their chunks are gathered and exported once complete. With `ef`, the residual of the
latest committed version is read and a new one written. Each job also takes the chunk's samples
for the lag metrics (`lag_input`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np

from weightsvc import rounding
from weightsvc.protocol.digest import checksum
from weightsvc.protocol.lag import Sample, sampled_indices
from weightsvc.protocol.manifest import ServedTensor
from weightsvc.service.device import Exporter, Resident
from weightsvc.service.push.plan import MASTER_ITEMSIZE, PushedTensor

BATCH_BYTES = 1 << 20  # a chunk below this is small: bf16 ones are exported together (`run`)

JobFn = Callable[[PushedTensor, int, bytes | memoryview], None]  # (tensor, byte offset, master bytes)
Job = tuple[JobFn, PushedTensor, int, bytes | memoryview]


class ExportJobs:
    """The export of one push into its data section. Its methods run on the export thread, one job
    at a time in the order they were queued; `freed` hands bytes no longer held back to the loop."""

    def __init__(self, data: memoryview, spec: rounding.ExportSpec, exporter: Exporter, *, model: str, step: int,
                 stride: int, residual: rounding.Residual | None, freed: Callable[[int], None],
                 batch_small: bool = True) -> None:
        self.data = data
        self.spec = spec
        self.exporter = exporter
        self.model = model
        self.step = step
        self.stride = stride  # of the elements sampled for the lag metrics
        self.residual = residual  # ef: the residual of the version this push continues from
        self.freed = freed
        self.batch_small = batch_small
        # ef on a GPU: the new residual's chunks there, kept for the next push if this one commits.
        self.device_residuals: Resident = {}
        self.seconds = 0.0  # spent exporting, for the metrics

    def _residuals(self, t: PushedTensor) -> tuple[np.ndarray | None, np.ndarray | None]:
        if self.residual is None:
            return None, None
        if t.new_residual is None:
            t.new_residual = np.empty(t.spec.numel, np.float32)
        return self.residual.tensor(t.spec.name, t.spec.numel), t.new_residual

    def _slot_bytes(self, slot: ServedTensor) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.uint8, count=slot.nbytes, offset=slot.offset)

    def run(self, jobs: list[Job]) -> None:
        """A batch of jobs, in order. Its small bf16 chunks (rtn or sr) are exported first, in one
        kernel call: one call each would cost more than their export."""
        small: list[int] = []
        if self.batch_small and self.spec.format == "bf16" and self.spec.rounding != "ef":  # (all bf16, no residual)
            small = [i for i, (job, _, _, data) in enumerate(jobs)
                     if job == self.export_chunk and len(data) < BATCH_BYTES]
        fused = set(small) if len(small) > 1 else set()
        if fused:
            self._export_runs([jobs[i][1:] for i in small])
        for i, (job, t, offset, data) in enumerate(jobs):
            if i not in fused:
                job(t, offset, data)

    def _export_runs(self, runs: list[tuple[PushedTensor, int, bytes | memoryview]]) -> None:
        """`export_chunk` of many small bf16 chunks at once, each kernel call and
        array operation made once for all of them."""
        start = time.perf_counter()
        sizes = np.fromiter((len(data) for _, _, data in runs), np.int64, len(runs)) // MASTER_ITEMSIZE
        starts = np.zeros(len(runs) + 1, np.int64)
        np.cumsum(sizes, out=starts[1:])
        master = np.frombuffer(b"".join(data for _, _, data in runs), np.float32)
        firsts = np.fromiter((offset for _, offset, _ in runs), np.int64, len(runs)) // MASTER_ITEMSIZE
        outs = np.fromiter((t.slot.offset for t, _, _ in runs), np.int64, len(runs)) // 2 + firsts
        served = np.frombuffer(self.data, np.uint16, count=len(self.data) // 2)
        names = [t.spec.name for t, _, _ in runs]
        stats = self.exporter.export_runs(master, starts, served, self.spec, version=self.step, names=names,
                                         offsets=firsts.tolist(), outs=outs)
        # The sampled elements of every run: those whose flat index in their tensor is a multiple of
        # the stride (as `export_chunk` takes them), gathered with one index array.
        skip = -firsts % self.stride
        taken = np.maximum(0, (sizes - skip + self.stride - 1) // self.stride)
        run_of = np.repeat(np.arange(len(runs)), taken)
        within = skip[run_of] + self.stride * (np.arange(run_of.size) - np.repeat(np.cumsum(taken) - taken, taken))
        codes = served[outs[run_of] + within]
        sample = (master[starts[run_of] + within], rounding.decode(codes, rounding.FORMATS["bf16"]),
                  codes.astype(np.uint32))
        bounds = np.cumsum(taken).tolist()
        for j, (t, offset, data) in enumerate(runs):
            t.master_digest.update(offset, data)
            t.nonfinite += stats[j].nonfinite
            t.saturated += stats[j].saturated
            if taken[j]:
                a, b = bounds[j] - int(taken[j]), bounds[j]
                t.samples[int(firsts[j])] = (sample[0][a:b], sample[1][a:b], sample[2][a:b])
            t.exported += len(data)
            if t.exported == t.nbytes:
                t.checksums[t.slot.name] = checksum(self.data[t.slot.offset : t.slot.offset + t.slot.nbytes])
        self.seconds += time.perf_counter() - start

    def export_chunk(self, t: PushedTensor, byte_offset: int, data: bytes | memoryview) -> None:
        """Fair Cast one chunk into the tensor's slot (bf16/fp16)."""
        start = time.perf_counter()
        master = np.frombuffer(data, dtype=np.float32)
        served = self._slot_bytes(t.slot)
        first, count, size = byte_offset // MASTER_ITEMSIZE, master.size, t.fmt.itemsize
        res_in, res_out = self._residuals(t)
        stats = self.exporter.export_array(
            master, served[first * size : (first + count) * size], self.spec, version=self.step,
            name=t.spec.name, fmt=t.fmt, offset=first,
            residual=None if res_in is None else res_in[first : first + count],
            new_residual=None if res_out is None else res_out[first : first + count],
            model=self.model, keep=self.device_residuals,
        )
        t.master_digest.update(byte_offset, data)
        t.served_checksum.update(first * size, served[first * size : (first + count) * size])
        t.nonfinite += stats.nonfinite
        t.saturated += stats.saturated
        skip = -first % self.stride  # the sampled elements of this chunk, as strided views
        if skip < count:
            codes = served[first * size : (first + count) * size].view(np.uint16 if size == 2 else np.uint8)
            codes = codes[skip :: self.stride]
            t.samples[first] = (master[skip :: self.stride].copy(), rounding.decode(codes, t.fmt),
                                codes.astype(np.uint32))
        t.exported += len(data)
        if t.exported == t.nbytes:  # the last chunk of the tensor, from whichever rank
            t.checksums[t.slot.name] = t.served_checksum.value(served)
        self.seconds += time.perf_counter() - start

    def gather_chunk(self, t: PushedTensor, byte_offset: int, data: bytes | memoryview) -> None:
        """Copy a chunk of an fp8 tensor into its gathered master."""
        if t.master is None:
            t.master = np.empty(t.spec.numel, np.float32)
        t.master.view(np.uint8)[byte_offset : byte_offset + len(data)] = np.frombuffer(data, np.uint8)
        t.master_digest.update(byte_offset, data)

    def export_fused(self, t: PushedTensor, _offset: int, _data: bytes | memoryview) -> None:
        """Export the tensors that share t's global scale, from the max |value| over all of
        them (of m + e with ef, as the export quantizes)."""
        assert t.fused is not None
        values = []
        for member in t.fused.members:
            res_in, _ = self._residuals(member)
            master = member.master if member.master is not None else np.empty(0, np.float32)
            values.append(master if res_in is None else master + res_in)
        top = rounding.group_amax(values)
        for member in t.fused.members:
            self.export_whole(member, 0, b"", top)

    def export_whole(self, t: PushedTensor, _offset: int, _data: bytes | memoryview,
                      group_amax: float | None = None) -> None:
        """Scales from the whole tensor, then Fair Cast it and serve the scales."""
        start = time.perf_counter()
        master = t.master if t.master is not None else np.empty(0, np.float32)
        res_in, res_out = self._residuals(t)
        served = self._slot_bytes(t.slot)
        stats, scales = self.exporter.export_whole(
            master, served, self.spec, version=self.step, name=t.spec.name, fmt=t.fmt, shape=t.spec.shape,
            residual=res_in, new_residual=res_out, model=self.model, keep=self.device_residuals,
            group_amax=group_amax,
        )
        t.checksums[t.slot.name] = checksum(served)
        for slot, array in zip(t.scales, rounding.served_scales(scales, t.fmt), strict=True):
            scale_bytes = self._slot_bytes(slot)
            scale_bytes[:] = array.view(np.uint8)
            t.checksums[slot.name] = checksum(scale_bytes)
        t.nonfinite += stats.nonfinite
        t.saturated += stats.saturated
        idx = sampled_indices(0, master.size, self.stride)
        # An element's code: its byte, or its nibble of a packed byte (element 2i in the low one).
        codes = (served[idx >> 1] >> ((idx & 1) << 2).astype(np.uint8)) & 0xF if t.fmt.packed else served[idx]
        served_values = rounding.decode(codes, t.fmt) * rounding.element_scales(scales, idx)
        t.samples[0] = (master[idx], served_values.astype(np.float32), codes.astype(np.uint32))
        t.master = None
        self.freed(t.nbytes)  # the gathered master
        self.seconds += time.perf_counter() - start

    def lag_input(self, tensors: Mapping[str, PushedTensor]) -> tuple[Sample, int, bool] | None:
        """The lag metrics' input: the sampled elements, the saturated count, whether every element
        was sampled. By name, then element: it depends neither on the order chunks arrived in nor on
        the order the ranks declared the tensors in."""
        if not tensors:  # (a replica part without tensors)
            return None
        sampled = [tensors[n].samples[first] for n in sorted(tensors) for first in sorted(tensors[n].samples)]
        sample = Sample(*(_concatenate([p[i] for p in sampled], dt)
                          for i, dt in enumerate((np.float32, np.float32, np.uint32))))
        return sample, sum(t.saturated for t in tensors.values()), self.stride == 1


CONCAT_SLICE = 8192  # arrays joined by one call: each call holds the GIL (a few milliseconds at most)


def _concatenate(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    """`np.concatenate(arrays)`, in slices: one call over the samples of 400,000 tensors holds the GIL,
    and so the event loop, for 0.15 s."""
    out: np.ndarray = np.empty(sum(len(a) for a in arrays), dtype)
    at = 0
    for i in range(0, len(arrays), CONCAT_SLICE):
        part = arrays[i : i + CONCAT_SLICE]
        n = sum(len(a) for a in part)
        np.concatenate(part, out=out[at : at + n])  # (into place: no copy of each slice first)
        at += n
    return out
