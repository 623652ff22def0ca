"""Python clients: `LearnerClient` pushes fp32 masters, `InferenceClient` pulls served copies.

    LearnerClient("host:50051").push(step, model.state_dict())
    weights = InferenceClient("host:50051").pull()             # gRPC
    weights = InferenceClient("http://host:8080").pull()       # HTTP

Every pulled tensor is verified against the checksum in the version's manifest. Server errors
arrive as `weightsvc.errors` exceptions carrying the server's message.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import math
import os
import queue
import socket
import ssl
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import grpc
import torch

from weightsvc.core.delta import apply as delta_apply
from weightsvc.core.lag import LagMetrics
from weightsvc.core.manifest import (
    DTYPE_SIZES,
    MASTER_DTYPE,
    Manifest,
    Part,
    manifest_from_header,
    read_safetensors_header,
    verify,
)
from weightsvc.core.memory import alloc
from weightsvc.core.topology import Replica, assign
from weightsvc.errors import (
    BY_GRPC_CODE,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
    WeightsvcError,
)
from weightsvc.transport.names import PULL, PUSH
from weightsvc.transport.wire import (
    ChunkView,
    decode_pull_response,
    encode_chunk,
    encode_message,
    lag_from_proto,
    manifest_from_proto,
)
from weightsvc.v1 import weightsvc_pb2 as pb
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc

__all__ = ["InferenceClient", "LearnerClient", "Shard", "VersionInfo", "served_weights"]

DEFAULT_CHUNK_BYTES = 1 << 20
MAX_HEADER_BYTES = 100 << 20
_TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
# Masters are fp32; bf16/fp16 widen to fp32 exactly, anything else would change the values.
_EXACT_TO_F32 = (torch.float32, torch.bfloat16, torch.float16)
Progress = Callable[[int], None]


@dataclass(frozen=True)
class VersionInfo:
    model: str
    version: int
    format: str
    rounding: str
    committed_unix: float
    tensor_count: int
    data_bytes: int
    created: bool = True
    lag: LagMetrics | None = None
    # push(return_served=True): the served tensors of this version, checksums verified.
    served: dict[str, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_proto(cls, info: pb.VersionInfo, created: bool = True) -> VersionInfo:
        return cls(
            info.model,
            info.version,
            info.format,
            info.rounding,
            info.committed_unix,
            info.tensor_count,
            info.data_bytes,
            created,
            lag_from_proto(info),
        )


def _raise(e: grpc.RpcError) -> NoReturn:
    code = e.code().name if e.code() else "UNKNOWN"
    cls = BY_GRPC_CODE.get(code, WeightsvcError)
    err = cls(f"{code}: {e.details()}")
    err.grpc_code = code
    raise err from None


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _Bearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._metadata = (("authorization", f"Bearer {token}"),)

    def _with_token(self, d: grpc.ClientCallDetails) -> _CallDetails:
        metadata = tuple(d.metadata or ()) + self._metadata
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)  # type: ignore[attr-defined]

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)


def _credentials(token: str | None, ca_cert: str | Path | bytes | None) -> tuple[str | None, bytes | None]:
    """The token and the CA bundle (PEM) a client uses: given, or $WEIGHTSVC_TOKEN / $WEIGHTSVC_CA_CERT."""
    token = token if token is not None else os.environ.get("WEIGHTSVC_TOKEN") or None
    ca = ca_cert if ca_cert is not None else os.environ.get("WEIGHTSVC_CA_CERT") or None
    if isinstance(ca, bytes) or ca is None:
        return token, ca
    return token, Path(ca).read_bytes()


def _channel(target: str, token: str | None = None, ca: bytes | None = None) -> grpc.Channel:
    """`host:port` in clear, `grpcs://host:port` over TLS (system roots, or `ca` in PEM)."""
    options = [
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
        # A client of its own: a new client connects at once, even while another one in this
        # process waits out its reconnect backoff to the same address (a restarted server).
        ("grpc.use_local_subchannel_pool", 1),
    ]
    if target.startswith("grpcs://"):
        channel = grpc.secure_channel(target.removeprefix("grpcs://"), grpc.ssl_channel_credentials(ca), options)
    else:
        channel = grpc.insecure_channel(target.removeprefix("grpc://"), options)
    return grpc.intercept_channel(channel, _Bearer(token)) if token else channel


class _Replicas:
    """The replicas of a deployment (GetTopology) and a channel to each, for sharded pushes and pulls."""

    def __init__(self, channel: grpc.Channel, target: str, token: str | None, ca: bytes | None,
                 timeout: float | None) -> None:  # fmt: skip
        self._stub = pb_grpc.WeightServiceStub(channel)
        self._channels: dict[str, grpc.Channel] = {target: channel}  # by address; the first one is the caller's
        self._token, self._ca, self._timeout = token, ca, timeout
        self._known: dict[str, Replica] = {}
        self._lock = threading.Lock()

    def topology(self) -> list[Replica]:
        try:
            reply = self._stub.GetTopology(pb.GetTopologyRequest(), timeout=self._timeout)
        except grpc.RpcError as e:
            _raise(e)
        replicas = [Replica(r.id, r.grpc, r.http) for r in reply.replicas]
        with self._lock:
            self._known = {r.id: r for r in replicas}
        return replicas

    def channel(self, replica_id: str, what: str) -> grpc.Channel:
        """A channel to the replica `replica_id` (asked for again once, if it is not known yet)."""
        if replica_id not in self._known:
            self.topology()
        replica = self._known.get(replica_id)
        if replica is None:
            raise Unavailable(f"{what}: replica {replica_id!r} is not in the topology (it is down or has left)")
        with self._lock:
            if replica.grpc not in self._channels:
                self._channels[replica.grpc] = _channel(replica.grpc, self._token, self._ca)
            return self._channels[replica.grpc]

    def close(self) -> None:
        for channel in list(self._channels.values())[1:]:  # the first is the caller's to close
            channel.close()


def _pull_method(channel: grpc.Channel) -> Any:
    """Pull on `channel`: pre-encoded chunks come back as views, not copies (`_wire`)."""
    return channel.unary_stream(PULL, request_serializer=pb.PullRequest.SerializeToString,
                                response_deserializer=decode_pull_response)  # fmt: skip


def _read_into(resp: http.client.HTTPResponse, data: memoryview, pos: int, end: int,
               progress: Progress | None) -> Iterator[int]:  # fmt: skip
    """Read a response body into data[pos:end], yielding each count read; a short body raises."""
    while pos < end:
        n = resp.readinto(data[pos : min(end, pos + (4 << 20))])
        if not n:
            raise http.client.IncompleteRead(b"", end - pos)
        pos += n
        if progress:
            progress(n)
        yield n


def _buffer(nbytes: int) -> memoryview:
    return alloc(nbytes)


def tensors_from_data(manifest: Manifest, data: bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Verify each served tensor's checksum and return views of `data` as torch tensors."""
    out: dict[str, torch.Tensor] = {}
    view = memoryview(data)
    where = f"model {manifest.model!r} version {manifest.version}"
    for t in manifest.tensors:
        dtype = _TORCH_DTYPES.get(t.dtype)
        numel = math.prod(t.shape)
        if dtype is None or t.nbytes != numel * DTYPE_SIZES[t.dtype] or t.offset + t.nbytes > len(view):
            raise DataLoss(
                f"{where}: tensor {t.name!r} ({t.dtype}, shape {list(t.shape)}, {t.nbytes} bytes "
                f"at {t.offset}) does not fit the manifest's data section"
            )
        piece = view[t.offset : t.offset + t.nbytes]
        verify(t.name, piece, t.checksum, where=where)
        if t.nbytes == 0:
            out[t.name] = torch.empty(t.shape, dtype=dtype)
        else:
            out[t.name] = torch.frombuffer(piece, dtype=dtype).view(t.shape)
    return out


def read_version_file(path: str | Path) -> tuple[Manifest, memoryview]:
    """The manifest and data section of a safetensors file written by weightsvc."""
    raw = Path(path).read_bytes()
    start, header = read_safetensors_header(raw[: 8 + int.from_bytes(raw[:8], "little")])
    return manifest_from_header(header), memoryview(raw)[start:]


@dataclass(frozen=True)
class Shard:
    """The flat elements `[offset, offset + data.numel())` of a tensor of full `shape`, in row-major
    order: the part one learner rank holds (an FSDP flat-parameter slice, a dim-0 block of a
    tensor-parallel weight). The ranks' shards of a tensor must cover it exactly once."""

    data: torch.Tensor
    offset: int
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))


def _spec(name: str, value: torch.Tensor | Shard) -> pb.TensorSpec:
    if not isinstance(value, Shard):
        return pb.TensorSpec(name=name, shape=list(value.shape), dtype=MASTER_DTYPE)
    numel, count = math.prod(value.shape), value.data.numel()
    if value.offset < 0 or value.offset + count > numel:
        raise ValueError(
            f"shard of tensor {name!r}: elements [{value.offset}, {value.offset + count}) are not within "
            f"its shape {list(value.shape)} ({numel} elements)"
        )
    part = pb.TensorPart(offset=value.offset, count=count)
    return pb.TensorSpec(name=name, shape=list(value.shape), dtype=MASTER_DTYPE, part=part)


def _as_master(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in _EXACT_TO_F32:
        raise TypeError(f"tensor {name!r} is {tensor.dtype}; push float32 masters (bf16/fp16 widen exactly)")
    return tensor.detach().to("cpu", torch.float32).contiguous().reshape(-1)


class LearnerClient:
    """Pushes fp32 masters to weightsvc over gRPC."""

    def __init__(
        self,
        target: str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout: float | None = None,
        token: str | None = None,
        ca_cert: str | Path | bytes | None = None,
    ) -> None:
        """`target`: `host:port`, or `grpcs://host:port` for TLS (`ca_cert`: a PEM bundle to trust).
        `token`: a bearer token with role push (default: $WEIGHTSVC_TOKEN)."""
        self.target = target
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self._token, self._ca = _credentials(token, ca_cert)
        self._channel = _channel(target, self._token, self._ca)
        self._replicas = _Replicas(self._channel, target, self._token, self._ca, timeout)

    def push(
        self,
        step: int,
        parts: Mapping[str, torch.Tensor | Shard],
        model: str = "default",
        *,
        rank: int = 0,
        world_size: int = 1,
        format: str = "",
        rounding: str = "",
        return_served: bool = False,
        progress: Progress | None = None,
    ) -> VersionInfo:
        """Stream the masters of `step`; returns once the version is committed (or raises).

        `parts` maps tensor names to whole tensors or `Shard`s. With `world_size` > 1 each learner
        rank calls this with its own `rank` and parts, concurrently; every call returns once the
        whole version commits, or raises if any rank fails (nothing is then visible).
        `format` / `rounding` override the server's export for this push (empty: the server's).
        `return_served` pulls the committed version back into `.served`: the exact bits the fleet
        runs, for computing the loss on them (with `ef` and fp8 that includes the server's residual).

        When the deployment has several replicas (sharded, sharing a Redis registry), each tensor goes
        to the replica that owns it by rendezvous hashing of its name, all replicas at once; the
        version commits when every replica has its part, and nothing is visible if one fails."""
        for name, value in parts.items():  # bad input raises here, with the tensor's name
            _spec(name, value)
            tensor = value.data if isinstance(value, Shard) else value
            if tensor.dtype not in _EXACT_TO_F32:
                _as_master(name, tensor)  # raises with the tensor's name
        header = pb.PushHeader(model=model, step=step, format=format, rounding=rounding, rank=rank,
                               world_size=world_size)  # fmt: skip
        replicas = self._replicas.topology()
        if len(replicas) <= 1:
            streams = [(self._channel, header, dict(parts))]
        else:
            owned = assign(parts, replicas)
            header.owners.extend(r.id for r in replicas)
            where = f"model {model!r} step {step}"
            streams = [
                (self._replicas.channel(r.id, where), header, {n: parts[n] for n in owned.get(r.id, [])})
                for r in replicas
            ]
        resp = self._push_streams(streams, progress)
        info = VersionInfo.from_proto(resp.version, resp.created)
        if return_served:
            with InferenceClient(self.target, timeout=self.timeout, token=self._token, ca_cert=self._ca) as puller:
                info = dataclasses.replace(info, served=puller.pull(info.model, info.version))
        return info

    def _push_streams(
        self, streams: list[tuple[grpc.Channel, pb.PushHeader, dict[str, torch.Tensor | Shard]]],
        progress: Progress | None,
    ) -> pb.PushResponse:  # fmt: skip
        """Run push streams at once (one per replica); the first to fail cancels the others."""
        senders: list[threading.Thread] = []  # the threads gRPC runs the streams on
        done: queue.SimpleQueue[grpc.Future] = queue.SimpleQueue()
        calls = []
        try:
            for channel, header, parts in streams:
                # Chunks are pre-encoded by `_wire` (one copy); header and commit are plain messages.
                push = channel.stream_unary(PUSH, request_serializer=encode_message,
                                            response_deserializer=pb.PushResponse.FromString)  # fmt: skip
                call = push.future(self._messages(header, parts, progress, senders), timeout=self.timeout)
                call.add_done_callback(done.put)
                calls.append(call)
            for _ in calls:
                call = done.get()
                if call.exception() is not None:
                    _raise(call.exception())
            return calls[0].result()
        finally:
            if any(not c.done() or c.exception() is not None for c in calls):  # one failed, or we were interrupted
                for c in calls:
                    c.cancel()
                # Refused early, a call ends while gRPC's thread may still be sending: let it finish,
                # or a process that exits right after can abort inside gRPC.
                for sender in senders:
                    if sender is not threading.current_thread():
                        sender.join(5)

    def _messages(self, header: pb.PushHeader, parts: dict[str, torch.Tensor | Shard], progress: Progress | None,
                  senders: list[threading.Thread]) -> Iterator[pb.PushRequest | bytes]:  # fmt: skip
        senders.append(threading.current_thread())
        specs = [_spec(name, value) for name, value in parts.items()]
        full = pb.PushHeader()
        full.CopyFrom(header)
        full.tensors.extend(specs)
        yield pb.PushRequest(header=full)
        for spec, (name, value) in zip(specs, parts.items(), strict=True):
            tensor = value.data if isinstance(value, Shard) else value
            raw = _as_master(name, tensor).view(torch.uint8).numpy().data
            start = spec.part.offset * 4  # bytes into the whole tensor
            # Chunk boundaries on multiples of chunk_bytes of the whole tensor, whatever the shard.
            cut = -start % self.chunk_bytes or self.chunk_bytes
            pos = 0
            while pos < len(raw):
                piece = raw[pos : pos + cut]
                yield encode_chunk(name, start + pos, piece)
                if progress:
                    progress(len(piece))
                pos += cut
                cut = self.chunk_bytes
        yield pb.PushRequest(commit=pb.PushCommit())

    def close(self) -> None:
        self._replicas.close()
        self._channel.close()

    def __enter__(self) -> LearnerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InferenceClient:
    """Pulls served copies. `target` is "host:port" for gRPC or "http://host:port" for HTTP."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        resume_attempts: int = 3,
        token: str | None = None,
        ca_cert: str | Path | bytes | None = None,
    ) -> None:
        """`token`: a bearer token with role pull (default: $WEIGHTSVC_TOKEN); `ca_cert`: a PEM
        bundle to trust for `grpcs://` and `https://` targets (default: $WEIGHTSVC_CA_CERT)."""
        self.target = target
        self._token, self._ca = _credentials(token, ca_cert)
        self.timeout = timeout
        self.resume_attempts = resume_attempts  # a pull broken mid-stream resumes from its offset
        self._held: dict[str, tuple[Manifest, memoryview]] = {}  # the last version pulled, per model
        self.last_pull_bytes = 0  # payload bytes the last gRPC pull received (a delta is smaller)
        self._http = target.startswith(("http://", "https://"))
        if self._http:
            self._url = urllib.parse.urlsplit(target)
        else:
            self._channel = _channel(target, self._token, self._ca)
            self._stub = pb_grpc.WeightServiceStub(self._channel)
            self._replicas = _Replicas(self._channel, target, self._token, self._ca, timeout)

    # ---- pulls -------------------------------------------------------------------------------

    def pull(
        self,
        model: str = "default",
        version: int | str = "latest",
        *,
        base: int | None = None,
        progress: Progress | None = None,
    ) -> dict[str, torch.Tensor]:
        """The served tensors of a version (checksums verified), by name; `base`: see `pull_data`."""
        manifest, data = self.pull_data(model, version, base=base, progress=progress)
        return tensors_from_data(manifest, data)

    def iter_weights(
        self, model: str = "default", version: int | str = "latest", *, progress: Progress | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`(name, tensor)` pairs of a version, checksums verified, as vLLM's `model.load_weights`
        and SGLang's `update_weights_from_tensor` take them (fp8 scales come as `<name>_scale_inv`)."""
        yield from self.pull(model, version, progress=progress).items()

    def pull_file(
        self,
        path: str | Path,
        model: str = "default",
        version: int | str = "latest",
        *,
        base: int | None = None,
        progress: Progress | None = None,
    ) -> Manifest:
        """Write a version as a safetensors file (checksums verified first); returns its manifest.

        With `base`, the file at `path` must hold that version (as written by a previous pull): only
        the changes are pulled, and the file is replaced by the new version."""
        if base is not None:
            held = read_version_file(path)
            if (held[0].model, held[0].version) != (model, base):
                raise InvalidArgument(
                    f"{path} holds model {held[0].model!r} version {held[0].version}, "
                    f"not model {model!r} version {base}"
                )
            tensors_from_data(*held)  # verified before anything is built on it
            self.hold(*held)
        manifest, data = self.pull_data(model, version, base=base, progress=progress)
        tensors_from_data(manifest, data)
        path = Path(path)
        tmp = path.with_name(f".{path.name}.part")
        try:
            with open(tmp, "wb") as f:
                f.write(manifest.safetensors_header())
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        return manifest

    def pull_data(
        self,
        model: str = "default",
        version: int | str = "latest",
        *,
        base: int | None = None,
        progress: Progress | None = None,
    ) -> tuple[Manifest, memoryview]:
        """The manifest and the raw data section of a version (not yet verified).

        With `base` (gRPC), only the changes from that version are sent when that is smaller: the
        client must hold it, from its previous pull of the model (or `hold`).
        """
        if self._http:
            if base is not None:
                raise ValueError("delta pulls need a gRPC target (host:port)")
            manifest, data = self._http_pull(model, str(version), progress)
        else:
            manifest, data = self._grpc_pull(model, str(version), base, progress)
        self._held[model] = (manifest, data)
        return manifest, data

    @property
    def transport(self) -> str:
        """The transport, "grpc" or "http" (acks and watch need gRPC)."""
        return "http" if self._http else "grpc"

    def topology(self) -> list[Replica]:
        """The replicas of the deployment, as its registry knows them (sorted by id)."""
        if self._http:
            return [Replica(**r) for r in self._get_json("/v1/topology")["replicas"]]
        return self._replicas.topology()

    def held(self, model: str = "default") -> Manifest | None:
        """The manifest of the version this client holds of `model` (its last pull): a delta base."""
        held = self._held.get(model)
        return held[0] if held is not None else None

    def hold(self, manifest: Manifest, data: memoryview) -> None:
        """Remember a version this client has (the base of a later delta pull of its model)."""
        self._held[manifest.model] = (manifest, data)

    def _grpc_pull(
        self, model: str, version: str, base: int | None, progress: Progress | None
    ) -> tuple[Manifest, memoryview]:
        held = self._held.get(model)
        if base is not None and (held is None or held[0].version != base):
            raise InvalidArgument(f"model {model!r}: this client holds no copy of version {base} to pull a delta on")
        manifest: Manifest | None = None
        data = memoryview(b"")
        received = 0
        delta_bytes: int | None = None
        self.last_pull_bytes = 0
        pull = _pull_method(self._channel)
        for attempt in range(self.resume_attempts + 1):
            # After a break, ask for the same version from the first byte we do not have yet.
            pinned = version if manifest is None else str(manifest.version)
            request = pb.PullRequest(
                model=model, version=pinned, offset=received, base="" if base is None else str(base)
            )
            try:
                stream = pull(request, timeout=self.timeout)
                first = next(stream, None)
                if not isinstance(first, pb.PullResponse) or not first.HasField("manifest"):
                    raise DataLoss(f"model {model!r} version {pinned}: the pull did not start with a manifest")
                got = manifest_from_proto(first.manifest)
                if manifest is not None and got.master_digest != manifest.master_digest:
                    raise DataLoss(f"model {model!r} version {pinned} changed while resuming its pull")
                manifest = got
                for chunk in stream:
                    if isinstance(chunk, pb.PullResponse) and chunk.HasField("delta"):
                        if delta_bytes is None:  # the bytes that follow encode changes from `base`
                            delta_bytes = chunk.delta.delta_bytes
                            data = _buffer(delta_bytes)
                        continue
                    if not data and manifest.data_bytes and delta_bytes is None:
                        data = _buffer(manifest.data_bytes)
                    n = len(chunk.data) if isinstance(chunk, ChunkView) else -1
                    if n < 0 or chunk.offset != received or received + n > len(data):
                        raise DataLoss(f"model {model!r} version {manifest.version}: unexpected chunk in pull")
                    data[received : received + n] = chunk.data
                    received += n
                    self.last_pull_bytes += n
                    if progress:
                        progress(n)
                break
            except grpc.RpcError as e:
                retryable = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
                if manifest is None or not retryable or attempt == self.resume_attempts:
                    _raise(e)
                time.sleep(min(2.0, 0.1 * 2**attempt))  # the connection is re-established by the channel
        assert manifest is not None
        if manifest.parts and delta_bytes is None and received < manifest.data_bytes:
            # Sharded replicas: the replica asked sent its own part (if it came first); the others'
            # parts come from their owners, all at once.
            data = data or _buffer(manifest.data_bytes)
            self._pull_parts(manifest, data, received, progress)
            received = manifest.data_bytes
        expected = manifest.data_bytes if delta_bytes is None else delta_bytes
        if received != expected:
            raise DataLoss(
                f"model {model!r} version {manifest.version}: stream ended after {received} of {expected} bytes"
            )
        if delta_bytes is None:
            return manifest, data if manifest.data_bytes else _buffer(0)
        assert held is not None
        full = _buffer(manifest.data_bytes)
        full[:] = held[1]
        try:
            delta_apply(manifest, data, full)
        except (ValueError, struct.error) as e:
            raise DataLoss(f"model {model!r} version {manifest.version}: bad delta on version {base}: {e}") from None
        return manifest, full

    def _pull_parts(self, manifest: Manifest, data: memoryview, received: int, progress: Progress | None) -> None:
        """Pull the bytes of `manifest`'s parts above `received` from their owners, in parallel."""
        where = f"model {manifest.model!r} version {manifest.version}"
        todo = [(p, max(p.offset, received)) for p in manifest.parts if p.nbytes and p.offset + p.nbytes > received]
        if not todo:
            return
        with concurrent.futures.ThreadPoolExecutor(len(todo), thread_name_prefix="weightsvc-part") as pool:
            futures = [pool.submit(self._pull_part, manifest, part, start, data, progress, where)
                       for part, start in todo]  # fmt: skip
            for f in futures:
                self.last_pull_bytes += f.result()

    def _pull_part(self, manifest: Manifest, part: Part, start: int, data: memoryview, progress: Progress | None,
                   where: str) -> int:  # fmt: skip
        """Bytes [start, end of `part`) from the part's owner, resuming after a break; returns the count."""
        pull = _pull_method(self._replicas.channel(part.owner, where))
        end, pos = part.offset + part.nbytes, start
        for attempt in range(self.resume_attempts + 1):
            request = pb.PullRequest(model=manifest.model, version=str(manifest.version), offset=pos)
            try:
                stream = pull(request, timeout=self.timeout)
                first = next(stream, None)
                if (not isinstance(first, pb.PullResponse) or not first.HasField("manifest")
                        or first.manifest.master_digest != manifest.master_digest):  # fmt: skip
                    raise DataLoss(f"{where}: replica {part.owner!r} answered with another version")
                for chunk in stream:
                    n = len(chunk.data) if isinstance(chunk, ChunkView) else -1
                    if n < 0 or chunk.offset != pos or pos + n > end:
                        raise DataLoss(f"{where}: unexpected chunk from replica {part.owner!r}")
                    data[pos : pos + n] = chunk.data
                    pos += n
                    if progress:
                        progress(n)
                break
            except grpc.RpcError as e:
                # NOT_FOUND too: an owner learns that the version committed a moment after the replica
                # that took the last part (it reads the registry's events).
                retryable = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                                         grpc.StatusCode.NOT_FOUND)  # fmt: skip
                if not retryable or attempt == self.resume_attempts:
                    _raise(e)
                time.sleep(min(2.0, 0.1 * 2**attempt))
        if pos != end:
            raise DataLoss(f"{where}: replica {part.owner!r} sent bytes [{start}, {pos}) of its part [{part.offset}, "
                           f"{end})")  # fmt: skip
        return pos - start

    def _request(self, path: str, headers: dict[str, str] | None = None, base: str | None = None
                 ) -> http.client.HTTPResponse:  # fmt: skip
        """GET `path` of the target (or of `base`, another replica's HTTP URL); errors raised as ours."""
        url = self._url if base is None else urllib.parse.urlsplit(base)
        host = url.hostname or "127.0.0.1"
        conn: http.client.HTTPConnection
        if url.scheme == "https":
            context = ssl.create_default_context(cadata=self._ca.decode() if self._ca else None)
            conn = http.client.HTTPSConnection(host, url.port, timeout=self.timeout, context=context)
        else:
            conn = http.client.HTTPConnection(host, url.port, timeout=self.timeout)
        headers = dict(headers or {})
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        try:
            conn.request("GET", url.path.rstrip("/") + path, headers=headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise Unavailable(f"UNAVAILABLE: {base or self.target}: {e}") from None
        if resp.status >= 400:
            body = resp.read()
            conn.close()
            try:
                err = json.loads(body)["error"]
                code, message = err["code"], err["message"]
            except (ValueError, KeyError, TypeError):
                code, message = "UNKNOWN", body[:200].decode(errors="replace")
            raise BY_GRPC_CODE.get(code, WeightsvcError)(f"{code}: {message} (HTTP {resp.status})")
        return resp

    def _get_json(self, path: str) -> Any:
        resp = self._request(path)
        try:
            return json.loads(resp.read())
        finally:
            resp.close()

    def _http_pull(self, model: str, version: str, progress: Progress | None) -> tuple[Manifest, memoryview]:
        q = urllib.parse.quote
        manifest: Manifest | None = None
        data = memoryview(b"")
        received = start = 0
        etag = ""
        for attempt in range(self.resume_attempts + 1):
            try:
                if manifest is None:
                    # One request: the file's own header carries the manifest, so "latest" cannot
                    # change under us.
                    try:
                        resp = self._request(f"/v1/models/{q(model)}/versions/{q(version)}/safetensors")
                    except FailedPrecondition:
                        sharded = self.manifest(model, version)
                        if not sharded.parts:
                            raise
                        return sharded, self._http_pull_parts(sharded, progress)
                    etag = resp.getheader("etag") or ""
                    head = resp.read(8)
                    header_len = int.from_bytes(head, "little")
                    if len(head) < 8 or header_len > MAX_HEADER_BYTES:
                        raise DataLoss(f"model {model!r} version {version}: not a safetensors stream")
                    start, header = read_safetensors_header(head + resp.read(header_len))
                    manifest = manifest_from_header(header)
                    data = _buffer(manifest.data_bytes)
                else:  # resume the same version (If-Range: never splice two versions)
                    resp = self._request(
                        f"/v1/models/{q(model)}/versions/{manifest.version}/safetensors",
                        {"Range": f"bytes={start + received}-", "If-Range": etag},
                    )
                    if resp.status != 206:
                        raise DataLoss(f"model {model!r} version {manifest.version} changed while resuming its pull")
                try:
                    for n in _read_into(resp, data, received, len(data), progress):
                        received += n  # kept as it grows: a break resumes from here
                finally:
                    resp.close()
                break
            except (OSError, http.client.HTTPException, Unavailable) as e:
                if manifest is None or attempt == self.resume_attempts:
                    raise Unavailable(f"UNAVAILABLE: {self.target}: pull broke off: {e!r}") from None
                time.sleep(min(2.0, 0.1 * 2**attempt))
        assert manifest is not None
        return manifest, data

    def _http_pull_parts(self, manifest: Manifest, progress: Progress | None) -> memoryview:
        """A version of sharded replicas over HTTP: each part by Range from its owner, in parallel."""
        where = f"model {manifest.model!r} version {manifest.version}"
        urls = {r.id: r.http for r in self.topology()}
        header = manifest.safetensors_header()
        head, etag = len(header), manifest.etag(header)
        data = _buffer(manifest.data_bytes)

        def pull(part: Part) -> None:
            if part.owner not in urls:
                raise Unavailable(f"{where}: replica {part.owner!r} is not in the topology (it is down or has left)")
            pos, end = part.offset, part.offset + part.nbytes
            for attempt in range(self.resume_attempts + 1):
                try:
                    resp = self._request(
                        f"/v1/models/{urllib.parse.quote(manifest.model)}/versions/{manifest.version}/safetensors",
                        {"Range": f"bytes={head + pos}-{head + end - 1}", "If-Range": etag},
                        base=urls[part.owner],
                    )
                    try:
                        if resp.status != 206:
                            raise DataLoss(f"{where}: replica {part.owner!r} did not answer with its part")
                        for n in _read_into(resp, data, pos, end, progress):
                            pos += n
                    finally:
                        resp.close()
                    return
                except (OSError, http.client.HTTPException, Unavailable, NotFound) as e:  # (NOT_FOUND: see _pull_part)
                    if attempt == self.resume_attempts:
                        raise Unavailable(f"UNAVAILABLE: {where}: the part of replica {part.owner!r} broke off: "
                                          f"{e!r}") from None  # fmt: skip
                    time.sleep(min(2.0, 0.1 * 2**attempt))

        parts = [p for p in manifest.parts if p.nbytes]
        with concurrent.futures.ThreadPoolExecutor(max(1, len(parts)), thread_name_prefix="weightsvc-part") as pool:
            for f in [pool.submit(pull, p) for p in parts]:
                f.result()
        return data

    # ---- metadata ----------------------------------------------------------------------------

    def manifest(self, model: str = "default", version: int | str = "latest") -> Manifest:
        if self._http:
            q = urllib.parse.quote
            return Manifest.from_dict(self._get_json(f"/v1/models/{q(model)}/versions/{q(str(version))}/manifest"))
        try:
            return manifest_from_proto(
                self._stub.GetManifest(pb.GetManifestRequest(model=model, version=str(version)), timeout=self.timeout)
            )
        except grpc.RpcError as e:
            _raise(e)

    def versions(self, model: str = "default") -> list[VersionInfo]:
        if self._http:
            body = self._get_json(f"/v1/models/{urllib.parse.quote(model)}/versions")
            return [VersionInfo(**{**v, "lag": LagMetrics(**v["lag"]) if v.get("lag") else None})
                    for v in body["versions"]]  # fmt: skip
        try:
            resp = self._stub.ListVersions(pb.ListVersionsRequest(model=model), timeout=self.timeout)
        except grpc.RpcError as e:
            _raise(e)
        return [VersionInfo.from_proto(v) for v in resp.versions]

    def models(self) -> list[dict[str, Any]]:
        if self._http:
            return list(self._get_json("/v1/models")["models"])
        try:
            resp = self._stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            _raise(e)
        return [
            {"model": m.model, "latest_version": m.latest_version, "versions": list(m.versions)} for m in resp.models
        ]

    # ---- gRPC only: watch and ack -------------------------------------------------------------

    def _grpc_only(self, what: str) -> None:
        if self._http:
            raise ValueError(f"{what} needs a gRPC target (host:port), not {self.target}")

    def watch(
        self, model: str = "default", after: int | None = None, *, reconnect: bool = True, max_backoff: float = 5.0
    ) -> Iterator[VersionInfo]:
        """Each retained version above `after` (all when None), then each new one as it commits.

        With `reconnect`, a lost server (restart, network) is retried with exponential backoff, and
        the watch resumes after the last version it yielded: the latest version is never missed.
        """
        self._grpc_only("watch")
        last, delay = after, 0.1
        while True:
            req = pb.WatchRequest(model=model)
            if last is not None:
                req.after_version = last
            try:
                for event in self._stub.Watch(req):
                    delay = 0.1
                    info = VersionInfo.from_proto(event.version)
                    last = info.version
                    yield info
            except grpc.RpcError as e:
                lost = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
                if not (reconnect and lost):
                    _raise(e)
            if not reconnect:
                return
            time.sleep(delay)  # backoff before the next attempt; the channel reconnects by itself
            delay = min(max_backoff, delay * 2)

    def ack(self, model: str, version: int, client_id: str | None = None) -> int:
        """Tell the service this client has loaded `version`; returns the latest version."""
        self._grpc_only("ack")
        client_id = client_id or f"{socket.gethostname()}-{id(self):x}"
        try:
            resp = self._stub.Ack(
                pb.AckRequest(model=model, version=version, client_id=client_id), timeout=self.timeout
            )
        except grpc.RpcError as e:
            _raise(e)
        return int(resp.latest_version)

    def close(self) -> None:
        if not self._http:
            self._replicas.close()
            self._channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def served_weights(module: torch.nn.Module, served: Mapping[str, torch.Tensor]) -> Iterator[torch.nn.Module]:
    """Run `module` on the served copy while its parameters stay the fp32 masters.

        with served_weights(policy, info.served):
            loss = objective(policy(batch))
            loss.backward()          # gradients at the served weights, on the master parameters
        optimizer.step()             # updates the masters

    fp8 tensors are dequantized with their `<name>_scale_inv` block, row or tensor scales.
    """
    params = dict(module.named_parameters())
    saved = {}
    try:
        with torch.no_grad():
            for name, p in params.items():
                if name not in served:
                    raise KeyError(f"the served copy has no tensor {name!r}")
                saved[name] = p.data.clone()
                p.data.copy_(_dequantized(served, name).to(p.dtype).reshape(p.shape))
        yield module
    finally:
        with torch.no_grad():
            for name, master in saved.items():
                params[name].data.copy_(master)


def _dequantized(served: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    values = served[name].float()
    scale = served.get(name + "_scale_inv")
    if scale is None:
        return values
    if scale.dim() == 2 and scale.shape != (values.shape[0], 1):  # 128 x 128 blocks
        n, k = values.shape
        scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return values * scale
