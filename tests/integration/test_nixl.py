"""The fabric data plane: a `weightsvc serve --nixl` process lends its versions, and reader processes
READ them over NIXL on loopback (UCX picks shared memory) with `InferenceClient.pull_into`.

Leases are the subject here, so some tests wait for a lease's deadline: that deadline is the event.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import itertools
import json
import logging
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import ServeProcess, make_masters, serving
from tests.helpers import free_port, same_bits
from weightsvc import InferenceClient, LearnerClient
from weightsvc.cli._server import WEIGHTSVC_CMD
from weightsvc.errors import FailedPrecondition, InvalidArgument, NotFound
from weightsvc.protocol.manifest import Slice

MODEL = "policy"
READER = [sys.executable, "-m", "tests.integration.nixl_reader"]


@pytest.fixture
def lender(nixl_installed: None) -> Iterator[ServeProcess]:
    srv = ServeProcess("--nixl", "--retain", "1")
    yield srv
    srv.stop()


def read(target: str, out: Path, *args: str, version: str = "latest") -> tuple[int, str]:
    """A reader process's exit code and last line."""
    done = subprocess.run([*READER, target, MODEL, version, str(out), *args], capture_output=True, text=True,
                          timeout=120)
    lines = done.stdout.strip().splitlines()
    return done.returncode, (lines[-1] if lines else done.stderr[-2000:])


def reader(target: str, out: Path, *args: str, version: str = "latest", wait: bool = True) -> subprocess.Popen[str]:
    """A reader that waits (`--wait`): it has its lease once it printed `leased V S`. Its log (stderr)
    comes back from `go_on`."""
    return subprocess.Popen([*READER, target, MODEL, version, str(out), *(["--wait"] if wait else []), *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def leased(proc: subprocess.Popen[str]) -> float:
    """Wait for the reader's lease; the lease's seconds."""
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line[:1] == ["leased"], line
    return float(line[2])


def go_on(proc: subprocess.Popen[str], said: list[str] | None = None) -> str:
    """Let a waiting reader read; its last line (its log added to `said`)."""
    out, err = proc.communicate("\n", timeout=120)
    if said is not None:
        said.append(err)
    return out.strip().splitlines()[-1]


def metrics_of(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines())
            if k.startswith(("weightsvc_nixl_", "weightsvc_pulls_in_flight"))}


def metrics(srv: ServeProcess) -> dict[str, float]:
    return metrics_of(srv.url)


def served(srv: ServeProcess, version: int | str = "latest") -> dict[str, torch.Tensor]:
    with InferenceClient(srv.url) as c:
        return c.pull(MODEL, version)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b) and all(a[name].dtype == b[name].dtype for name in a)
    same_bits(a, b)


def test_a_reader_process_reads_a_version_over_nixl_on_each_transport(lender: ServeProcess, tmp_path: Path) -> None:
    LearnerClient(lender.target).push(1, make_masters(), model=MODEL)
    expected = served(lender)
    for target in (lender.target, lender.url):
        rc, line = read(target, tmp_path / "read.pt", "--no-fallback")
        assert (rc, line) == (0, "ok 1")
        same(torch.load(tmp_path / "read.pt"), expected)
    m = metrics(lender)
    nbytes = sum(t.numel() * t.element_size() for t in expected.values())
    assert m[f'weightsvc_nixl_reads_total{{model="{MODEL}"}}'] == 2
    assert m[f'weightsvc_nixl_read_bytes_total{{model="{MODEL}"}}'] == 2 * nbytes
    assert m["weightsvc_nixl_leases"] == 0 and m["weightsvc_nixl_registered_bytes"] == 0
    assert m['weightsvc_pulls_in_flight{transport="nixl"}'] == 0


def test_a_version_in_the_data_dir_is_read_from_its_file_s_mapping(nixl_installed: None, tmp_path: Path) -> None:
    srv = ServeProcess("--nixl", "--data-dir", str(tmp_path / "data"))
    try:
        LearnerClient(srv.target).push(1, make_masters(), model=MODEL)
        rc, line = read(srv.target, tmp_path / "read.pt", "--no-fallback", "--select", "embed.weight@0:10:20")
        assert (rc, line) == (0, "ok 1")
        same(torch.load(tmp_path / "read.pt"), {"embed.weight": served(srv)["embed.weight"][10:20]})
    finally:
        srv.stop()


def test_a_sliced_read_brings_exactly_the_rows_and_columns_asked_for(lender: ServeProcess, tmp_path: Path) -> None:
    LearnerClient(lender.target).push(1, make_masters(), model=MODEL)
    whole = served(lender)
    rc, line = read(lender.url, tmp_path / "read.pt", "--no-fallback", "--select", "layers.0.mlp.up.weight@0:37:201",
                    "embed.weight@1:5:9", "lm_head.bias")
    assert (rc, line) == (0, "ok 1")
    got = torch.load(tmp_path / "read.pt")
    same(got, {"layers.0.mlp.up.weight": whole["layers.0.mlp.up.weight"][37:201].contiguous(),
               "embed.weight": whole["embed.weight"][:, 5:9].contiguous(), "lm_head.bias": whole["lm_head.bias"]})


def test_a_read_in_pieces_that_cut_across_tensors_and_ranges_is_checked_whole(lender: ServeProcess,
                                                                              tmp_path: Path) -> None:
    """A READ moves a piece at a time and each piece's bytes are hashed while the next one moves: with
    pieces of 1,000 bytes every tensor is cut mid-way and a piece holds the end of one tensor, the
    start of the next and dozens of a column slice's ranges; the bytes and every checksum still hold."""
    LearnerClient(lender.target).push(1, make_masters(), model=MODEL)
    whole = served(lender)
    rc, line = read(lender.target, tmp_path / "read.pt", "--no-fallback", "--piece-bytes", "1000")
    assert (rc, line) == (0, "ok 1")
    same(torch.load(tmp_path / "read.pt"), whole)
    rc, line = read(lender.url, tmp_path / "read.pt", "--no-fallback", "--piece-bytes", "1000", "--select",
                    "embed.weight@1:5:9", "layers.0.mlp.up.weight@0:37:201", "scalar")
    assert (rc, line) == (0, "ok 1")
    same(torch.load(tmp_path / "read.pt"), {"embed.weight": whole["embed.weight"][:, 5:9].contiguous(),
                                            "layers.0.mlp.up.weight": whole["layers.0.mlp.up.weight"][37:201],
                                            "scalar": whole["scalar"]})
    m = metrics(lender)
    assert m["weightsvc_nixl_leases"] == 0 and m["weightsvc_nixl_registered_bytes"] == 0


def lease_of(url: str, body: dict[str, object], version: int | str = "latest") -> dict[str, object]:
    """A lease answered over HTTP, released at once (its ranges are what a test looks at)."""
    status, text = _request(url, "POST", f"/v1/models/{MODEL}/versions/{version}/lease", body)
    assert status == 200, text
    lent: dict[str, object] = json.loads(text)
    assert _request(url, "DELETE", f"/v1/leases/{lent['lease_id']}")[0] == 204
    return lent


def test_each_slice_is_read_through_as_few_descriptors_as_its_layout_allows(lender: ServeProcess,
                                                                          tmp_path: Path) -> None:
    masters = {**make_masters(), "experts.w": torch.randn(4, 6, 8)}
    LearnerClient(lender.target).push(1, masters, model=MODEL)
    whole = served(lender)
    select = {"layers.0.mlp.up.weight@0:37:201": whole["layers.0.mlp.up.weight"][37:201],  # rows: one range
              "embed.weight@1:5:9": whole["embed.weight"][:, 5:9],  # columns: one range per row
              "experts.w@0:1:3": whole["experts.w"][1:3]}  # a range of dim 0: one range
    lent = lease_of(lender.url, {"select": list(select)})
    ranges = {name: [tuple(r) for r in rs] for name, rs in lent["ranges"].items()}  # type: ignore[attr-defined]
    up, embed, experts = ranges["layers.0.mlp.up.weight"], ranges["embed.weight"], ranges["experts.w"]
    assert [n for _, n, _ in up] == [164 * 64 * 2]
    assert [n for _, n, _ in embed] == [4 * 2] * 97  # 4 bf16 columns of each of its 97 rows
    assert {b[0] - a[0] for a, b in itertools.pairwise(embed)} == {64 * 2}  # one row apart
    assert [n for _, n, _ in experts] == [2 * 6 * 8 * 2]
    # Dims in the middle and at the end of a 3-D tensor: one range per index of the dims before.
    inner = lease_of(lender.url, {"select": ["experts.w@1:2:5"]})["ranges"]["experts.w"]  # type: ignore[index]
    last = lease_of(lender.url, {"select": ["experts.w@2:3:8"]})["ranges"]["experts.w"]  # type: ignore[index]
    assert [r[1] for r in inner] == [3 * 8 * 2] * 4 and [r[1] for r in last] == [5 * 2] * 24
    # One reader reads the three cuts of `select` together (as a tensor-parallel worker reads its slices),
    # then one for each cut of experts.w's inner dims.
    reads = [select, {"experts.w@1:2:5": whole["experts.w"][:, 2:5]}, {"experts.w@2:3:8": whole["experts.w"][..., 3:8]}]
    for cuts in reads:
        rc, line = read(lender.target, tmp_path / "read.pt", "--no-fallback", "--select", *cuts)
        assert (rc, line) == (0, "ok 1"), cuts
        same(torch.load(tmp_path / "read.pt"), {cut.partition("@")[0]: t.contiguous() for cut, t in cuts.items()})
    m = metrics(lender)
    assert m["weightsvc_nixl_leases"] == 0 and m["weightsvc_nixl_registered_bytes"] == 0


def test_a_delta_read_moves_only_the_encoding_and_patches_the_version_held(nixl_installed: None,
                                                                          tmp_path: Path) -> None:
    from weightsvc.protocol.delta import encode

    srv = ServeProcess("--nixl", "--retain", "2", "--rounding", "rtn")  # (same masters: the same served bits)
    try:
        learner = LearnerClient(srv.target)
        first = make_masters(1)
        learner.push(1, first, model=MODEL)
        moved = {**first, "layers.0.mlp.up.weight": first["layers.0.mlp.up.weight"].clone()}
        moved["layers.0.mlp.up.weight"][3, :5] += 1.0  # five elements of one tensor
        learner.push(2, moved, model=MODEL)
        with InferenceClient(srv.url) as c:
            (m1, d1), (m2, d2) = c.pull_data(MODEL, 1), c.pull_data(MODEL, 2)
        encoding = len(encode(m2, d2, d1))
        assert encoding < m2.data_bytes // 10
        rc, line = read(srv.target, tmp_path / "read.pt", "--no-fallback", "--base", "1", version="2")
        assert (rc, line) == (0, "ok 2")
        same(torch.load(tmp_path / "read.pt"), served(srv, 2))
        m = metrics(srv)
        assert m[f'weightsvc_nixl_read_bytes_total{{model="{MODEL}"}}'] == m1.data_bytes + encoding  # v1, the delta
        # Tensors that do not hold the base they claim: patched, they fail their checksums, by name.
        rc, line = read(srv.url, tmp_path / "bad.pt", "--no-fallback", "--base", "1", "--base-unread", version="2")
        assert rc == 3 and line.startswith("error DATA_LOSS") and "checksum mismatch" in line, line
        assert f"model '{MODEL}' version 2" in line and "tensor '" in line
        assert not (tmp_path / "bad.pt").exists()
        # A base no longer retained: no delta, the version is lent whole (and the zeros read over).
        learner.push(3, first, model=MODEL)
        rc, line = read(srv.url, tmp_path / "read.pt", "--no-fallback", "--base", "1", "--base-unread", version="3")
        assert (rc, line) == (0, "ok 3")
        same(torch.load(tmp_path / "read.pt"), served(srv, 3))
        m = metrics(srv)
        assert m["weightsvc_nixl_leases"] == 0 and m["weightsvc_nixl_registered_bytes"] == 0
    finally:
        srv.stop()


def test_a_lease_keeps_its_version_past_retention(lender: ServeProcess, tmp_path: Path) -> None:
    learner = LearnerClient(lender.target)
    learner.push(1, make_masters(1), model=MODEL)
    first = served(lender, 1)
    proc = reader(lender.target, tmp_path / "read.pt", "--no-fallback", version="1")
    leased(proc)
    learner.push(2, make_masters(2), model=MODEL)  # --retain 1: version 1 is no longer listed or pulled
    with InferenceClient(lender.url) as c:
        assert [v.version for v in c.versions(MODEL)] == [2]
        with pytest.raises(NotFound):
            c.pull(MODEL, 1)
    assert go_on(proc) == "ok 1"
    same(torch.load(tmp_path / "read.pt"), first)
    assert metrics(lender)["weightsvc_nixl_registered_bytes"] == 0


def test_an_expired_lease_fails_its_reader(lender: ServeProcess, tmp_path: Path) -> None:
    LearnerClient(lender.target).push(1, make_masters(), model=MODEL)
    proc = reader(lender.url, tmp_path / "read.pt", "--no-fallback", "--lease-s", "1")
    time.sleep(leased(proc))  # past the lease's deadline
    line = go_on(proc)
    assert proc.returncode == 3 and line.startswith("error DEADLINE_EXCEEDED"), line
    assert f"model '{MODEL}' version 1" in line and "expired" in line
    assert not (tmp_path / "read.pt").exists()
    m = metrics(lender)
    assert m['weightsvc_nixl_failures_total{reason="expired"}'] == 1
    assert m["weightsvc_nixl_leases"] == 0 and f'weightsvc_nixl_reads_total{{model="{MODEL}"}}' not in m


def test_a_reader_killed_mid_read_leaves_the_server_well_and_its_lease_ends_at_its_deadline(
    lender: ServeProcess, tmp_path: Path
) -> None:
    learner = LearnerClient(lender.target)
    learner.push(1, make_masters(), model=MODEL)
    data_bytes = served_bytes(lender)
    # A lease that outlives the dead one: the longest the server lends (the machine may be slow to get there).
    holding = reader(lender.target, tmp_path / "held.pt", "--no-fallback", "--lease-s", "300", version="1")
    leased(holding)
    proc = subprocess.Popen([*READER, lender.target, MODEL, "1", str(tmp_path / "dead.pt"), "--lease-s", "2",
                             "--die-mid-read"], stdout=subprocess.PIPE, text=True)
    lease_s = leased(proc)
    assert proc.wait(60) == -9  # killed itself once its READ was posted
    assert metrics(lender)["weightsvc_nixl_leases"] == 2
    rc, line = read(lender.target, tmp_path / "read.pt", "--no-fallback")  # the server reads on meanwhile
    assert (rc, line) == (0, "ok 1")
    same(torch.load(tmp_path / "read.pt"), served(lender))
    time.sleep(lease_s)  # past the dead reader's deadline
    m = metrics(lender)
    assert m["weightsvc_nixl_leases"] == 1 and m['weightsvc_nixl_failures_total{reason="expired"}'] == 1
    assert m["weightsvc_nixl_registered_bytes"] == data_bytes  # the other lease holds it registered
    assert go_on(holding) == "ok 1"
    m = metrics(lender)
    assert m["weightsvc_nixl_leases"] == 0 and m["weightsvc_nixl_registered_bytes"] == 0
    assert m['weightsvc_pulls_in_flight{transport="nixl"}'] == 0
    learner.push(2, make_masters(2), model=MODEL)  # version 1 goes: nothing holds it any more
    with InferenceClient(lender.url) as c:
        assert [v.version for v in c.versions(MODEL)] == [2]


def served_bytes(srv: ServeProcess, version: int | str = "latest") -> int:
    with InferenceClient(srv.url) as c:
        return c.manifest(MODEL, version).data_bytes


@pytest.fixture
def two_sources(nixl_installed: None) -> Iterator[tuple[ServeProcess, ServeProcess]]:
    """An upstream and a relay of it, both lending over NIXL, each naming the other as a source (the
    relay's port is chosen first: the upstream names it before it listens)."""
    port = free_port()
    upstream = ServeProcess("--nixl", "--nixl-sources", f"127.0.0.1:{port}")
    try:
        relay = ServeProcess("--nixl", "--relay-from", upstream.target, "--grpc-port", str(port))
    except BaseException:
        upstream.stop()
        raise
    yield upstream, relay
    for srv in (relay, upstream):
        if srv.proc.poll() is None:
            srv.stop()


def test_readers_read_from_two_sources_and_move_to_the_other_when_one_dies(
    two_sources: tuple[ServeProcess, ServeProcess], tmp_path: Path
) -> None:
    upstream, relay = two_sources
    LearnerClient(upstream.target).push(1, make_masters(), model=MODEL)
    with InferenceClient(relay.target) as c:
        assert next(c.watch(MODEL)).version == 1  # the relay holds it
    expected = served(upstream)
    # Four readers, two at each source: each reads from the one it asked.
    readers = {i: reader(src.target, tmp_path / f"{i}.pt", "--no-fallback")
               for i, src in enumerate((upstream, upstream, relay, relay))}
    for proc in readers.values():
        leased(proc)
    assert [go_on(proc) for proc in readers.values()] == ["ok 1"] * 4
    for i in readers:
        same(torch.load(tmp_path / f"{i}.pt"), expected)
    assert metrics(upstream)[f'weightsvc_nixl_reads_total{{model="{MODEL}"}}'] == 2
    assert metrics(relay)[f'weightsvc_nixl_reads_total{{model="{MODEL}"}}'] == 2
    # The relay dies while its two readers hold leases there: they move to the upstream, its lease names.
    readers = {i: reader(src.target, tmp_path / f"moved-{i}.pt", "--no-fallback")
               for i, src in enumerate((upstream, relay, relay))}
    for proc in readers.values():
        leased(proc)
    relay.kill()
    said: list[str] = []
    assert [go_on(proc, said) for proc in readers.values()] == ["ok 1"] * 3
    for i in readers:
        same(torch.load(tmp_path / f"moved-{i}.pt"), expected)
    assert [f"moving to {upstream.target}" in log for log in said] == [False, True, True], said
    m = metrics(upstream)
    assert m[f'weightsvc_nixl_reads_total{{model="{MODEL}"}}'] == 5
    assert m["weightsvc_nixl_leases"] == 0 and m["weightsvc_nixl_registered_bytes"] == 0


def test_a_server_killed_mid_read_fails_its_reader_cleanly_when_no_source_is_left(
    two_sources: tuple[ServeProcess, ServeProcess], tmp_path: Path
) -> None:
    upstream, relay = two_sources
    LearnerClient(upstream.target).push(1, make_masters(), model=MODEL)
    relay.kill()  # the upstream's lease names it: tried next, it cannot lend either
    readers = [reader(upstream.target, tmp_path / f"{i}.pt", "--pause-mid-read", *args, wait=False)
               for i, args in enumerate((["--no-fallback"], []))]  # the second would fall back to TCP
    for proc in readers:
        leased(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "reading"
    upstream.kill()  # while both READs are posted
    lines = [go_on(proc) for proc in readers]
    assert [proc.returncode for proc in readers] == [3, 3], lines
    assert lines[0].startswith("error UNAVAILABLE") and f"model '{MODEL}' version 1" in lines[0], lines
    assert "no source could lend it over NIXL" in lines[0] and upstream.target in lines[0]
    assert lines[1].startswith("error UNAVAILABLE"), lines  # and over TCP: the server is gone
    assert not any((tmp_path / f"{i}.pt").exists() for i in range(2))  # nothing presented as a version


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_without_nixl_on_the_server_a_pull_into_says_so_and_goes_over_tcp(
    transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    with serving() as srv:
        LearnerClient(srv.grpc_target).push(1, make_masters(), model=MODEL)
        with InferenceClient(srv.grpc_target if transport == "grpc" else srv.http_url) as client:
            expected = client.pull(MODEL)
            into = {name: torch.empty_like(t) for name, t in expected.items()}
            with caplog.at_level(logging.WARNING, logger="weightsvc.client"):
                assert client.pull_into(into, MODEL).version == 1
            same(into, expected)
            said = [r.getMessage() for r in caplog.records if r.name == "weightsvc.client"]
            assert len(said) == 1 and "NIXL cannot reach" in said[0] and "--nixl" in said[0], said
            with pytest.raises(FailedPrecondition, match="without --nixl"):
                client.pull_into(into, MODEL, fallback=False)
            into = {"embed.weight": torch.empty(4, 64, dtype=torch.bfloat16)}
            caplog.clear()
            client.pull_into(into, MODEL, select={"embed.weight": Slice(0, 3, 7)})
            same(into, {"embed.weight": expected["embed.weight"][3:7]})


def _request(url: str, method: str, path: str, body: object = None) -> tuple[int, str]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, text


@pytest.mark.usefixtures("nixl_installed")
def test_bad_leases_and_destinations_are_refused_by_name_and_hold_nothing(tmp_path: Path) -> None:
    with serving(nixl=True, retain=1) as srv:
        LearnerClient(srv.grpc_target).push(1, make_masters(), model=MODEL)
        lease = f"/v1/models/{MODEL}/versions/1/lease"
        refused = {
            (f"/v1/models/{MODEL}/versions/9/lease", "{}"): (404, "no version 9"),
            ("/v1/models/nobody/versions/latest/lease", "{}"): (404, "unknown model 'nobody'"),
            (lease, json.dumps({"select": ["nope"]})): (400, "no tensor 'nope'"),
            (lease, json.dumps({"select": ["embed.weight@0:90:200"]})): (400, "tensor 'embed.weight'"),
            (lease, json.dumps({"select": ["embed.weight@2:0:1"]})): (400, "no dim 2"),
            (lease, json.dumps({"lease_s": 0})): (400, "a lease of 0"),
            (lease, json.dumps({"lease_s": -5})): (400, "a lease of -5"),
            (lease, '{"lease_s": NaN}'): (400, "a lease of nan"),
            (lease, '{"lease_s": Infinity}'): (400, "a lease of inf"),
            (lease, json.dumps({"lease_s": "soon"})): (400, ""),
            (lease, "not json"): (400, ""),
        }
        for (path, body), (status, words) in refused.items():
            u = urllib.parse.urlsplit(srv.http_url)
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
            conn.request("POST", path, body=body.encode(), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            text = resp.read().decode()
            assert resp.status == status and words in text, (path, body, resp.status, text)
        assert _request(srv.http_url, "DELETE", "/v1/leases/never-lent")[0] == 404
        status, text = _request(srv.http_url, "POST", lease, {"lease_s": 30})
        assert status == 200
        lease_id = json.loads(text)["lease_id"]
        assert _request(srv.http_url, "DELETE", f"/v1/leases/{lease_id}")[0] == 204
        assert _request(srv.http_url, "DELETE", f"/v1/leases/{lease_id}")[0] == 404  # released once
        with InferenceClient(srv.http_url) as client:
            good = {name: torch.empty_like(t) for name, t in client.pull(MODEL).items()}
            bad = {
                "a missing tensor": {k: v for k, v in good.items() if k != "embed.weight"},
                "another dtype": {**good, "embed.weight": torch.empty(97, 64, dtype=torch.float32)},
                "another shape": {**good, "embed.weight": torch.empty(96, 64, dtype=torch.bfloat16)},
                "not contiguous": {**good, "embed.weight": torch.empty(64, 97, dtype=torch.bfloat16).t()},
            }
            for why, into in bad.items():
                with pytest.raises(InvalidArgument, match=r"tensor 'embed\.weight'"):
                    client.pull_into(into, MODEL, fallback=False)
                assert srv.service.lender is not None and len(srv.service.lender) == 0, why
        metrics_text = urllib.request.urlopen(srv.http_url + "/metrics").read().decode()
        assert 'weightsvc_nixl_failures_total{reason="unknown_lease"} 2.0' in metrics_text


def test_without_the_nixl_extra_serve_nixl_refuses_and_everything_else_works(tmp_path: Path) -> None:
    """NIXL hidden from the processes (an installed one, shadowed by a package that fails to import)."""
    shadow = tmp_path / "shadow"
    for package in ("nixl", "nixl_cu12"):
        (shadow / package).mkdir(parents=True)
        (shadow / package / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", ""), os.getcwd()])}
    refused = subprocess.run([*WEIGHTSVC_CMD, "serve", "--nixl", "--grpc-port", "0", "--http-port", "0",
                              "--probe-port", "0"], capture_output=True, text=True, timeout=120,
                             env={**os.environ, **env})
    assert refused.returncode != 0 and "NIXL is not installed: pip install 'weightsvc[nixl]'" in refused.stderr
    srv = ServeProcess(env=env)  # the embedded default
    try:
        LearnerClient(srv.target).push(1, make_masters(), model=MODEL)
        for args, (rc, line) in {("--no-fallback",): (3, "error UNAVAILABLE NIXL is not installed"),
                                 (): (0, "ok 1")}.items():
            done = subprocess.run([*READER, srv.url, MODEL, "latest", str(tmp_path / "read.pt"), *args],
                                  capture_output=True, text=True, timeout=120, env={**os.environ, **env})
            assert done.returncode == rc and done.stdout.strip().splitlines()[-1].startswith(line), done
        assert done.stderr.count("NIXL cannot reach") == 1
        same(torch.load(tmp_path / "read.pt"), served(srv))
    finally:
        srv.stop()


@pytest.mark.usefixtures("nixl_installed")
def test_leases_taken_at_once_share_one_registration_until_the_last_ends() -> None:
    with serving(nixl=True) as srv:
        LearnerClient(srv.grpc_target).push(1, make_masters(), model=MODEL)
        data_bytes = srv.service.manifest(MODEL, 1).data_bytes
        path = f"/v1/models/{MODEL}/versions/1/lease"
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: _request(srv.http_url, "POST", path, {}), range(8)))
        assert [status for status, _ in answers] == [200] * 8
        lent = [json.loads(text) for _, text in answers]
        m = metrics_of(srv.http_url)
        assert m["weightsvc_nixl_leases"] == 8 and m["weightsvc_nixl_registered_bytes"] == data_bytes
        for lease in lent[:-1]:
            assert _request(srv.http_url, "DELETE", f"/v1/leases/{lease['lease_id']}")[0] == 204
        assert metrics_of(srv.http_url)["weightsvc_nixl_registered_bytes"] == data_bytes  # the last lease holds it
        assert _request(srv.http_url, "DELETE", f"/v1/leases/{lent[-1]['lease_id']}")[0] == 204
        m = metrics_of(srv.http_url)
        assert m["weightsvc_nixl_leases"] == 0 and m["weightsvc_nixl_registered_bytes"] == 0
        assert m[f'weightsvc_nixl_reads_total{{model="{MODEL}"}}'] == 8


@pytest.mark.usefixtures("nixl_installed")
def test_a_lease_bigger_than_a_grpc_message_comes_in_pieces() -> None:
    # 12,000 tensors of long names: the lease (manifest and ranges) is over the 8 MiB a gRPC message takes.
    from weightsvc.protocol.fabric import lease_to_proto

    names = [f"model.layers.{i}." + "very_long_module_name." * 12 + "weight" for i in range(16_000)]
    with serving(nixl=True) as srv:
        LearnerClient(srv.grpc_target).push(1, dict(zip(names, torch.randn(len(names), 4).unbind(0), strict=True)),
                                            model=MODEL)
        with InferenceClient(srv.grpc_target) as grpc_client:
            lent = grpc_client._lease(MODEL, "1", None, 60.0)
            assert srv.service.lender is not None and len(srv.service.lender) == 1
            whole = grpc_client.manifest(MODEL, 1)
            assert lent.manifest == whole and len(lent.ranges) == len(names)
            held = srv.service.lent(lent.lease_id)
            assert lent.ranges == held.ranges  # every piece, in order
            sizes, got = [], 0
            while got < len(names):  # the pieces the client asked for
                piece = lease_to_proto(held, got)
                sizes.append(piece.ByteSize())
                got += len(piece.manifest.tensors)
            assert len(sizes) > 2 and max(sizes) < 8 << 20 < sum(sizes), sizes
            grpc_client._release(lent.lease_id)
        assert len(srv.service.lender) == 0
