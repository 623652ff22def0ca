"""Publish (`serve --nixl`): learner ranks publish the served copy they exported; the server READs every
rank's bytes over NIXL (loopback: UCX picks shared memory), checks them, and commits the version.

The server is a `weightsvc serve --nixl` process; ranks are this process, or processes of their own
(tests/integration/publish_rank.py) where a rank must die or several must publish at once. A rank that
waits is seen waiting in the server's `weightsvc_publishes_in_flight`, the event these tests wait on.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tests.conftest import ServeProcess, serving
from tests.helpers import same_bits
from tests.integration.publish_rank import SPEC, masters, moved, share
from weightsvc import InferenceClient, LearnerClient
from weightsvc.client import RankLag
from weightsvc.client._nixl_publish import published
from weightsvc.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, WeightsvcError
from weightsvc.integrations.fair_cast import masters_digest_of, served_state_dict
from weightsvc.protocol.lag import LagMetrics
from weightsvc.protocol.published import publish_to_proto
from weightsvc.rounding import ExportSpec, Residual
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc

RANK = [sys.executable, "-m", "tests.integration.publish_rank"]
RANK_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def copier(nixl_installed: None) -> Iterator[ServeProcess]:
    srv = ServeProcess("--nixl", "--push-rank-timeout-s", str(RANK_TIMEOUT_S))
    yield srv
    srv.stop()


def ranks(srv: ServeProcess, model: str, step: int, world_size: int, *args: tuple[str, ...],
          which: tuple[int, ...] | None = None) -> list[subprocess.Popen[str]]:
    """Rank processes (`which`: all of `world_size`; `args`: each one's extra arguments), let go to
    publish together once every one is ready."""
    which = tuple(range(world_size)) if which is None else which
    procs = [subprocess.Popen([*RANK, srv.target, model, str(step), str(r), str(world_size),
                               *(args[i] if i < len(args) else ())],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, r in enumerate(which)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "ready\n", p.stderr.read() if p.stderr else ""
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    return procs


def last_line(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=120)
    lines = out.strip().splitlines()
    assert lines, err[-2000:]
    return lines[-1]


def waiting(srv: ServeProcess) -> float:
    """The publish calls the server holds (waiting for their ranks, or their version)."""
    text = urllib.request.urlopen(srv.url + "/metrics", timeout=30).read().decode()
    return float(re.search(r"^weightsvc_publishes_in_flight (\S+)$", text, re.MULTILINE).group(1))  # type: ignore[union-attr]


def until(what: str, predicate: Callable[[], bool], timeout: float = 60) -> None:
    """Poll `predicate` (the server's state, seen from outside) until it holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def versions(srv: ServeProcess, model: str) -> list[int]:
    with InferenceClient(srv.target) as client:
        try:
            return [v.version for v in client.versions(model)]
        except NotFound:
            return []


def test_a_published_copy_is_bit_for_bit_what_a_push_of_its_masters_serves(copier: ServeProcess) -> None:
    m = masters()
    served = served_state_dict(m, SPEC, version=1)
    before = {name: t.clone() for name, t in served.items()}
    with LearnerClient(copier.target) as learner:
        info = learner.publish(1, served, "one-rank", spec=SPEC, master_digest=masters_digest_of(m))
    assert (info.model, info.version, info.created, info.tensor_count) == ("one-rank", 1, True, len(served))
    same_bits(served, before)  # (the learner's memory is only read)
    with InferenceClient(copier.target) as client:
        pulled = client.pull("one-rank", 1)
        manifest = client.manifest("one-rank", 1)
    same_bits(pulled, served)
    with serving() as other, LearnerClient(other.grpc_target) as learner, InferenceClient(other.grpc_target) as client:
        learner.push(1, m, "one-rank")  # the fp32 masters to a server with the same spec
        same_bits(client.pull("one-rank", 1), pulled)
        pushed = client.manifest("one-rank", 1)
    assert {t.name: t.checksum for t in manifest.tensors} == {t.name: t.checksum for t in pushed.tensors}
    assert manifest.master_digest == pushed.master_digest
    assert (manifest.format, manifest.rounding, manifest.seed) == ("bf16", "sr", 0)


def test_two_rank_processes_each_publish_half_of_every_tensor_and_the_version_commits_once(
        copier: ServeProcess) -> None:
    answers = [last_line(p) for p in ranks(copier, "two-ranks", 1, 2)]
    assert answers == ["ok 1 True", "ok 1 True"]  # (every rank answers what the commit did)
    with InferenceClient(copier.target) as client:
        same_bits(client.pull("two-ranks", 1), served_state_dict(masters(), SPEC, version=1))
    assert versions(copier, "two-ranks") == [1]


def test_a_checksum_that_does_not_match_is_data_loss_naming_tensor_and_rank_and_commits_nothing(
        copier: ServeProcess) -> None:
    served = served_state_dict(masters(), SPEC, version=1)
    held = {name: (t, 0, None) for name, t in served.items()}
    with published(held, model="bad-sum", step=1, rank=0, world_size=1, spec=SPEC, master_digest="",
                   aliases={}) as request:
        wrong = tuple(dataclasses.replace(t, checksum="xxh3_64:0123456789abcdef") if t.name == "lm_head.bias" else t
                      for t in request.tensors)
        with grpc.insecure_channel(copier.target) as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.WeightServiceStub(channel).Publish(publish_to_proto(dataclasses.replace(request, tensors=wrong)))
    assert refused.value.code() == grpc.StatusCode.DATA_LOSS
    assert "model 'bad-sum' step 1 tensor 'lm_head.bias' rank 0" in (refused.value.details() or "")
    assert versions(copier, "bad-sum") == []
    with LearnerClient(copier.target) as learner:  # the next try commits
        assert learner.publish(1, served, "bad-sum", spec=SPEC).version == 1


def test_ranks_that_disagree_on_a_shape_are_refused_naming_the_tensor_and_both_ranks(copier: ServeProcess) -> None:
    for p in ranks(copier, "shapes", 1, 2, (), ("--shape", "embed.weight=64,97")):
        answer = last_line(p)
        assert answer.startswith("error InvalidArgument"), answer
        assert "tensor 'embed.weight'" in answer and "rank 0 declares BF16 of shape [97, 64]" in answer
        assert "rank 1 declares BF16 of shape [64, 97]" in answer
    assert versions(copier, "shapes") == []


def test_a_rank_that_never_comes_fails_the_others_naming_it_and_the_step_commits_later(copier: ServeProcess) -> None:
    served = served_state_dict(masters(), SPEC, version=3)
    with LearnerClient(copier.target) as learner:
        with pytest.raises(DeadlineExceeded, match=r"model 'alone' step 3: rank\(s\) 1 of world_size 2 did not "
                                                   rf"publish within {RANK_TIMEOUT_S} s \(--push-rank-timeout-s\)"):
            learner.publish(3, share(served, 0, 2), "alone", world_size=2, spec=SPEC)
        assert versions(copier, "alone") == []
        assert learner.publish(3, served, "alone", spec=SPEC).version == 3


def test_a_rank_killed_while_it_waits_commits_nothing_and_the_server_stays_well(copier: ServeProcess) -> None:
    (doomed,) = ranks(copier, "killed", 1, 2, which=(0,))
    until("rank 0's publish waits in the server", lambda: waiting(copier) == 1)
    doomed.kill()
    doomed.wait(30)
    until("the server let go of the killed rank's call", lambda: waiting(copier) == 0)
    served = served_state_dict(masters(), SPEC, version=1)
    with LearnerClient(copier.target) as learner, pytest.raises(DeadlineExceeded, match=r"rank\(s\) 0 of world_size 2"):
        learner.publish(1, share(served, 1, 2), "killed", rank=1, world_size=2, spec=SPEC)
    assert versions(copier, "killed") == []
    assert [last_line(p).split()[:2] for p in ranks(copier, "killed", 1, 2)] == [["ok", "1"], ["ok", "1"]]
    assert versions(copier, "killed") == [1]


def test_a_spec_other_than_the_servers_is_refused_naming_both(copier: ServeProcess) -> None:
    rtn = ExportSpec("bf16", "rtn", seed=7)
    served = served_state_dict(masters(), rtn, version=1)
    with LearnerClient(copier.target) as learner, pytest.raises(FailedPrecondition) as refused:
        learner.publish(1, served, "other-spec", spec=rtn)
    assert "rounding 'rtn' (the server's: 'sr')" in refused.value.message
    assert "seed 7 (the server's: 0)" in refused.value.message
    assert versions(copier, "other-spec") == []


def test_a_server_without_nixl_refuses_a_publish_naming_the_flag(nixl_installed: None) -> None:
    served = served_state_dict(masters(), SPEC, version=1)
    with serving() as srv:
        for target in (srv.grpc_target, srv.http_url):
            with LearnerClient(target) as learner, pytest.raises(FailedPrecondition, match="without --nixl"):
                learner.publish(1, served, "no-nixl", spec=SPEC)


def test_a_publish_over_http_commits_as_over_grpc(copier: ServeProcess) -> None:
    served = served_state_dict(masters(), SPEC, version=5)
    with LearnerClient(copier.url) as learner:
        assert learner.publish(5, served, "over-http", spec=SPEC).version == 5
    with InferenceClient(copier.url) as client:
        same_bits(client.pull("over-http", 5), served)


@pytest.fixture(scope="module")
def fp8_copier(nixl_installed: None) -> Iterator[ServeProcess]:
    srv = ServeProcess("--nixl", "--format", "fp8_e4m3")
    yield srv
    srv.stop()


def test_an_fp8_copy_commits_and_tensors_the_format_does_not_make_are_refused_by_name(
        fp8_copier: ServeProcess) -> None:
    fp8 = ExportSpec("fp8_e4m3", "sr", seed=0)
    served = served_state_dict(masters(), fp8, version=1)
    qkv = "layers.0.attn.qkv.weight"
    assert served[qkv].dtype == torch.float8_e4m3fn and f"{qkv}_scale_inv" in served
    with LearnerClient(fp8_copier.target) as learner:
        bf16 = served_state_dict(masters(), SPEC, version=1)
        with pytest.raises(InvalidArgument, match=rf"tensor '{qkv}': fp8_e4m3 serves this master of shape "
                                                  rf"\[192, 64\] as '{qkv}' \(F8_E4M3 \[192, 64\]\), "
                                                  rf"'{qkv}_scale_inv' \(F32 \[2, 1\]\)"):
            learner.publish(1, bf16, "fp8", spec=fp8)  # a bf16 copy said to be fp8
        scaleless = {name: t for name, t in served.items() if name != "layers.0.mlp.up.weight_scale_inv"}
        with pytest.raises(InvalidArgument, match=r"tensor 'layers\.0\.mlp\.up\.weight'"):
            learner.publish(1, scaleless, "fp8", spec=fp8)
        assert versions(fp8_copier, "fp8") == []
        assert learner.publish(1, served, "fp8", spec=fp8).version == 1
    with InferenceClient(fp8_copier.target) as client:
        same_bits(client.pull("fp8", 1), served)


def test_ranks_of_one_process_publish_from_threads(copier: ServeProcess) -> None:
    """Two ranks in threads of one process share its agent, each its own memory registered."""
    served = served_state_dict(masters(), SPEC, version=1)
    got: dict[int, object] = {}

    def publish(r: int) -> None:
        try:
            with LearnerClient(copier.target) as learner:
                got[r] = learner.publish(1, share(served, r, 2), "threads", rank=r, world_size=2, spec=SPEC).version
        except WeightsvcError as e:
            got[r] = e

    threads = [threading.Thread(target=publish, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {0: 1, 1: 1}


def test_a_published_version_is_durable_in_the_data_dir(nixl_installed: None, tmp_path: Path) -> None:
    served = served_state_dict(masters(), SPEC, version=1)
    srv = ServeProcess("--nixl", "--data-dir", str(tmp_path))
    try:
        with LearnerClient(srv.target) as learner:
            assert learner.publish(1, served, "durable", spec=SPEC).version == 1
    finally:
        srv.stop()
    again = ServeProcess("--nixl", "--data-dir", str(tmp_path))
    try:
        with InferenceClient(again.target) as client:
            same_bits(client.pull("durable", 1), served)
    finally:
        again.stop()


def test_under_ef_the_learner_keeps_the_residual_and_a_push_after_a_publish_starts_afresh(
        nixl_installed: None) -> None:
    """An `ef` server: the learner exports each version with its own `Residual` and publishes it, bit for
    bit what a push of the same masters serves (the service's residual advancing alongside). The service
    never holds the learner's residual: an `ef` push to the published model continues from none."""
    ef = ExportSpec("bf16", "ef", seed=0)
    residual = Residual()
    srv = ServeProcess("--nixl", "--rounding", "ef")
    try:
        with LearnerClient(srv.target) as learner, InferenceClient(srv.target) as client, \
                serving(rounding="ef") as other, LearnerClient(other.grpc_target) as pusher, \
                InferenceClient(other.grpc_target) as puller:
            for step in (1, 2):
                served = served_state_dict(moved(step), ef, version=step, residual=residual)
                learner.publish(step, served, "ef", spec=ef)
                pusher.push(step, moved(step), "ef")
                same_bits(client.pull("ef", step), puller.pull("ef", step))
            learner.push(3, moved(3), "ef")
            pusher.push(3, moved(3), "afresh")
            same_bits(client.pull("ef", 3), puller.pull("afresh", 3))
            pusher.push(3, moved(3), "ef")  # (from the residual after version 2 here: another copy)
            mine, continued = client.pull("ef", 3), puller.pull("ef", 3)
            assert any(not torch.equal(mine[n], continued[n]) for n in mine)
    finally:
        srv.stop()


def lags(srv: ServeProcess, model: str) -> dict[int, LagMetrics | None]:
    """The lag metrics each version of `model` lists."""
    with InferenceClient(srv.target) as client:
        return {v.version: v.lag for v in client.versions(model)}


def gauge(srv: ServeProcess, name: str, model: str) -> float:
    text = urllib.request.urlopen(srv.url + "/metrics", timeout=30).read().decode()
    found = re.search(rf'^{name}\{{format="bf16",model="{model}",rounding="sr"\}} (\S+)$', text, re.MULTILINE)
    assert found, f"{name} of model {model!r} is not on /metrics"
    return float(found.group(1))


def push_run(srv: ServeProcess, model: str, steps: range) -> None:
    """The same run's masters pushed as fp32 (the server's spec is the ranks'): the service's own lag."""
    with LearnerClient(srv.target) as learner:
        for step in steps:
            learner.push(step, moved(step), model)


def test_one_rank_measures_its_lag_and_the_version_carries_what_a_push_of_the_same_masters_does(
        copier: ServeProcess) -> None:
    lag, answered = RankLag(), {}
    with LearnerClient(copier.target) as learner:
        for step in range(1, 6):
            m = moved(step)
            info = learner.publish(step, served_state_dict(m, SPEC, version=step), "lag-one", spec=SPEC, masters=m,
                                   lag=lag)
            answered[step] = info.lag
    push_run(copier, "lag-one-pushed", range(1, 6))
    published, pushed = lags(copier, "lag-one"), lags(copier, "lag-one-pushed")
    # One rank's rows are the whole sample, in the service's order: the very same sums, the same figures.
    assert published.keys() == pushed.keys() == set(range(2, 6))  # (--retain 4)
    assert published == {v: answered[v] for v in published} == pushed
    last = published[5]
    assert last is not None and last.churn > 0 and last.relative_error > 0 and last.exact
    assert any(v is not None and v.update_visibility is not None for v in published.values())
    assert gauge(copier, "weightsvc_served_lag_steps", "lag-one") == last.lag_steps
    assert gauge(copier, "weightsvc_served_churn_ratio", "lag-one") == pytest.approx(last.churn, rel=1e-12)


def test_two_rank_processes_send_the_sums_of_their_rows_and_the_service_adds_them_up_to_a_pushs_lag(
        copier: ServeProcess) -> None:
    procs = ranks(copier, "lag-two", 1, 2, ("--steps", "5", "--lag"), ("--steps", "5", "--lag"))
    assert [last_line(p) for p in procs] == ["ok 5 True", "ok 5 True"]
    push_run(copier, "lag-two-pushed", range(1, 6))
    published, pushed = lags(copier, "lag-two"), lags(copier, "lag-two-pushed")
    assert published.keys() == pushed.keys() == set(range(2, 6))  # (--retain 4)
    for version, p in published.items():
        q = pushed[version]
        assert p is not None and q is not None, version
        # Counts add up exactly; the float64 sums only in another order (two ranks' partial sums).
        assert (p.lag_steps, p.saturated_elements, p.sampled_elements, p.exact, p.churn) == (
            q.lag_steps, q.saturated_elements, q.sampled_elements, q.exact, q.churn), version
        assert p.relative_error == pytest.approx(q.relative_error, rel=1e-9), version
        assert (p.update_visibility is None) == (q.update_visibility is None), version
        if p.update_visibility is not None:
            assert p.update_visibility == pytest.approx(q.update_visibility, rel=1e-9), version
    assert published[5] is not None and published[5].churn > 0
    assert gauge(copier, "weightsvc_served_lag_steps", "lag-two") == published[5].lag_steps


def test_a_version_some_of_whose_ranks_send_no_lag_has_none(copier: ServeProcess) -> None:
    procs = ranks(copier, "lag-partly", 1, 2, ("--lag",))  # (rank 1: as a client that predates lag)
    assert [last_line(p) for p in procs] == ["ok 1 True", "ok 1 True"]
    assert lags(copier, "lag-partly") == {1: None}
