"""`LearnerClient`, the base of each transport's learner: pushes fp32 masters (torch tensors or numpy
arrays), to one replica or sharded over several, over the transport's calls."""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Union

import numpy as np

from weightsvc.client._base import InferenceClient
from weightsvc.client._common import Credentials, Progress, RetryPolicy, VersionInfo
from weightsvc.client._targets import ByTarget
from weightsvc.errors import Unavailable, WeightsvcError, subject
from weightsvc.protocol.adapter import Adapter
from weightsvc.protocol.manifest import MASTER_DTYPE
from weightsvc.protocol.mismatch import RolloutMismatch
from weightsvc.protocol.published import RankPublish
from weightsvc.protocol.topology import Replica, groups
from weightsvc.protocol.wire import MESSAGE_PIECE_BYTES, adapter_to_proto, chunk_pieces, piece_starts
from weightsvc.rounding import ExportSpec
from weightsvc.v1 import weightsvc_pb2 as pb

if TYPE_CHECKING:
    import torch

    from weightsvc.client._rank_lag import RankLag

DEFAULT_CHUNK_BYTES = 1 << 20
# Masters are fp32; bf16/fp16 widen to fp32 exactly, anything else would change the values.
_EXACT_TO_F32 = ("float32", "bfloat16", "float16")
Array = Union["torch.Tensor", np.ndarray]

# Asking the deployment its topology is idempotent: asked again when the connection breaks off before the
# answer (a server at its connection limit resets new connections; a restart), as a pull resumes.
TOPOLOGY_RETRY = RetryPolicy()


@dataclass(frozen=True)
class Shard:
    """The flat elements `[offset, offset + data.numel())` of a tensor of full `shape`, in row-major
    order: the part one learner rank holds (an FSDP flat-parameter slice, a dim-0 block of a
    tensor-parallel weight). The ranks' shards of a tensor must cover it exactly once. `data` is a
    torch tensor or a numpy array."""

    data: Array
    offset: int
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))


# replica id ("": the target), its header and parts
Stream = tuple[str, pb.PushHeader, dict[str, "Array | Shard"]]
Message = Sequence[bytes | memoryview]  # a serialized PushRequest, in pieces (a chunk's framing, then its data)


class ReplicaDown(Exception):
    """A push stream failed because its replica could not be reached."""

    def __init__(self, replica: str, error: WeightsvcError) -> None:
        super().__init__(replica)
        self.replica, self.error = replica, error


def _is_torch(value: object) -> bool:
    torch = sys.modules.get("torch")  # not imported: then `value` cannot be a tensor
    return torch is not None and isinstance(value, torch.Tensor)


def _check_master(name: str, array: object) -> None:
    """Raise, naming the tensor, unless `array` is a torch tensor or numpy array that widens to fp32 exactly."""
    if not (_is_torch(array) or isinstance(array, np.ndarray)):
        raise TypeError(f"tensor {name!r} is a {type(array).__name__}; push torch tensors or numpy arrays")
    dtype = array.dtype  # type: ignore[attr-defined]
    if str(dtype).removeprefix("torch.") not in _EXACT_TO_F32:
        raise TypeError(f"tensor {name!r} is {dtype}; push float32 masters (bf16/fp16 widen exactly)")


def _master_bytes(array: Array) -> memoryview:
    """The little-endian fp32 bytes of a master (checked by `_spec`), flat, on the CPU."""
    if isinstance(array, np.ndarray):
        return np.ascontiguousarray(array, dtype="<f4").reshape(-1).view(np.uint8).data
    import torch

    if array.dtype == torch.float32 and array.device.type == "cpu" and array.is_contiguous():
        return array.detach().numpy().reshape(-1).view(np.uint8).data  # (no copy, few torch calls)
    return array.detach().to("cpu", torch.float32).contiguous().reshape(-1).view(torch.uint8).numpy().data


def _numel(array: Array) -> int:
    return int(array.size) if isinstance(array, np.ndarray) else array.numel()


def _spec(name: str, value: Array | Shard) -> pb.TensorSpec:
    if not isinstance(value, Shard):
        _check_master(name, value)
        return pb.TensorSpec(name=name, shape=list(value.shape), dtype=MASTER_DTYPE)
    _check_master(name, value.data)
    numel, count = math.prod(value.shape), _numel(value.data)
    if value.offset < 0 or value.offset + count > numel:
        raise ValueError(
            f"shard of tensor {name!r}: elements [{value.offset}, {value.offset + count}) are not within "
            f"its shape {list(value.shape)} ({numel} elements)"
        )
    part = pb.TensorPart(offset=value.offset, count=count)
    return pb.TensorSpec(name=name, shape=list(value.shape), dtype=MASTER_DTYPE, part=part)


def _storage(value: Array | Shard) -> tuple[object, ...] | None:
    """What identifies the memory a whole tensor views: equal for two names of one tied tensor."""
    if isinstance(value, Shard):
        return None
    if isinstance(value, np.ndarray):
        return ("numpy", value.__array_interface__["data"][0], value.shape, value.strides, value.dtype.str)
    if value.is_meta or value.numel() == 0:
        return None
    return ("torch", value.device, value.data_ptr(), value.shape, value.stride(), value.dtype)


def _equal(a: Array, b: Array) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    return a.shape == b.shape and bool((a == b).all())


def untie(parts: Mapping[str, Array | Shard], tied: Mapping[str, str] | None = None
          ) -> tuple[dict[str, Array | Shard], dict[str, str]]:
    """The parts to push, each tied tensor once, and the aliases (alias -> pushed name).

    Whole tensors that view the same memory (`lm_head.weight` and `embed_tokens.weight` of a
    module with tied embeddings) are one tensor: the first name keeps it. `tied` declares ties by
    name (alias -> tensor), as a model's config does: the tensor is pushed under the tensor's name
    whichever of the two names `parts` holds it under, and both must not differ."""
    kept: dict[str, Array | Shard] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple[object, ...], str] = {}  # memory -> the first name that views it
    for name, value in parts.items():
        key = _storage(value)
        if key is not None and key in first:
            aliases[name] = first[key]
        else:
            kept[name] = value
            if key is not None:
                first[key] = name
    for alias, target in (tied or {}).items():
        target = aliases.get(target, target)
        if alias == target or aliases.get(alias) == target:
            continue
        if alias in aliases:
            raise ValueError(f"tensor {alias!r} is declared tied to {target!r} but shares its memory with "
                             f"{aliases[alias]!r}")
        if alias in kept:
            value = kept.pop(alias)
            other = kept.setdefault(target, value)  # pushed under the tensor's own name
            if not (isinstance(value, Shard) or isinstance(other, Shard) or _equal(value, other)):
                raise ValueError(f"tensors {alias!r} and {target!r} are declared tied but their values differ")
        for name, to in aliases.items():  # aliases of the alias follow it
            if to == alias:
                aliases[name] = target
        aliases[alias] = target
    return kept, aliases


Messages = Callable[[pb.PushHeader, dict[str, "Array | Shard"], list[threading.Thread]], Iterator[Message]]


class Deployment(Protocol):
    """The replicas a learner pushes to, as its transport reaches them."""

    replication: int  # how many replicas hold each tensor
    left_out: dict[str, float]  # replicas a push could not reach -> until when to leave them out

    def live(self) -> list[Replica]: ...
    def leave_out(self, replica_id: str) -> None: ...
    def close(self) -> None: ...


# Tensors (or a rank's parts of them) this small travel packed, several to a chunk (Chunk in the proto).
PACK_BYTES = 64 << 10


class LearnerClient(ByTarget):
    """Pushes fp32 masters to weightsvc over gRPC (`host:port`, `grpcs://`) or HTTP (`http://`, `https://`).

    `LearnerClient(target)` returns the transport's learner (`GrpcLearnerClient` or
    `HttpLearnerClient`, picked by `weightsvc.client._targets`); each is a `LearnerClient`."""

    family = "learner"
    _replicas: Deployment  # set by each transport's learner

    def __init__(
        self,
        target: str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout: float | None = None,
        token: str | None = None,
        ca_cert: str | Path | bytes | None = None,
    ) -> None:
        """`target`: `host:port`, or `grpcs://host:port` for TLS (`ca_cert`: a PEM bundle to trust);
        `http://host:port` or `https://host:port` to push over HTTP (POST /v1/models/{model}/push: the
        same messages; a deployment of one replica). `token`: a bearer token with role push (default:
        $WEIGHTSVC_TOKEN)."""
        self.target = target
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self.credentials = Credentials.resolve(token, ca_cert)

    # ---- the transport's part (each transport's learner defines these) -------------------------

    def _push_streams(self, streams: list[Stream], messages: Messages) -> VersionInfo:
        """Run push streams at once (one per replica). A replica that cannot be reached raises
        `ReplicaDown`."""
        raise NotImplementedError

    def _committed(self, model: str, step: int, owners: list[str]) -> VersionInfo | None:
        """The version `step` if a push to `owners` committed it (None: not known)."""
        raise NotImplementedError

    def _report(self, model: str, by_version: Mapping[int, RolloutMismatch],
                step: int | None) -> dict[int, RolloutMismatch]:
        """Send a mismatch report (its values checked); each version's accumulated mismatch."""
        raise NotImplementedError

    def _publish(self, request: RankPublish) -> VersionInfo:
        """Send a rank's publish; the committed version once every rank is in and the service copied it."""
        raise NotImplementedError

    # ---- push ----------------------------------------------------------------------------------

    def push(
        self,
        step: int,
        parts: Mapping[str, Array | Shard],
        model: str = "default",
        *,
        rank: int = 0,
        world_size: int = 1,
        format: str = "",
        rounding: str = "",
        return_served: bool = False,
        progress: Progress | None = None,
        tied: Mapping[str, str] | None = None,
        adapter: Adapter | None = None,
    ) -> VersionInfo:
        """Stream the masters of `step`; returns once the version is committed (or raises).

        `parts` maps tensor names to whole tensors or `Shard`s: torch tensors or numpy arrays
        (float32; bf16 and fp16 widen exactly), bit for bit the same push either way.
        With `world_size` > 1 each learner rank calls this with its own `rank` and parts,
        concurrently; every call returns once the whole version commits, or raises if any rank
        fails (nothing is then visible).
        `format` / `rounding` override the server's export for this push (empty: the server's).
        `return_served` pulls the committed version back into `.served`: the exact bits the fleet
        runs, for computing the loss on them (with `ef` and fp8 that includes the server's residual).

        When the deployment has several replicas (sharded, sharing a Redis registry), each tensor goes
        to the replicas that own it by rendezvous hashing of its name (as many as the deployment's
        replication), all replicas at once; the version commits when every replica has its part, and
        nothing is visible if one fails. A replica that cannot be reached (down, or killed during the
        push) is left out and the push is made again to the others, which still hold every tensor
        while fewer replicas than the replication are down.

        Tied weights travel once: tensors that share memory, and the names `tied` declares tied
        (alias -> tensor, e.g. `{"lm_head.weight": "model.embed_tokens.weight"}`), are pushed as one
        tensor and served under every name, bit for bit the same (see `untie`). With several ranks,
        declare ties with `tied` on every rank.

        `adapter` makes the version one of a LoRA adapter (`parts`: PEFT's `lora_A` / `lora_B`
        tensors): the base it applies to and its PEFT config go into the manifest, and the version is
        served in the unscaled format (see `ExportSpec.unscaled`)."""
        specs = {name: _spec(name, value) for name, value in parts.items()}  # bad input raises here, named
        parts, aliases = untie(parts, tied)
        if world_size == 1:  # (another rank may hold the tensor of a declared tie)
            aliases = {a: t for a, t in aliases.items() if t in parts}
        header = pb.PushHeader(model=model, step=step, format=format, rounding=rounding, rank=rank,
                               world_size=world_size,
                               adapter=None if adapter is None else adapter_to_proto(adapter))
        where = subject(model, step=step)
        while True:
            replicas = TOPOLOGY_RETRY.run(self._replicas.live)
            if not replicas and self._replicas.left_out:
                raise Unavailable(f"{where}: no replica of the deployment can be reached (left out: "
                                  f"{sorted(self._replicas.left_out)})")
            if len(replicas) <= 1 and not self._replicas.left_out:
                whole = pb.PushHeader()
                whole.CopyFrom(header)  # (without the owners of an earlier try to several replicas)
                whole.ClearField("owners")
                whole.replication = 0
                whole.aliases.update(aliases)
                streams: list[Stream] = [("", whole, dict(parts))]
            else:
                streams = self._sharded(header, parts, aliases, replicas)
            try:
                info = self._push_streams(streams, self._messages_of(specs, progress))
                break
            except ReplicaDown as down:
                # Committed all the same (the replica went down after the last part was in)?
                committed = self._committed(model, step, [s[0] for s in streams])
                if committed is not None:
                    info = committed
                    break
                self._replicas.leave_out(down.replica)
                if len(replicas) <= 1:
                    raise down.error from None
        if return_served:
            credentials = self.credentials
            with InferenceClient(self.target, timeout=self.timeout, token=credentials.token or "",
                                 ca_cert=credentials.ca) as puller:
                info = dataclasses.replace(info, served=puller.pull(info.model, info.version))
        return info

    def publish(
        self,
        step: int,
        served: Mapping[str, torch.Tensor | Shard],
        model: str = "default",
        *,
        rank: int = 0,
        world_size: int = 1,
        spec: ExportSpec | None = None,
        master_digest: str = "",
        tied: Mapping[str, str] | None = None,
        masters: Mapping[str, Array | Shard] | None = None,
        lag: RankLag | None = None,
    ) -> VersionInfo:
        """Publish the served copy of `step` from this rank's memory (`serve --nixl`): no master travels.
        Returns once the version is committed (or raises); the tensors must stay unchanged until then,
        and may be reused after.

        `served` maps served tensor names to contiguous torch tensors in host memory, in their served
        dtypes, or `Shard`s of them (this rank's flat elements of each; the ranks' shards of a tensor
        cover it exactly once): the copy exported with `spec` (None: bf16 sr seed 0, the server's
        defaults), which must be the server's, e.g. `fair_cast.served_state_dict(module, spec,
        version=step)`, whose tied tensors are published once and served under each name. Each tensor
        is registered with this process's NIXL agent and its checksum sent; the service READs every
        rank's bytes, checks them, and commits the version as a push does. With `world_size` > 1 each
        rank calls this with its own `rank`, every rank declaring every tensor; every call returns
        once the whole version commits, or raises if any rank fails (nothing is then visible).
        `master_digest`: the masters' digest (`fair_cast.masters_digest_of`), recorded in the manifest.
        `tied` declares ties by name (alias -> tensor), as for `push`: the tensor is published once and
        served under both names; ranks that hold `Shard`s of a tied tensor (FSDP2's `rank_served`)
        declare it with `tied` on every rank, as tensors viewing one memory are found by themselves.

        `masters` and `lag` (a `RankLag`, one per rank kept across the run): the version's lag metrics,
        measured here on this rank's masters of the elements it publishes (by master name, whole or
        `Shard`s as `push` takes them: FSDP2's `rank_shards`) as the service measures a push, and added
        up across ranks by the service; the version then lists them, `/metrics` shows them, and the
        answer's `.lag` holds them. Without them (on any rank) the version has no lag. `lag` advances
        only once the version commits.

        FAILED_PRECONDITION from a server without --nixl, or with another spec; the request is one
        message: a rank of too many tensors for one is refused before it is sent."""
        from weightsvc.client._nixl_publish import published
        from weightsvc.client._rank_lag import measure

        if (masters is None) != (lag is None):
            raise ValueError(f"{subject(model, step=step, rank=rank)}: the lag of a publish needs both masters= and "
                             "lag= (a RankLag kept across the run)")
        spec = spec or ExportSpec()
        kept, aliases = untie(served, tied)
        held = {name: (v.data, v.offset, v.shape) if isinstance(v, Shard) else (v, 0, None) for name, v in kept.items()}
        sums = rows = None
        if masters is not None and lag is not None:
            mine, _ = untie(masters, tied)
            sums, rows = measure(lag, step, {name: (v.data, v.offset, v.shape) if isinstance(v, Shard) else (v, 0, None)
                                             for name, v in mine.items()}, held, spec,
                                 where=subject(model, step=step, rank=rank), aliases=aliases)
        with published(held, model=model, step=step, rank=rank, world_size=world_size, spec=spec,
                       master_digest=master_digest, aliases=aliases) as request:
            info = self._publish(dataclasses.replace(request, lag=sums))
        if lag is not None and rows is not None:
            lag.rows = rows
        return info

    def _sharded(self, header: pb.PushHeader, parts: dict[str, Array | Shard], aliases: dict[str, str],
                 replicas: list[Replica]) -> list[Stream]:
        """One stream per replica, each with the tensors it owns (and the aliases of those)."""
        replication = min(self._replicas.replication, len(replicas))
        of = groups([*parts, *aliases.values()], [r.id for r in replicas], replication)
        header.ClearField("owners")
        header.owners.extend(r.id for r in replicas)
        header.replication = replication
        streams: list[Stream] = []
        for r in replicas:
            mine = {n: v for n, v in parts.items() if r.id in of[n]}
            own = pb.PushHeader()
            own.CopyFrom(header)
            own.aliases.update({a: t for a, t in aliases.items() if r.id in of[t]})  # (whichever rank holds t)
            streams.append((r.id, own, mine))
        return streams

    def _messages_of(self, specs: dict[str, pb.TensorSpec], progress: Progress | None) -> Messages:
        """The messages of each push stream, given its header and parts."""

        def messages(header: pb.PushHeader, parts: dict[str, Array | Shard], senders: list[threading.Thread]
                     ) -> Iterator[Message]:
            return self._messages(header, parts, specs, progress, senders)

        return messages

    def _messages(
        self, header: pb.PushHeader, parts: dict[str, Array | Shard], specs: dict[str, pb.TensorSpec],
        progress: Progress | None, senders: list[threading.Thread],
    ) -> Iterator[Message]:
        senders.append(threading.current_thread())
        # (a tied tensor pushed under its alias goes under the tensor's own name: `untie`)
        declared = [specs.get(name) or _spec(name, value) for name, value in parts.items()]
        full = pb.PushHeader()
        full.CopyFrom(header)
        starts = piece_starts((len(s.name) + 12 * len(s.shape) + 32 for s in declared), MESSAGE_PIECE_BYTES)
        pieces = [declared[a:b] for a, b in zip(starts, [*starts[1:], len(declared)], strict=True)]
        full.tensors.extend(pieces[0])
        if len(pieces) > 1:
            full.tensor_count = len(declared)
        yield [pb.PushRequest(header=full).SerializeToString()]
        for more in pieces[1:]:  # a header of many tensors, in pieces under the message limit
            yield [pb.PushRequest(tensors=pb.PushTensors(tensors=more)).SerializeToString()]
        pack: list[memoryview] = []  # small tensors, whole, in header order: one chunk for many
        at = ("", 0)  # where the pack starts: its first tensor, and the byte in it
        pack_bytes = 0

        def packed() -> Iterator[Message]:
            nonlocal pack_bytes
            if pack:
                yield chunk_pieces(*at, list(pack))
                if progress:
                    progress(pack_bytes)
                pack.clear()
                pack_bytes = 0

        for spec, (name, value) in zip(declared, parts.items(), strict=True):
            raw = _master_bytes(value.data if isinstance(value, Shard) else value)
            start = spec.part.offset * 4  # bytes into the whole tensor
            if len(raw) <= PACK_BYTES:
                if not pack:
                    at = (name, start)
                pack.append(raw)
                pack_bytes += len(raw)
                if pack_bytes >= self.chunk_bytes:
                    yield from packed()
                continue
            yield from packed()
            # Chunk boundaries on multiples of chunk_bytes of the whole tensor, whatever the shard.
            cut = -start % self.chunk_bytes or self.chunk_bytes
            pos = 0
            while pos < len(raw):
                piece = raw[pos : pos + cut]
                yield chunk_pieces(name, start + pos, piece)
                if progress:
                    progress(len(piece))
                pos += cut
                cut = self.chunk_bytes
        yield from packed()
        yield [pb.PushRequest(commit=pb.PushCommit()).SerializeToString()]

    def report_mismatch(self, model: str, by_version: Mapping[int, RolloutMismatch], *,
                        step: int | None = None) -> dict[int, RolloutMismatch]:
        """Report the trainer-rollout mismatch of a batch, per weight version (`rollout_mismatch`);
        returns each version's accumulated mismatch over every report so far. The service records
        all versions of the report or none: a version that is not retained raises `NotFound`, a bad
        value `InvalidArgument`. `step`: the learner's step that measured it."""
        for version, m in by_version.items():
            if not isinstance(m, RolloutMismatch):
                raise TypeError(f"version {version!r}: report a RolloutMismatch, not a {type(m).__name__}")
        return self._report(model, by_version, step)

    def close(self) -> None:
        self._replicas.close()

    def __enter__(self) -> LearnerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
