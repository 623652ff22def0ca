"""What a learner rank's push stream carries: its header, its chunks of master bytes, its commit."""

from __future__ import annotations

from dataclasses import dataclass

from weightsvc.protocol.adapter import Adapter
from weightsvc.protocol.manifest import TensorSpec
from weightsvc.service.versions.index import Version

Committed = tuple[Version, bool]  # the committed version, and whether this push created it


@dataclass(frozen=True)
class PushHeader:
    model: str
    step: int
    tensors: tuple[TensorSpec, ...]  # this rank's shards: whole tensors, or flat element ranges of them
    format: str = ""  # per-push override of the server's export; empty: the server's
    rounding: str = ""
    rank: int = 0  # this learner rank, of world_size ranks that push the version together
    world_size: int = 1
    owners: tuple[str, ...] = ()  # sharded replicas: the ids of every replica that holds a part
    replication: int = 1  # sharded replicas: how many of the owners hold each tensor
    aliases: tuple[tuple[str, str], ...] = ()  # tied weights: (alias, tensor), sorted by alias
    adapter: Adapter | None = None  # a version of a LoRA adapter: its base and PEFT config


@dataclass(frozen=True)
class PushChunk:
    tensor: str
    offset: int
    data: bytes | memoryview


@dataclass(frozen=True)
class PushCommit:
    pass


PushMessage = PushHeader | list[PushChunk] | PushCommit  # chunks: the tensors of one wire message
