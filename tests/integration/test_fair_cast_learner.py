"""The learner's half of Fair Cast against a real service: the served copy it computes locally is the
one the service serves, bit for bit, and a learner whose copy is not gets an error naming why."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import serving
from tests.helpers import same_bits
from tests.unit.test_fair_cast import TOKENS, tiny
from weightsvc import InferenceClient, LearnerClient
from weightsvc.errors import NotFound
from weightsvc.integrations.fair_cast import ServedMismatch, check_served, on_served_copy, served_state_dict
from weightsvc.rounding import ExportSpec, Residual


def train_step(policy: torch.nn.Module, spec: ExportSpec, version: int, opt: torch.optim.Optimizer,
               residual: Residual | None = None) -> None:
    """One step of the loop the learner runs: loss on the served copy of `version`, masters updated."""
    opt.zero_grad()
    with on_served_copy(policy, spec, version=version, residual=residual):
        policy(TOKENS).logsumexp(-1).mean().backward()
    opt.step()


@pytest.mark.parametrize(("format", "rounding", "seed"), [("bf16", "sr", 11), ("bf16", "rtn", 0),
                                                          ("bf16", "sr-sticky", 3), ("fp8_e4m3", "sr", 5),
                                                          ("mxfp8", "sr", 2)])
def test_the_learners_served_copy_is_the_services(format: str, rounding: str, seed: int) -> None:
    spec = ExportSpec(format, rounding, seed)
    policy = tiny()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    with serving(format=format, rounding=rounding, seed=seed) as srv, LearnerClient(srv.grpc_target) as learner, \
            InferenceClient(srv.http_url) as puller:
        for step in (1, 2):
            learner.push(step, policy.state_dict(), model="policy")
            pulled = puller.pull("policy", step)
            same_bits(pulled, served_state_dict(policy, spec, version=step))  # tied head and embeddings included
            check_served(puller, "policy", step, policy, spec)
            train_step(policy, spec, step, opt)


def test_with_ef_the_learner_keeps_the_residual_and_its_copy_stays_the_services() -> None:
    """ef's served bits depend on the residual, the service's state: the learner keeps its own, in
    step with the versions it pushes, and its copy is the service's at every version."""
    spec = ExportSpec("bf16", "ef", 0)
    policy = tiny()
    opt = torch.optim.SGD(policy.parameters(), lr=1e-4)
    residual = Residual()
    with serving(rounding="ef") as srv, LearnerClient(srv.grpc_target) as learner, \
            InferenceClient(srv.grpc_target) as puller:
        for step in range(1, 5):
            learner.push(step, policy.state_dict(), model="policy")
            pulled = puller.pull("policy", step)
            check_served(puller, "policy", step, policy, spec, residual=residual)  # (a copy of it: it does not move)
            before = copy.deepcopy(residual)
            with on_served_copy(policy, spec, version=step, residual=residual):
                assert torch.equal(policy.up.weight, pulled["up.weight"].float())
            same_bits(pulled, served_state_dict(policy, spec, version=step, residual=before))
            train_step(policy, spec, step + 1, opt, copy.deepcopy(residual))  # (the loss of the next version)
        # A learner that lost its residual (a fresh one at version 5) is told so.
        learner.push(5, policy.state_dict(), model="policy")
        with pytest.raises(ServedMismatch, match="residual differs"):
            check_served(puller, "policy", 5, policy, spec, residual=Residual())
        check_served(puller, "policy", 5, policy, spec, residual=residual)


def test_a_learner_whose_copy_is_not_the_services_is_told_what_differs() -> None:
    policy = tiny()
    with serving(rounding="sr", seed=7) as srv, LearnerClient(srv.grpc_target) as learner, \
            InferenceClient(srv.grpc_target) as puller:
        learner.push(3, policy.state_dict(), model="policy")
        check_served(puller, "policy", 3, policy, ExportSpec("bf16", "sr", 7))
        with pytest.raises(ServedMismatch, match="seed: the service's 7, the learner's 8"):
            check_served(puller, "policy", 3, policy, ExportSpec("bf16", "sr", 8))
        with pytest.raises(ServedMismatch, match="rounding: the service's 'sr', the learner's 'rtn'"):
            check_served(puller, "policy", 3, policy, ExportSpec("bf16", "rtn", 7))
        with pytest.raises(ServedMismatch, match="format: the service's 'bf16', the learner's 'fp8_e4m3'"):
            check_served(puller, "policy", 3, policy, ExportSpec("fp8_e4m3", "sr", 7))
        with pytest.raises(NotFound, match=r"model .policy. has no version 4"):
            check_served(puller, "policy", 4, policy, ExportSpec("bf16", "sr", 7))
        with torch.no_grad():
            policy.down.bias.add_(1e-2)  # the learner moved on without pushing
        with pytest.raises(ServedMismatch, match=r"1 served tensors differ .*'down\.bias'.*masters differ"):
            check_served(puller, "policy", 3, policy, ExportSpec("bf16", "sr", 7))
