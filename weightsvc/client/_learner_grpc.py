"""The gRPC learner: `host:port`, or `grpcs://host:port` for TLS; a sharded deployment gets one push
stream per replica, all at once."""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from typing import Any

import grpc

from weightsvc.client._common import VersionInfo
from weightsvc.client._grpc import Replicas, channel, error, errors_of
from weightsvc.client._learner import LearnerClient, Message, Messages, ReplicaDown, Stream
from weightsvc.client._nixl_publish import check_size
from weightsvc.errors import WeightsvcError, subject
from weightsvc.protocol.mismatch import RolloutMismatch, mismatch_from_proto, mismatch_to_proto
from weightsvc.protocol.names import PUSH, REASON_KEY
from weightsvc.protocol.published import RankPublish, publish_to_proto
from weightsvc.v1 import weightsvc_pb2 as pb
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc


def _joined(message: Message) -> bytes:
    return message[0] if len(message) == 1 and isinstance(message[0], bytes) else b"".join(message)


class GrpcLearnerClient(LearnerClient):
    """Pushes fp32 masters over gRPC: `host:port`, or `grpcs://host:port` for TLS."""

    transport = "grpc"

    def __init__(self, target: str, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        self._channel = channel(target, self.credentials, "the learner pushes over gRPC")
        self._replicas: Replicas = Replicas(self._channel, target, self.credentials, self.timeout)

    def _push_streams(self, streams: list[Stream], messages: Messages) -> VersionInfo:
        """Run push streams at once, a call each; the first to fail cancels the others."""
        where = subject(streams[0][1].model, step=streams[0][1].step)
        # Every replica's channel before any call starts: one that is not known refuses the push whole.
        channels = [self._channel if not replica else self._replicas.channel(replica, where)
                    for replica, _, _ in streams]
        senders: list[threading.Thread] = []  # the threads gRPC runs the streams on
        done: queue.SimpleQueue[grpc.Future] = queue.SimpleQueue()
        calls = []
        replica_of = {}
        try:
            for ch, (replica, header, parts) in zip(channels, streams, strict=True):
                # Chunks are pre-encoded by `protocol.wire` (joined: one copy).
                push = ch.stream_unary(PUSH, request_serializer=_joined,
                                       response_deserializer=pb.PushResponse.FromString)
                call = push.future(messages(header, parts, senders), timeout=self.timeout)
                call.add_done_callback(done.put)
                calls.append(call)
                replica_of[id(call)] = replica
            for _ in calls:
                call = done.get()
                failure = call.exception()
                if failure is not None:
                    err = error(failure, self.target)
                    # (a replica that answers that the registry is away is up: the learner retries later)
                    if replica_of[id(call)] and failure.code() == grpc.StatusCode.UNAVAILABLE and \
                            (REASON_KEY, "registry") not in (failure.trailing_metadata() or ()):
                        raise ReplicaDown(replica_of[id(call)], err) from None
                    raise err from None
            resp = calls[0].result()
            return VersionInfo.from_proto(resp.version, resp.created)
        finally:
            if any(not c.done() or c.exception() is not None for c in calls):  # one failed, or we were interrupted
                for c in calls:
                    c.cancel()
                # Refused early, a call ends while gRPC's thread may still be sending: let it finish,
                # or a process that exits right after can abort inside gRPC.
                for sender in senders:
                    if sender is not threading.current_thread():
                        sender.join(5)

    def _committed(self, model: str, step: int, owners: list[str]) -> VersionInfo | None:
        """The version `step` if a push to `owners` committed it, asked of any replica that answers."""
        try:
            m = self._replicas.ask(lambda stub: stub.GetManifest(pb.GetManifestRequest(model=model, version=str(step)),
                                                                 timeout=self.timeout))
        except WeightsvcError:
            return None
        if not m.parts or not {h for p in m.parts for h in (p.holders or [p.owner])} <= set(owners):
            return None
        info = pb.VersionInfo(model=model, version=step, format=m.format, rounding=m.rounding, lag=m.lag,
                              committed_unix=m.committed_unix, tensor_count=m.tensor_count, data_bytes=m.data_bytes)
        return VersionInfo.from_proto(info, True)

    def _report(self, model: str, by_version: Mapping[int, RolloutMismatch],
                step: int | None) -> dict[int, RolloutMismatch]:
        request = pb.ReportMismatchRequest(model=model, step=step)
        for version, m in by_version.items():
            request.versions[int(version)].CopyFrom(mismatch_to_proto(m))
        resp = self._replicas.ask(lambda stub: stub.ReportMismatch(request, timeout=self.timeout))
        return {v: mismatch_from_proto(m) for v, m in resp.versions.items()}

    def _publish(self, request: RankPublish) -> VersionInfo:
        message = publish_to_proto(request)
        check_size(message.ByteSize(), request.where, len(request.tensors))
        with errors_of(self.target):
            resp = pb_grpc.WeightServiceStub(self._channel).Publish(message, timeout=self.timeout)
        return VersionInfo.from_proto(resp.version, resp.created)
