"""Drive the `weightsvc` command as a user would: a real `serve` process, push, pull, status, bench."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import WEIGHTSVC_CMD, ServeProcess, make_masters
from weightsvc.client import InferenceClient
from weightsvc.rounding import FORMATS, fair_cast

CMD = WEIGHTSVC_CMD
Serve = ServeProcess


def cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=cwd)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    srv = Serve("--data-dir", str(tmp_path_factory.mktemp("data")))
    yield srv
    assert srv.stop() == 0  # SIGTERM is a clean shutdown


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    masters = make_masters(seed=11)
    path = tmp_path_factory.mktemp("ckpt") / "masters.safetensors"
    save_file(masters, str(path))
    return path, masters


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_push_pull_status(served: Serve, checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path, masters = checkpoint
    pushed = cli("push", str(path), "--model", "cli", "--step", "3", "--target", served.target)
    assert pushed.returncode == 0, pushed.stderr
    assert "committed: model cli version 3" in pushed.stdout

    for how, where in (("--target", served.target), ("--url", served.url)):
        out = tmp_path / f"{how[2:]}.safetensors"
        pulled = cli("pull", "--model", "cli", "--version", "latest", "-o", str(out), how, where)
        assert pulled.returncode == 0, pulled.stderr
        assert "checksums verified" in pulled.stdout
        served_copy = load_file(str(out))
        for name, m in masters.items():
            expected = fair_cast(m, rounding="sr", version=3, name=name)
            assert np.array_equal(served_copy[name].view(torch.int16).numpy(), expected.view(torch.int16).numpy())
    assert (tmp_path / "target.safetensors").read_bytes() == (tmp_path / "url.safetensors").read_bytes()

    status = cli("status", "--target", served.target, "--json")
    assert status.returncode == 0, status.stderr
    report = {m["model"]: m for m in json.loads(status.stdout)["models"]}
    assert report["cli"]["latest_version"] == 3
    assert [v["version"] for v in report["cli"]["versions"]] == [3]
    table = cli("status", "--target", served.url, "--model", "cli")
    assert table.returncode == 0 and "cli" in table.stdout and "3 (latest)" in table.stdout
    assert "no inference client has acked a version yet" in table.stdout
    # the same for every version of a listing: left out
    assert not {"model", "created", "served"} & set(report["cli"]["versions"][0])


def test_status_shows_the_clients_and_their_lag(
    served: Serve, checkpoint: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    path, _ = checkpoint
    for step in ("1", "2"):
        assert cli("push", str(path), "--model", "fleet", "--step", step, "--target", served.target).returncode == 0
    with InferenceClient(served.target) as worker:
        worker.ack("fleet", 1, client_id="sampler-behind")
        worker.ack("fleet", 2, client_id="sampler-current")
    status = cli("status", "--target", served.target, "--model", "fleet", "--json")
    assert status.returncode == 0, status.stderr
    (fleet,) = json.loads(status.stdout)["models"]
    clients = {c["client_id"]: c for c in fleet["clients"]}
    assert set(clients) == {"sampler-behind", "sampler-current"}
    assert (clients["sampler-behind"]["version"], clients["sampler-behind"]["lag_versions"]) == (1, 1)
    assert (clients["sampler-current"]["version"], clients["sampler-current"]["lag_versions"]) == (2, 0)
    assert all(c["connected"] for c in clients.values())
    for target in (served.target, served.url):
        table = cli("status", "--target", target, "--model", "fleet")
        assert table.returncode == 0, table.stderr
        rows = {line.split("│")[2].strip(): line for line in table.stdout.splitlines() if "sampler-" in line}
        assert set(rows) == {"sampler-behind", "sampler-current"}, table.stdout
        assert [cell.strip() for cell in rows["sampler-behind"].split("│")[3:5]] == ["1", "1"]


def test_push_widens_bf16_masters_exactly(served: Serve, tmp_path: Path) -> None:
    masters = {k: v.to(torch.bfloat16) for k, v in make_masters(seed=31).items()}
    ckpt = tmp_path / "bf16.safetensors"
    save_file(masters, str(ckpt))
    assert cli("push", str(ckpt), "--model", "bf16", "--step", "1", "--target", served.target).returncode == 0
    assert cli("pull", "--model", "bf16", "-o", str(tmp_path / "out.safetensors"), "--url", served.url).returncode == 0
    served_copy = load_file(str(tmp_path / "out.safetensors"))
    for name, m in masters.items():
        assert torch.equal(served_copy[name], m), name  # bf16 masters are already on the served grid


def test_push_of_a_checkpoint_without_its_tied_head(served: Serve, tmp_path: Path) -> None:
    masters = make_masters(seed=5)  # as save_pretrained writes a tied model: no lm_head.weight
    ckpt = tmp_path / "tied.safetensors"
    save_file(masters, str(ckpt))
    tie = ["--tie", "lm_head.weight=embed.weight"]
    pushed = cli("push", str(ckpt), "--model", "tied", "--step", "1", "--target", served.target, *tie)
    assert pushed.returncode == 0, pushed.stderr
    served_copy = InferenceClient(served.target).pull("tied", 1)
    assert served_copy["lm_head.weight"] is served_copy["embed.weight"]
    line = one_error_line(cli("push", str(ckpt), "--model", "tied", "--step", "2", "--target", served.target,
                              "--tie", "lm_head.weight"))
    assert "--tie takes ALIAS=TENSOR, got 'lm_head.weight'" in line


def test_errors_are_one_line_and_nonzero(
    served: Serve, checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path, _ = checkpoint
    assert cli("push", str(path), "--model", "errs", "--step", "5", "--target", served.target).returncode == 0
    line = one_error_line(cli("push", str(path), "--model", "errs", "--step", "4", "--target", served.target))
    assert "FAILED_PRECONDITION" in line and "step 4 is not above the latest version 5" in line
    line = one_error_line(cli("pull", "--model", "nope", "-o", str(tmp_path / "x"), "--target", served.target))
    assert "NOT_FOUND: unknown model 'nope'" in line
    line = one_error_line(
        cli("pull", "--model", "errs", "--version", "9", "-o", str(tmp_path / "x"), "--url", served.url)
    )
    assert "has no version 9" in line and "HTTP 404" in line
    line = one_error_line(cli("pull", "-o", str(tmp_path / "x"), "--target", served.target, "--url", served.url))
    assert "exactly one of --target" in line
    line = one_error_line(cli("push", str(tmp_path / "missing.safetensors"), "--step", "1", "--target", served.target))
    assert "cannot read" in line
    line = one_error_line(cli("status", "--target", "127.0.0.1:1"))
    assert "UNAVAILABLE" in line
    assert not (tmp_path / "x").exists()


def test_status_gives_up_on_a_server_that_does_not_answer() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections, never answers
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        line = one_error_line(cli("status", "--target", target, "--timeout", "0.5"))
        assert line == f"error: DEADLINE_EXCEEDED: {target} did not answer within 0.5 s"
        line = one_error_line(cli("status", "--target", f"http://{target}", "--timeout", "0.5"))
        assert line == f"error: UNAVAILABLE: http://{target}: timed out"


def test_damaged_files_are_reported_by_status_and_the_version_listing(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """A version file damaged on disk is set aside at the restart: `status` warns of it (and says it in
    --json), and the model's version listing carries it, over HTTP and gRPC."""
    import urllib.request

    import grpc

    from weightsvc.errors import NotFound
    from weightsvc.v1 import weightsvc_pb2 as pb
    from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc

    path, _ = checkpoint
    data = tmp_path / "data"
    srv = Serve("--data-dir", str(data))
    for model, step in (("kept", "1"), ("kept", "2"), ("lost", "1")):
        assert cli("push", str(path), "--model", model, "--step", step, "--target", srv.target).returncode == 0
    assert srv.stop() == 0
    for model, step in (("kept", 2), ("lost", 1)):
        file = data / "models" / model / f"{step:020d}.safetensors"
        raw = bytearray(file.read_bytes())
        raw[-1] ^= 0xFF  # one flipped bit in the last tensor
        file.write_bytes(bytes(raw))

    srv = Serve("--data-dir", str(data))
    try:
        aside = {m: str(data / "damaged" / m / f"{v:020d}.safetensors") for m, v in (("kept", 2), ("lost", 1))}
        for target in (srv.target, srv.url):
            status = json.loads(cli("status", "--target", target, "--json").stdout)
            assert [m["model"] for m in status["models"]] == ["kept"]
            assert [(d["model"], d["file"]) for d in status["damaged_files"]] == list(aside.items())
            assert all("checksum mismatch" in d["reason"] for d in status["damaged_files"])
            table = cli("status", "--target", target)
            assert table.returncode == 0 and "1 (latest)" in table.stdout, table.stderr
            warnings = table.stderr.splitlines()
            assert len(warnings) == 2 and all(line.startswith("warning: model ") for line in warnings), warnings
            assert f"damaged file set aside at start-up: {aside['lost']}: " in warnings[1]
            only = cli("status", "--target", target, "--model", "kept")
            assert only.stderr.splitlines() == warnings[:1]
            line = one_error_line(cli("status", "--target", target, "--model", "lost"))
            assert f"unknown model 'lost': nothing has been committed for it; damaged file set aside at start-up: " \
                   f"{aside['lost']} (" in line

        with urllib.request.urlopen(f"{srv.url}/v1/models/kept/versions", timeout=30) as resp:
            listing = json.loads(resp.read())
        assert [v["version"] for v in listing["versions"]] == [1]
        assert [d["file"] for d in listing["damaged_files"]] == [aside["kept"]]
        with grpc.insecure_channel(srv.target) as channel:
            reply = pb_grpc.WeightServiceStub(channel).ListVersions(pb.ListVersionsRequest(model="kept"), timeout=30)
        assert [v.version for v in reply.versions] == [1]
        assert [(d.model, d.file) for d in reply.damaged_files] == [("kept", aside["kept"])]
        with pytest.raises(NotFound, match=f"damaged file\\(s\\) of it were set aside at start-up: {aside['lost']}"):
            InferenceClient(srv.url).versions("lost")
    finally:
        assert srv.stop() == 0


def test_serve_rejects_bad_settings() -> None:
    line = one_error_line(cli("serve", "--rounding", "nearest", "--grpc-port", "0", "--http-port", "0"))
    assert "unknown rounding 'nearest'" in line and "'--rounding'" in line
    line = one_error_line(cli("serve", "--grpc-port", "0", "--http-port", "0", env={"WEIGHTSVC_RETAIN": "0"}))
    assert "'--retain' (env var: 'WEIGHTSVC_RETAIN'): Input should be greater than or equal to 1 (got 0)" in line
    line = one_error_line(cli("serve", "--grpc-port", "0", "--http-port", "0", "--tls-key", "key.pem"))
    assert "--tls-cert and --tls-key go together" in line
    line = one_error_line(cli("serve", "--retian", "3"))
    assert "No such option: --retian" in line and "weightsvc serve --help" in line


def test_restart_serves_the_same_version(tmp_path: Path, checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = checkpoint
    data = tmp_path / "data"
    first = Serve("--data-dir", str(data))
    assert cli("push", str(path), "--step", "1", "--target", first.target).returncode == 0
    assert cli("pull", "-o", str(tmp_path / "a.safetensors"), "--url", first.url).returncode == 0
    assert first.stop() == 0
    second = Serve("--data-dir", str(data))
    try:
        assert cli("pull", "-o", str(tmp_path / "b.safetensors"), "--target", second.target).returncode == 0
    finally:
        second.stop()
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_bench_json_has_the_transfer_and_kernel_figures() -> None:
    result = cli("bench", "--size-mib", "16", "--repeat", "1", "--only", "T1,K1,delta,K3_sass", "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    for key in (
        "T1",
        "T1_grpc",
        "T1_http",
        "T2",
        "T2_grpc",
        "T2_http",
        "T3",
        "T3_grpc",
        "T3_http",
        "M1",
        "K1",
        "K2",
        "K1_vs_torch_ops_sr",
        "delta_ratio_rtn",
        "delta_ratio_sr",
        "delta_ratio_sr-sticky",
        "delta_ratio_ef",
    ):
        assert isinstance(figures[key], float) and figures[key] > 0, key
    assert figures["details"]["master_mib"] == 16
    for fmt in ("fp8_e4m3", "mxfp8", "nvfp4", "mxfp4"):  # the scaled formats' kernel, in GB/s of fp32
        assert figures["details"][f"kernel_{fmt}_sr_gbps"] > 0, fmt
    assert figures["details"]["fanout_pullers"] == 8
    # K3 without a GPU: the kernels compiled for sm_90, their instructions per element against a cast's
    details = figures["details"]
    assert figures["K3_sass"] == details["K3_sass_bf16_sr_vs_cast"] > 1
    assert details["K3_sass_bf16_sr_uncounted_per_element"] < details["K3_sass_bf16_sr_per_element"]
    # rows of a power-of-two length take shifts, where others take 64-bit divisions
    assert details["K3_sass_fp8_block_pow2_sr_per_element"] < details["K3_sass_fp8_block_sr_per_element"]
    assert "E1_1" not in figures and "S1" not in figures  # --only


def test_bench_json_has_sync_per_tensor_data_dir_and_pull_figures() -> None:
    result = cli("bench", "--only", "E1,S1,S2,P1", "--size-mib", "16", "--repeat", "1", "--pullers", "1,2",
                 "--s1-mib", "1", "--s1-tensors", "10,100", "--s2-retain", "1,2", "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    details = figures["details"]
    for key in ("E1_1", "E1_1_grpc", "E1_1_http", "E1_2", "E1_2_grpc", "E1_2_http", "P1_http", "P1_grpc"):
        assert isinstance(figures[key], float) and figures[key] > 0, key
    # Both times of each run, with no order between them: the push call returns once the commit's
    # answer is back at the learner, and a watcher of a small version may hold it sooner.
    for key in ("e1_1_grpc_sync_s", "e1_2_http_sync_s"):
        assert details[key] > 0 and details[key.replace("sync", "commit")] > 0, key
    assert figures["E1_1_vs_file"] > 0 and details["e1_file_sync_s"] > 0  # the reference without a service
    assert isinstance(figures["S1"], float) and figures["S1"] == min(figures["S1_grpc"], figures["S1_http"])
    assert details["s1_tensors"] == [10, 100] and len(details["s1_push_s"]) == 2
    assert isinstance(figures["S2"], float)
    assert details["s2_retain_1_retained_mib"] == 8 and details["s2_retain_2_retained_mib"] == 16
    assert 0 < details["s2_retain_1_anon_rss_mib"] <= details["s2_retain_1_peak_anon_rss_mib"]
    if details["p1_nginx_skipped"] is None:
        assert isinstance(figures["P1_nginx"], float) and figures["P1_nginx"] > 0
    else:
        assert figures["P1_nginx"] is None and "nginx" in details["p1_nginx_skipped"]
    assert figures["L1"] == max(v for k, v in details.items() if k.startswith("loop_lag_max_s_")) > 0
    assert "T1" not in figures and "K1" not in figures  # --only


def test_bench_publish_figures_pub1_timed_against_bare_reads_pub2_from_the_servers_counters(
        nixl_installed: None) -> None:
    result = cli("bench", "--only", "PUB1,PUB2", "--size-mib", "16", "--repeat", "1", "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    # PUB1: the rounds' time against the bare READs' (whose bytes the readers checked), of the served copy
    timed = figures["details"]["PUB1_seconds"]
    assert timed["bytes"] == 16 << 20 and 0 < timed["publish"] < timed["publish_to_readers"]
    # (the details in µs, the figure to 3 places)
    assert figures["PUB1"] == pytest.approx(timed["publish_to_readers"] / timed["bare_read"], rel=1e-3)
    for key, served in (("PUB2", 2), ("PUB2_fp8_e4m3", 1)):  # bytes an element: the served copy, from the counters
        counted = figures["details"][f"{key}_bytes"]
        assert counted["push_masters"] == 16 << 20, key
        assert counted["publish_read"] >= counted["push_masters"] * served // 4, key  # (fp8: its scales too)
        assert counted["push"] > counted["push_masters"], key  # (the push's messages: masters and their framing)
        assert figures[key] == round((counted["publish_read"] + counted["publish_request"]) / counted["push"], 4), key


def test_bench_refuses_an_unknown_figure() -> None:
    line = one_error_line(cli("bench", "--only", "E1,X9"))
    assert "unknown figure(s) X9" in line


def test_export_is_bit_identical_to_what_the_service_serves(tmp_path: Path) -> None:
    srv = Serve("--format", "fp8_e4m3", "--rounding", "ef", "--seed", "9", "--scaling", "channel")
    try:
        base = make_masters(seed=4)
        for step in (1, 2):
            ckpt = tmp_path / f"m{step}.safetensors"
            save_file({k: v + 1e-4 * step for k, v in base.items()}, str(ckpt))
            assert cli("push", str(ckpt), "--step", str(step), "--target", srv.target).returncode == 0
            exported = cli("export", str(ckpt), str(tmp_path / f"e{step}.safetensors"), "--step", str(step),
                           "--format", "fp8_e4m3", "--rounding", "ef", "--seed", "9", "--scaling", "channel",
                           "--residual", str(tmp_path / "residual.safetensors"))
            assert exported.returncode == 0, exported.stderr
            assert cli("pull", "-o", str(tmp_path / f"p{step}.safetensors"), "--version", str(step),
                       "--url", srv.url).returncode == 0
            ours, served = (
                load_file(str(tmp_path / f"e{step}.safetensors")),
                load_file(str(tmp_path / f"p{step}.safetensors")),
            )
            assert sorted(ours) == sorted(served) and any(k.endswith("_scale_inv") for k in ours)
            for name in ours:
                assert torch.equal(ours[name].reshape(-1).view(torch.uint8), served[name].reshape(-1).view(torch.uint8))
        line = one_error_line(cli("export", str(ckpt), str(tmp_path / "x"), "--step", "1", "--rounding", "ef",
                                  "--residual", str(tmp_path / "residual.safetensors")))
        assert "residual" in line and "is of step 2" in line
    finally:
        srv.stop()


DEMO_KEYS = {"first_change_step", "lag_max", "lag_mean", "visibility_mean", "churn_mean", "final_reward",
             "steps_to_reward", "reward_threshold", "reward_auc"}


def test_demo_shows_round_to_nearest_lagging(tmp_path: Path) -> None:
    result = cli("demo", "--steps", "40", "--json", "--png", str(tmp_path / "demo.png"), timeout=300)
    assert result.returncode == 0, result.stderr
    table = json.loads(result.stdout)
    assert set(table) == {"rtn", "sr", "sr-sticky", "ef"}
    for row in table.values():
        assert set(row) == DEMO_KEYS
        assert 0 <= row["reward_auc"] <= 1 and row["reward_threshold"] == 0.5
    # 40 Adam steps of 1e-5 stay below half a bf16 ulp of the checkpoint's weights (|w| >= 0.5):
    # round to nearest serves the checkpoint, whose logits are 0, all along (lag t - 1 at step t)
    rtn = table["rtn"]
    assert (rtn["first_change_step"], rtn["churn_mean"], rtn["steps_to_reward"]) == (None, 0, None)
    assert rtn["lag_mean"] == 19.5
    assert 2 * max(table[m]["lag_mean"] for m in ("sr", "sr-sticky")) < rtn["lag_mean"]
    assert table["ef"]["lag_mean"] < rtn["lag_mean"]  # ef's residual needs ~15 steps to reach half an ulp
    assert rtn["reward_auc"] < 0.2  # chance is 1/8
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("fmt", "ef_margin"), [("fp8_e4m3", 0.1), ("nvfp4", 0.05)])
def test_demo_in_fp8_and_fp4_learns_only_with_unbiased_rounding(fmt: str, ef_margin: float) -> None:
    # Steps of 1e-4 for 40 steps: the sr modes earn the reward, while they move the masters less than
    # half an fp8_e4m3 ulp (~1/30 of a weight; FP4's is wider still), so round to nearest never
    # changes a served bit. ef learns too, more slowly (its error of up to an ulp is noise).
    result = cli("demo", "--steps", "40", "--lr", "1e-4", "--format", fmt, "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    table = json.loads(result.stdout)
    rtn = table["rtn"]
    assert (rtn["first_change_step"], rtn["churn_mean"], rtn["steps_to_reward"]) == (None, 0, None)
    assert rtn["reward_auc"] < 0.2
    for mode in ("sr", "sr-sticky"):
        assert table[mode]["steps_to_reward"] is not None, table[mode]
        assert table[mode]["reward_auc"] > rtn["reward_auc"] + 0.3, table[mode]
    assert table["ef"]["reward_auc"] > rtn["reward_auc"] + ef_margin, table["ef"]


def test_demo_writes_a_png_only_when_asked(tmp_path: Path) -> None:
    result = cli("demo", "--steps", "2", "--json", timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)) == {"rtn", "sr", "sr-sticky", "ef"}
    assert list(tmp_path.iterdir()) == []


def test_demo_names_the_formats_it_accepts() -> None:
    line = one_error_line(cli("demo", "--format", "fp4"))
    assert "unknown format 'fp4'; choose one of " in line
    assert all(name in line for name in FORMATS)


def test_pull_base_updates_a_file_with_a_delta(served: Serve, tmp_path: Path) -> None:
    base, t = make_masters(seed=21), served.target
    for step, masters in ((1, base), (2, {k: v + 3e-6 for k, v in base.items()})):
        ckpt = tmp_path / f"m{step}.safetensors"
        save_file(masters, str(ckpt))
        assert cli("push", str(ckpt), "--model", "delta", "--step", str(step), "--target", t).returncode == 0
    out = tmp_path / "served.safetensors"
    assert cli("pull", "--model", "delta", "--version", "1", "-o", str(out), "--target", t).returncode == 0
    updated = cli("pull", "--model", "delta", "--version", "2", "--base", "1", "-o", str(out), "--target", t)
    assert updated.returncode == 0, updated.stderr
    dense = tmp_path / "dense.safetensors"
    assert cli("pull", "--model", "delta", "--version", "2", "-o", str(dense), "--target", t).returncode == 0
    assert out.read_bytes() == dense.read_bytes()
    line = one_error_line(cli("pull", "--model", "delta", "--version", "2", "--base", "1", "-o", str(out),
                              "--target", t))
    assert "holds model 'delta' version 2, not model 'delta' version 1" in line


def test_tokens_from_the_environment_and_the_token_option(
    tmp_path: Path, checkpoint: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    srv = Serve(env={"WEIGHTSVC_PUSH_TOKENS": "learner-token", "WEIGHTSVC_PULL_TOKENS": "fleet-a,fleet-b"})
    try:
        path, _ = checkpoint
        denied = cli("push", str(path), "--step", "1", "--target", srv.target, "--token", "fleet-a")
        assert denied.returncode == 1
        assert denied.stderr.strip() == "error: PERMISSION_DENIED: Push needs role push; this token has role pull"
        pushed = cli("push", str(path), "--step", "1", "--target", srv.target, env={"WEIGHTSVC_TOKEN": "learner-token"})
        assert pushed.returncode == 0, pushed.stderr
        anonymous = cli("status", "--target", srv.url)
        assert anonymous.returncode == 1 and "UNAUTHENTICATED" in anonymous.stderr
        assert cli("status", "--target", srv.url, "--token", "fleet-b").returncode == 0
    finally:
        assert srv.stop() == 0
    _, stderr = srv.proc.communicate()
    assert "learner-token" not in stderr and "fleet-a" not in stderr  # never logged


def test_bench_soak_holds_memory_flat_and_leaks_nothing() -> None:
    result = cli("bench", "--soak", "10", "--size-mib", "16", "--json", timeout=300)
    soak = json.loads(result.stdout)
    assert result.returncode == 0, (soak, result.stderr)
    assert soak["ok"] and soak["rss_growth"] <= 0.10 and not soak["failures"]
    assert soak["versions_pushed"] > 4 and soak["pulls"] > soak["pullers"]
    assert (soak["retained_versions"], soak["staged_bytes"], soak["pulls_in_flight"]) == (4, 0, 0)


def test_a_file_that_is_not_what_the_command_needs_is_named(
    served: Serve, checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path, masters = checkpoint
    t = served.target
    torch.save(masters, tmp_path / "masters.bin")
    line = one_error_line(cli("push", str(tmp_path / "masters.bin"), "--step", "1", "--target", t))
    assert f"{tmp_path / 'masters.bin'} is not a safetensors file: it is a torch.save checkpoint" in line
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes((12).to_bytes(8, "little") + b"not json, no")
    line = one_error_line(cli("push", str(junk), "--step", "1", "--target", t))
    assert f"{junk} is not a safetensors file: its header is not a JSON object" in line

    for step in (1, 2):
        assert cli("push", str(path), "--model", "bases", "--step", str(step), "--target", t).returncode == 0
    pulled = tmp_path / "pulled.safetensors"

    def delta(base_file: Path) -> str:
        return one_error_line(cli("pull", "--model", "bases", "--version", "2", "--base", "1", "-o", str(base_file),
                                  "--target", t))

    assert f"--base 1: {pulled} does not exist; pull model 'bases' version 1 into it first" in delta(pulled)
    plain = path.read_bytes()
    assert f"--base 1: {path} was not written by `weightsvc pull`" in delta(path)
    assert f"{tmp_path / 'masters.bin'} is not a safetensors file" in delta(tmp_path / "masters.bin")
    assert cli("pull", "--model", "bases", "--version", "2", "-o", str(pulled), "--target", t).returncode == 0
    assert f"--base 1: {pulled} holds model 'bases' version 2, not model 'bases' version 1" in delta(pulled)
    assert path.read_bytes() == plain  # a refused base is left as it was


def imported(result: subprocess.CompletedProcess[str]) -> set[str]:
    """The top-level packages a command run with PYTHONPROFILEIMPORTTIME imported (from stderr)."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in result.stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


HEAVY = {"torch", "numba"}


def test_commands_that_build_no_tensors_start_without_torch_or_numba(
    served: Serve, checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path, _ = checkpoint
    bf16 = str(tmp_path / "bf16.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in checkpoint[1].items()}, bf16)
    profile = {"PYTHONPROFILEIMPORTTIME": "1"}
    out, t = str(tmp_path / "pulled.safetensors"), served.target
    runs = {
        "push": cli("push", str(path), "--model", "light", "--step", "1", "--target", t, env=profile),
        "push of bf16": cli("push", bf16, "--model", "light", "--step", "2", "--target", t, env=profile),
        "pull": cli("pull", "--model", "light", "--version", "1", "-o", out, "--target", t, env=profile),
        "pull --base": cli("pull", "--model", "light", "--base", "1", "-o", out, "--target", t, env=profile),
        "pull over HTTP": cli("pull", "--model", "light", "-o", out, "--url", served.url, env=profile),
        "status": cli("status", "--target", t, env=profile),
        "status --json": cli("status", "--target", served.url, "--json", env=profile),
        "status of nothing": cli("status", "--target", "127.0.0.1:1", env=profile),
        "serve --help": cli("serve", "--help", env=profile),
        "a bad flag value": cli("serve", "--rounding", "nearest", env=profile),
        "an unknown option": cli("push", str(tmp_path / "m.safetensors"), "--stepp", "1", env=profile),
        "a missing option": cli("pull", env=profile),
        "an unknown command": cli("pusj", env=profile),
    }
    for what, result in runs.items():
        modules = imported(result)
        assert "typer" in modules, (what, result.stderr[-2000:])  # the profile was read
        assert not modules & HEAVY, f"{what} imported {sorted(modules & HEAVY)}"
    for what in ("push", "push of bf16", "pull", "pull --base", "pull over HTTP", "status", "status --json"):
        assert runs[what].returncode == 0, (what, runs[what].stderr[-2000:])
    assert "version 2" in runs["pull over HTTP"].stdout
    assert runs["serve --help"].returncode == 0 and "--max-rss-bytes" in runs["serve --help"].stdout
    usage_errors = ("a bad flag value", "an unknown option", "a missing option", "an unknown command")
    for what in (*usage_errors, "status of nothing"):
        assert runs[what].returncode == (2 if what in usage_errors else 1), what
        errors = [line for line in runs[what].stderr.splitlines() if not line.startswith("import time:")]
        assert len(errors) == 1 and errors[0].startswith("error: "), (what, errors)
