"""The staging memory of the pushes in progress: each push reserves what it will stage before it
maps anything, against the staging budget (--max-staged-bytes) and the process's memory high-water
mark (--max-rss-bytes)."""

from __future__ import annotations

import heapq

from weightsvc import rounding
from weightsvc.errors import ResourceExhausted
from weightsvc.memory import BufferPool, anonymous_bytes
from weightsvc.service.push.messages import PushHeader
from weightsvc.settings import Settings


class StagingBudget:
    def __init__(self, settings: Settings, pool: BufferPool, in_memory: bool) -> None:
        self.settings = settings
        self.pool = pool  # buffers kept for reuse count in both limits, and go before a refusal
        self.in_memory = in_memory  # no data dir: the served bytes and residuals are staged in memory
        self.reserved = 0

    def needed(self, header: PushHeader) -> int:
        """The memory a push stages: its served bytes (≤ 2 a element in every format) and, with ef, its
        new fp32 residual, unless a data dir takes both; and, in an fp8 format, the fp32 masters
        of the tensors being gathered whole for their scales (at most one a rank at a time: the
        largest 2-D ones bound them)."""
        s = self.settings
        numel = sum(t.numel for t in header.tensors)
        nbytes = numel * 2 if self.in_memory else 0
        if self.in_memory and (header.rounding or s.rounding) == "ef":
            nbytes += numel * 4
        fmt = rounding.FORMATS.get(header.format or s.format)
        if fmt is not None and fmt.scaled:
            matrices = heapq.nlargest(header.world_size, (t.numel for t in header.tensors if len(t.shape) == 2))
            nbytes += 4 * sum(matrices)
        return nbytes

    def reserve(self, where: str, nbytes: int) -> int:
        """Reserve `nbytes`, the memory a push (or a publish: `where` names it) will stage (`needed`), or
        refuse it if over the memory budget."""
        rss, mark, budget = anonymous_bytes(), self.settings.rss_high_water, self.settings.max_staged_bytes
        if (rss + nbytes > mark or self.reserved + nbytes + self.pool.free_bytes > budget) and self.pool.free():
            rss = anonymous_bytes()
        what = "(served bytes, ef residuals and fp8 masters gathered for their scales)"
        if rss + nbytes > mark:
            raise ResourceExhausted(
                f"{where}: this server holds {rss} bytes; staging {nbytes} more "
                f"{what} would pass its memory high-water mark of {mark} bytes (--max-rss-bytes); retry later",
                reason="too_large",
            )
        if self.reserved + nbytes > budget:
            raise ResourceExhausted(
                f"{where}: pushes in progress hold "
                f"{self.reserved} bytes; {nbytes} more {what} would exceed the staging budget of "
                f"{budget} bytes (--max-staged-bytes); retry later",
                reason="too_large",
            )
        self.reserved += nbytes
        return nbytes

    def give_back(self, nbytes: int) -> None:
        self.reserved -= nbytes
