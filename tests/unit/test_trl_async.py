"""The parts of the AsyncGRPOTrainer integration that read TRL's packed loss forward, checked against TRL's
own packer (`TreeRow`) and fused head on a tiny Llama: the SDPA stand-in for the trainer's FlashAttention-3
tree attention (examples/async_grpo_cpu.py) against each sample's own forward, and the reading of a packed
row (`read_row`, which the mismatch by version is measured with) against it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from trl.experimental.async_grpo.packing import TreeRow
from trl.trainer.utils import add_fused_lm_head

from weightsvc.integrations.trl._async import _Rollout, read_row

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from async_grpo_cpu import use_sdpa_tree_attention

PROMPT = [1, 7, 9, 11]
# Two completions of one prompt share it (the trie forks after it), a third shares a token more, and a
# sample of another prompt shares nothing: every kind of segment TRL's trie makes.
SAMPLES = [[*PROMPT, 20, 21, 22], [*PROMPT, 30, 31], [*PROMPT, 20, 40, 41, 42], [1, 5, 6, 50, 51]]
PROMPT_LENS = [4, 4, 4, 3]


def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def packed() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The loss forward's arguments for SAMPLES as TRL's collator and `compute_loss` make them, and the pack."""
    row = TreeRow()
    for ids, n in zip(SAMPLES, PROMPT_LENS, strict=True):
        row.add({"input_ids": torch.tensor(ids), "completion_mask": torch.tensor([0] * n + [1] * (len(ids) - n)),
                 "old_log_probs": torch.zeros(len(ids)), "advantage": 1.0, "group_id": n})
    p = row.pack()
    kwargs = {"input_ids": p["input_ids"][None], "position_ids": p["position_ids"][None],
              "shift_labels": p["shift_labels"][None], "fused_lm_head": True, "tree_kv_index": p["tree_kv_index"],
              "tree_cu_seqlens_q": p["tree_cu_seqlens_q"], "tree_cu_seqlens_k": p["tree_cu_seqlens_k"],
              "tree_max_seqlen_q": int(p["tree_max_seqlens"][0]), "tree_max_seqlen_k": int(p["tree_max_seqlens"][1])}
    return kwargs, p


def own_forward(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """The log-probability of each of `ids`' tokens 1.. in a forward of `ids` alone (plain SDPA)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), fused_lm_head=False).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.fixture
def model() -> LlamaForCausalLM:
    m = tiny()
    add_fused_lm_head(m, outputs=("log_probs",))
    return m


def packed_log_probs(model: LlamaForCausalLM, kwargs: dict[str, Any]) -> torch.Tensor:
    use_sdpa_tree_attention(model)
    try:
        with torch.no_grad():
            return model(**kwargs).log_probs
    finally:
        model.set_attn_implementation("sdpa")


def test_the_sdpa_tree_attention_scores_each_sample_as_its_own_forward_does(model: LlamaForCausalLM) -> None:
    kwargs, p = packed()
    log_probs = packed_log_probs(model, kwargs)[0]
    terms = log_probs[p["token_index"]]  # TRL's loss terms, sample by sample in order
    expected = torch.cat([own_forward(model, ids)[n - 1:] for ids, n in zip(SAMPLES, PROMPT_LENS, strict=True)])
    assert terms.shape == expected.shape
    torch.testing.assert_close(terms, expected, rtol=0, atol=1e-5)


def rollout(ids: list[int], n: int, version: int) -> _Rollout:
    trained = np.array([False] * n + [True] * (len(ids) - n))
    engine = np.where(trained, -1.0 - 0.01 * np.arange(len(ids)), 0.0)
    versions = np.where(trained, version, -1).astype(np.int64)
    return _Rollout(engine, versions, trained, model_version=version + 1)


def test_reading_a_packed_row_finds_each_sample_and_the_log_probabilities_of_its_tokens(
        model: LlamaForCausalLM) -> None:
    kwargs, _ = packed()
    log_probs = packed_log_probs(model, kwargs)
    waiting = {tuple(ids): [rollout(ids, n, version=i)]
               for i, (ids, n) in enumerate(zip(SAMPLES, PROMPT_LENS, strict=True))}
    waiting[(1, 2, 3, 4)] = [rollout([1, 2, 3, 4], 2, version=9)]  # handed out, not in this row
    scored = read_row(kwargs, log_probs, waiting)

    assert sorted(int(r.versions[-1]) for r in scored.found) == [0, 1, 2, 3]
    assert list(waiting) == [(1, 2, 3, 4)]  # the row's samples are taken; the other one waits
    # Each found sample's tokens 1.., in the order found, as the sample's own forward scores them.
    expected = torch.cat([own_forward(model, SAMPLES[int(r.versions[-1])]) for r in scored.found])
    trained = torch.from_numpy(np.concatenate([r.trained[1:] for r in scored.found]))
    torch.testing.assert_close(scored.learner[trained], expected[trained], rtol=0, atol=1e-5)


def test_a_row_that_is_not_trls_layout_is_refused(model: LlamaForCausalLM) -> None:
    kwargs, _ = packed()
    log_probs = packed_log_probs(model, kwargs)
    waiting = {tuple(SAMPLES[0]): [rollout(SAMPLES[0], 4, version=0)]}
    shifted = {**kwargs, "shift_labels": kwargs["shift_labels"].roll(1, dims=1)}
    with pytest.raises(RuntimeError, match="do not score the sample's tokens"):
        read_row(shifted, log_probs, waiting)
    with pytest.raises(RuntimeError, match="no 'tree_kv_index'"):
        read_row({k: v for k, v in kwargs.items() if k != "tree_kv_index"}, log_probs, waiting)
