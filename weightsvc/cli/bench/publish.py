"""The learner's publish (`serve --nixl`), measured from outside:

- PUB1: a version published by two learner rank processes until four engine readers hold their slices
  (a quarter of every tensor's rows each, read over NIXL as `pull_into` reads), against the same four
  readers' bare NIXL READs of the same bytes straight from the same rank processes' registered memory.
  The service is the system of record: the version commits once the server has READ every rank's
  bytes and checked them, and the readers then READ it from the server's copy.
- PUB2: the bytes a version moves on its way in, a learner's publish against an fp32 push of the same
  masters, in bf16 and fp8_e4m3 (a figure of bytes, not of time).

Each side's messages as they go on the wire, gRPC's and HTTP/2's own framing left out of both. The
push: its messages as the learner serializes them (header, chunks with their framing, commit), whose
master bytes the server counted as they arrived (`weightsvc_push_bytes_total`, checked against the
masters). The publish: the served bytes that landed in the server's READs over NIXL
(`weightsvc_publish_bytes_total`, counted as each piece is hashed) and the request's bytes (the
serialized PublishRequest: names, shapes, checksums, ranges, the agent's metadata, the lag sums).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from weightsvc.cli.bench._common import make_model, row, serve

TARGETS = {"bf16": 0.5, "fp8_e4m3": 0.27}
PUB1_RANKS, PUB1_READERS = 2, 4
PUB1_TARGET = 1.3


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


def pub1_bench(*, size_mib: int, repeat: int, say: Any) -> dict[str, Any]:
    """PUB1 on a version of `size_mib` served (bf16) bytes, best of `repeat` versions each way."""
    from weightsvc.cli.bench.fabric import _together

    server = serve(1, "--nixl")
    ranks: list[subprocess.Popen[str]] = []
    readers: list[subprocess.Popen[str]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            metas = [str(Path(tmp) / f"rank-{r}.json") for r in range(PUB1_RANKS)]
            ranks = [_peer("rank", server.target, str(r), str(PUB1_RANKS), str(size_mib), str(repeat), metas[r])
                     for r in range(PUB1_RANKS)]
            _each_says(ranks, "lent")  # step 0's copy registered, its request in `metas`
            bare_s = _together([["bare-ranks", str(size_mib), str(i), str(PUB1_READERS), *metas]
                                for i in range(PUB1_READERS)], repeat, module=__name__)
            _tell(ranks, "publish")  # step 0, the warm-up: agents met and connected before any clock
            _each_says(ranks, "ok")
            readers = [_peer_of("weightsvc.cli.bench.fabric", "quarter", server.target, str(i), str(PUB1_READERS))
                       for i in range(PUB1_READERS)]
            _each_says(readers, "ready")
            rounds, publishes = [], []
            for _ in range(repeat):
                start = time.perf_counter()
                _tell(ranks, "publish")
                _each_says(ranks, "ok")
                published = time.perf_counter()
                _tell(readers, "go")
                _each_says(readers, None)
                rounds.append(time.perf_counter() - start)
                publishes.append(published - start)
            nbytes = sum(json.loads(Path(m).read_text())["bytes"] for m in metas)
    finally:
        for proc in (*ranks, *readers):
            proc.kill()
            proc.wait()
        server.stop()
    best = min(range(repeat), key=rounds.__getitem__)
    pub1 = rounds[best] / bare_s
    say(f"PUB1: {PUB1_RANKS} ranks publish {nbytes / 2**20:.0f} MiB, {PUB1_READERS} readers hold a quarter each in "
        f"{rounds[best]:.3f} s (the publish {publishes[best]:.3f} s) vs their bare READs from the ranks "
        f"{bare_s:.3f} s: "
        f"{pub1:.2f}x")
    return {
        "PUB1": round(pub1, 3),
        "details": {"PUB1_seconds": {"publish_to_readers": round(rounds[best], 6),
                                     "publish": round(publishes[best], 6), "bare_read": round(bare_s, 6),
                                     "bytes": nbytes}},
        "report": {"PUB1": row(f"publish -> {PUB1_READERS} readers hold their slices, vs bare READs from the "
                               f"{PUB1_RANKS} ranks ({nbytes / 2**20:.0f} MiB)", f"{pub1:.2f}x", f"<= {PUB1_TARGET}x")},
    }


def _peer(*args: str) -> subprocess.Popen[str]:
    return _peer_of(__name__, *args)


def _peer_of(module: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def _tell(procs: list[subprocess.Popen[str]], line: str) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()


def _each_says(procs: list[subprocess.Popen[str]], word: str | None) -> None:
    """Wait for a line from each of `procs` (`word`, or any line that is not empty)."""
    for proc in procs:
        assert proc.stdout is not None
        said = proc.stdout.readline().strip()
        if not said or (word is not None and said != word):
            raise RuntimeError(f"PUB1's {proc.args!r} said {said!r} ({proc.poll()}), not {word or 'a line'!r}")


def _served(size_mib: int, steps: range) -> dict[int, dict[str, Any]]:
    """The served copy (bf16 sr, the server's defaults) of each of `steps` of a version of `size_mib`."""
    from weightsvc.integrations.fair_cast import served_state_dict
    from weightsvc.rounding import ExportSpec

    masters = make_model(2 * size_mib)
    return {step: served_state_dict(masters, ExportSpec("bf16", "sr", 0), version=step) for step in steps}


def _share(served: dict[str, Any], rank: int, ranks: int) -> dict[str, Any]:
    """Rank `rank`'s contiguous share of the flat elements of every served tensor."""
    from weightsvc.client import Shard

    out: dict[str, Any] = {}
    for name, t in served.items():
        flat = t.reshape(-1)
        lo, hi = rank * flat.numel() // ranks, (rank + 1) * flat.numel() // ranks
        out[name] = Shard(flat[lo:hi].clone(), lo, tuple(t.shape))
    return out


def _rank(target: str, rank: int, ranks: int, size_mib: int, repeat: int, meta: str) -> None:
    """A learner rank: lends step 0's share (its request in `meta`, for the bare readers) until told to
    publish, then publishes steps 0 .. `repeat`, one each time it is told (`ok` once committed)."""
    from weightsvc.client import LearnerClient
    from weightsvc.client._nixl_publish import published
    from weightsvc.protocol.published import publish_to_dict
    from weightsvc.rounding import ExportSpec

    spec = ExportSpec("bf16", "sr", 0)
    copies = {step: _share(served, rank, ranks) for step, served in _served(size_mib, range(repeat + 1)).items()}
    lent = {name: (s.data, s.offset, s.shape) for name, s in copies[0].items()}
    with published(lent, model="default", step=0, rank=rank, world_size=ranks, spec=spec, master_digest="",
                   aliases={}) as request:
        nbytes = sum(s.data.numel() * s.data.element_size() for s in copies[0].values())
        Path(meta).write_text(json.dumps({"request": publish_to_dict(request), "bytes": nbytes}))
        print("lent", flush=True)
        sys.stdin.readline()
    learner = LearnerClient(target)
    for step in range(repeat + 1):
        if step:
            sys.stdin.readline()
        learner.publish(step, copies[step], rank=rank, world_size=ranks, spec=spec)
        print("ok", flush=True)


def _bare_ranks(size_mib: int, index: int, count: int, metas: list[str]) -> None:
    """A reader's bare NIXL READs of its quarter of every tensor's rows from the ranks that hold them (one
    transfer a rank, all in flight together); `ready` once its first READ brought step 0's bytes, then per
    line of stdin the seconds it took."""
    import torch

    from weightsvc.protocol.fabric import new_agent, release_handle
    from weightsvc.protocol.published import publish_from_dict

    agent = new_agent(f"bench-bare-ranks-{index}")
    requests = [publish_from_dict("default", 0, json.loads(Path(m).read_text())["request"]) for m in metas]
    wanted: dict[int, list[tuple[int, int]]] = {}  # rank -> (its address, bytes) to read
    expected: dict[int, list[Any]] = {}  # rank -> the bytes each READ of it must bring
    served = _served(size_mib, range(1))[0]
    for p in requests:
        for t in p.tensors:
            # The reader's rows (fabric's `_rows`: the whole tensor when it has fewer rows than readers),
            # flat elements [lo, hi), and the part of them this rank holds.
            rows = t.shape[0] if t.shape else 0
            inner = t.numel // rows if rows else 0
            lo, hi = (index * rows // count * inner, (index + 1) * rows // count * inner) if rows >= count \
                else (0, t.numel)
            offset, n = t.elements
            lo, hi = max(lo, offset), min(hi, offset + n)
            if lo < hi:
                wanted.setdefault(p.rank, []).append(
                    (t.ranges[0].addr + (lo - offset) * t.itemsize, (hi - lo) * t.itemsize))
                expected.setdefault(p.rank, []).append(served[t.name].reshape(-1)[lo:hi].view(torch.uint8))
    peers = {p.rank: agent.add_remote_agent(p.agent) for p in requests if p.rank in wanted}
    total = sum(n for rs in wanted.values() for _, n in rs)
    into = torch.empty(total, dtype=torch.uint8)
    agent.register_memory([into])
    plans, at = [], into.data_ptr()
    for rank, rs in wanted.items():
        local = []
        for _, n in rs:
            local.append((at, n, 0))
            at += n
        plans.append((agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs([(a, n, 0) for a, n in rs], "DRAM"),
                      peers[rank]))

    def once() -> None:
        handles = [agent.initialize_xfer("READ", local, remote, peer) for local, remote, peer in plans]
        states = [agent.transfer(h) for h in handles]
        while "PROC" in states:
            states = [agent.check_xfer_state(h) if s == "PROC" else s for h, s in zip(handles, states, strict=True)]
        for h in handles:
            release_handle(agent, h)
        if any(s != "DONE" for s in states):
            raise RuntimeError(f"bare READ from the ranks: {states}")

    once()
    if not torch.equal(into, torch.cat([b for rank in wanted for b in expected[rank]])):
        raise RuntimeError("the bare READs brought other bytes than the ranks' copy of step 0")
    print("ready", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        once()
        print(time.perf_counter() - start, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        _rank(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7])
    else:
        _bare_ranks(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
