"""What the transports hand the service and get back: the requests and answers of `Service`, each
defined once (here, or in the part that owns it and named here).

A transport imports `weightsvc.service.service` and this module, nothing deeper: the parts below the
façade can change without a transport knowing.

The bytes of a pull lie in memory or in a version's file: `Pull` answers them as `Piece`s, a view of
memory or a `FileRange` of an open file, for whichever transport sends them (HTTP's writer threads
and sendfile, gRPC's chunks), by offset or, for a transport that reads a tensor's slices in place, by
tensor and slice (`Pull.pieces`). A transport tells them apart by type, never by where they came from.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsvc.service.pull import Pull
from weightsvc.service.push.messages import PushChunk, PushCommit, PushHeader, PushMessage
from weightsvc.service.versions.acks import ClientStatus
from weightsvc.service.versions.disk import DamagedFile
from weightsvc.service.versions.index import FileRange
from weightsvc.service.versions.mismatch import Reported

Piece = memoryview | FileRange  # a piece of a pull's bytes: a view of memory, or a range of a version's file


@dataclass(frozen=True)
class ModelSummary:
    model: str
    latest_version: int
    versions: list[int]  # retained, oldest first


__all__ = [
    "ClientStatus",
    "DamagedFile",
    "FileRange",
    "ModelSummary",
    "Piece",
    "Pull",
    "PushChunk",
    "PushCommit",
    "PushHeader",
    "PushMessage",
    "Reported",
]
