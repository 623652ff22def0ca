"""TRL's `AsyncGRPOTrainer` on a machine without a GPU: the two parts of it that only a GPU runs, stood in
for by their plain-torch equivalents. A deployment on GPUs needs none of this.

- Tree attention: the trainer packs each micro-batch into a prefix trie and runs its attention through
  FlashAttention 3 (`flash_attn_varlen_func` over each segment's root-to-segment path of keys, causal
  aligned to the path's end), a Hopper kernel fetched from the Hugging Face hub. `tree_attention_sdpa`
  computes the same with one `torch.nn.functional.scaled_dot_product_attention` over the row, each
  query masked to its path, and
  `use_sdpa_tree_attention` makes a trainer's model use it, through transformers' attention registry.
- The device's peak FLOPs: the trainer asks CUDA for the device's name (for its MFU metric) when it is
  built; without CUDA that raises. `without_mfu` answers as TRL does for a device it does not know:
  no MFU metric.

    without_mfu()
    trainer = AsyncGRPOTrainer(model=..., ...)
    use_sdpa_tree_attention(trainer.model)
"""

from __future__ import annotations

from typing import Any

import torch

SDPA_TREE = "sdpa_tree"


def tree_attention_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, *, tree_kv_index: torch.Tensor,
                        tree_cu_seqlens_q: torch.Tensor, tree_cu_seqlens_k: torch.Tensor, tree_max_seqlen_q: int,
                        tree_max_seqlen_k: int, scaling: float | None = None, sliding_window: int | None = None,
                        softcap: float | None = None, dropout: float = 0.0,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """TRL's `tree_attention` (packing.py) with SDPA in place of FlashAttention 3's varlen kernel: the
    queries of segment s (rows `cu_q[s]:cu_q[s+1]`) attend to the keys at `tree_kv_index[cu_k[s]:cu_k[s+1]]`,
    their path from the root, causally with the segment's last query at the path's last key."""
    if sliding_window or softcap:
        raise NotImplementedError("tree_attention_sdpa: sliding windows and soft caps are not stood in for")
    q = query.transpose(1, 2)[0]  # (tokens, heads, dim), as TRL hands them to the kernel
    k, v = key.transpose(1, 2)[0], value.transpose(1, 2)[0]
    # One attention over the row, each query masked to its path. FlashAttention aligns the causal mask of
    # `rows` queries over a path of `cols` keys to the bottom right: row i sees path keys <= i + cols - rows.
    visible = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
    cu_q, cu_k = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for s in range(len(cu_q) - 1):
        rows, path = cu_q[s + 1] - cu_q[s], tree_kv_index[cu_k[s]:cu_k[s + 1]]
        visible[cu_q[s]:cu_q[s + 1], path] = torch.ones(rows, len(path), dtype=torch.bool,
                                                        device=q.device).tril(len(path) - rows)
    groups = q.shape[1] // k.shape[1]  # grouped-query attention: each key head serves `groups` query heads
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(groups, 0),
        v.transpose(0, 1).repeat_interleave(groups, 0), attn_mask=visible, scale=scaling).transpose(0, 1)
    return out.unsqueeze(0), None


def use_sdpa_tree_attention(model: Any) -> None:
    """Run `model`'s attention through `tree_attention_sdpa` (registered with transformers under SDPA_TREE)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SDPA_TREE, tree_attention_sdpa)
    AttentionMaskInterface.register(SDPA_TREE, lambda **kwargs: None)  # (the paths are the mask, as TRL's)
    model.set_attn_implementation(SDPA_TREE)


def without_mfu() -> None:
    """Build AsyncGRPOTrainers without asking CUDA for the device's peak FLOPs (no MFU metric)."""
    from trl.experimental.async_grpo import async_grpo_trainer

    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
