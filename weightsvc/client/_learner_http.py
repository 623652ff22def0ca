"""The HTTP learner: `http://host:port` or `https://host:port`, POST /v1/models/{model}/push (the
messages gRPC sends, framed as gRPC frames them) and POST /v1/models/{model}/versions/{step}/publish (a
publish's JSON); a deployment of one replica."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Mapping
from typing import Any

from weightsvc.client._common import VersionInfo
from weightsvc.client._http import HttpInferenceClient, post_framed
from weightsvc.client._learner import LearnerClient, Messages, Stream
from weightsvc.client._nixl_publish import check_size
from weightsvc.errors import FailedPrecondition
from weightsvc.protocol.mismatch import RolloutMismatch
from weightsvc.protocol.published import RankPublish, publish_to_dict
from weightsvc.protocol.topology import Replica

_quote = urllib.parse.quote


class _HttpTopology:
    """The replicas a push over HTTP goes to: the target alone. A deployment of several replicas is
    refused: its sharded push needs each replica's own stream, which only gRPC fans out."""

    replication = 1

    def __init__(self, client: HttpInferenceClient) -> None:
        self.client = client
        self.left_out: dict[str, float] = {}

    def live(self) -> list[Replica]:
        replicas = self.client.topology()
        if len(replicas) > 1:
            raise FailedPrecondition(f"{self.client.target}: the deployment has {len(replicas)} replicas; a sharded "
                                     "push goes over gRPC (target host:port or grpcs://), not HTTP",
                                     reason="invalid_header")
        return replicas

    def leave_out(self, replica_id: str) -> None:  # pragma: no cover - no replica is left out over HTTP
        pass

    def close(self) -> None:
        self.client.close()


class HttpLearnerClient(LearnerClient):
    """Pushes fp32 masters over HTTP: `http://host:port`, or `https://host:port`."""

    transport = "http"

    def __init__(self, target: str, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        self._http = HttpInferenceClient(target, timeout=self.timeout, token=self.credentials.token or "",
                                         ca_cert=self.credentials.ca)
        self._replicas = _HttpTopology(self._http)

    def _push_streams(self, streams: list[Stream], messages: Messages) -> VersionInfo:
        """The one stream of a push over HTTP, as the body of POST /v1/models/{model}/push."""
        (_, header, parts), = streams
        path = f"/v1/models/{_quote(header.model, safe='')}/push"
        return VersionInfo.from_dict(post_framed(self._http, path, messages(header, parts, [])))

    def _committed(self, model: str, step: int, owners: list[str]) -> VersionInfo | None:
        return None  # (never asked: a push over HTTP goes to one replica, and raises what it meets)

    def _report(self, model: str, by_version: Mapping[int, RolloutMismatch],
                step: int | None) -> dict[int, RolloutMismatch]:
        body = {"versions": {str(v): m.as_dict() for v, m in by_version.items()}, "step": step}
        answer = self._http._json(f"/v1/models/{_quote(model, safe='')}/mismatch", body)
        return {int(v): RolloutMismatch(**m) for v, m in answer["versions"].items()}

    def _publish(self, request: RankPublish) -> VersionInfo:
        body = publish_to_dict(request)
        check_size(len(json.dumps(body)), request.where, len(request.tensors))
        path = f"/v1/models/{_quote(request.model, safe='')}/versions/{request.step}/publish"
        return VersionInfo.from_dict(self._http._json(path, body))
