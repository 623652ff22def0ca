"""PUB2: the bytes a version moves on its way in, a learner's publish against an fp32 push of the same
masters, in bf16 and fp8_e4m3 (a figure of bytes, not of time).

Each side's messages as they go on the wire, gRPC's and HTTP/2's own framing left out of both. The
push: its messages as the learner serializes them (header, chunks with their framing, commit), whose
master bytes the server counted as they arrived (`weightsvc_push_bytes_total`, checked against the
masters). The publish: the served bytes that landed in the server's READs over NIXL
(`weightsvc_publish_bytes_total`, counted as each piece is hashed) and the request's bytes (the
serialized PublishRequest: names, shapes, checksums, ranges, the agent's metadata, the lag sums).
"""

from __future__ import annotations

import re
import urllib.request
from typing import Any

from weightsvc.cli.bench._common import make_model, row, serve

TARGETS = {"bf16": 0.5, "fp8_e4m3": 0.27}


def _counter(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    found = re.search(rf'^{name}{{model="default"}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def publish_bench(*, size_mib: int, say: Any) -> dict[str, Any]:
    """PUB2 on `size_mib` of fp32 masters."""
    import grpc

    from weightsvc.client import LearnerClient
    from weightsvc.client._learner import _spec
    from weightsvc.client._nixl_publish import published
    from weightsvc.integrations.fair_cast import served_state_dict
    from weightsvc.protocol.published import publish_to_proto
    from weightsvc.rounding import ExportSpec
    from weightsvc.v1 import weightsvc_pb2 as pb
    from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc

    masters = make_model(size_mib)
    figures: dict[str, Any] = {}
    details: dict[str, Any] = {}
    report: dict[str, Any] = {}
    for fmt, target in TARGETS.items():
        spec = ExportSpec(fmt, "sr", 0)
        server = serve(1, "--nixl", "--format", fmt)
        try:
            learner = LearnerClient(server.target)
            learner.push(1, masters)
            master_bytes = _counter(server.url, "weightsvc_push_bytes_total")
            specs = {name: _spec(name, t) for name, t in masters.items()}
            header = pb.PushHeader(model="default", step=1, world_size=1)
            pushed = sum(len(piece) for message in learner._messages(header, dict(masters), specs, None, [])
                         for piece in message)
            served = served_state_dict(masters, spec, version=2)
            with published({name: (t, 0, None) for name, t in served.items()}, model="default", step=2, rank=0,
                           world_size=1, spec=spec, master_digest="", aliases={}) as request:
                message = publish_to_proto(request)
                with grpc.insecure_channel(server.target) as channel:
                    pb_grpc.WeightServiceStub(channel).Publish(message, timeout=600)
            read = _counter(server.url, "weightsvc_publish_bytes_total")
        finally:
            server.stop()
        want = sum(t.numel() * 4 for t in masters.values())
        if master_bytes != want or not read:
            raise RuntimeError(f"PUB2 {fmt}: the server counted {master_bytes:.0f} master bytes pushed (of {want}), "
                               f"{read:.0f} READ")
        moved = read + message.ByteSize()
        ratio = moved / pushed
        say(f"PUB2 {fmt}: publish moved {moved / 2**20:.1f} MiB ({read / 2**20:.1f} MiB READ over NIXL, "
            f"{message.ByteSize()} bytes of request) vs an fp32 push's {pushed / 2**20:.1f} MiB of messages "
            f"({master_bytes / 2**20:.1f} MiB of masters received): {ratio:.4f}x")
        key = "PUB2" if fmt == "bf16" else f"PUB2_{fmt}"
        figures[key] = round(ratio, 4)
        details[f"{key}_bytes"] = {"push": int(pushed), "push_masters": int(master_bytes),
                                   "publish_read": int(read), "publish_request": message.ByteSize()}
        report[key] = row(f"bytes per version, publish vs fp32 push ({fmt}, {master_bytes / 2**20:.0f} MiB masters)",
                          f"{ratio:.4f}x", f"<= {target}x")
    return {**figures, "details": details, "report": report}
