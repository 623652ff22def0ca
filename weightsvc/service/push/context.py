"""What a push needs from the server around it, handed down by the service: nothing more.

The push package never sees the `Service`: a push reads its settings and limits here, counts in
these metrics, exports on this executor with this exporter, stages in this pool or these files and
commits through this committer. Tests build one without a server, and inject faults through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from weightsvc import memory
from weightsvc.metrics import Metrics
from weightsvc.service.device import Exporter
from weightsvc.service.push.messages import PushChunk
from weightsvc.service.replicas.parts import Parts
from weightsvc.service.versions.commit import Committer
from weightsvc.service.versions.disk import VersionFiles
from weightsvc.service.versions.index import VersionIndex
from weightsvc.settings import Settings


def _nothing() -> None:
    pass


@dataclass
class PushContext:
    settings: Settings
    metrics: Metrics
    executor: Executor  # the export thread (one: a tensor's chunks are exported in order)
    loop: asyncio.AbstractEventLoop  # the loop the pushes run on, for the export thread's callbacks
    exporter: Callable[[], Exporter]  # the exporter a new push exports with (they change after a GPU error)
    pool: memory.BufferPool  # buffers kept for reuse; they count in the staging budget
    files: VersionFiles | None  # the data dir's files; None: versions are staged in memory
    committer: Committer
    parts: Parts  # a sharded replica's parts of versions, and this replica's id
    index: VersionIndex  # the committed versions: the latest a push continues from, the models held
    changed: Callable[[], None] = _nothing  # a push opened or released its staging
    # Where the faults of tests go in; the defaults are the real thing.
    alloc: Callable[[int], memoryview] = memory.alloc  # maps a staging buffer of that many bytes
    on_chunks: Callable[[int, Sequence[PushChunk]], None] | None = None  # sees each rank's chunks first
    batch_small: bool = True  # small bf16 chunks exported in one kernel call (False: one call each)
