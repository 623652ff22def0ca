"""Tensor-parallel layout of vLLM's decoder models (Llama, Qwen2, Mistral and their kin): which
checkpoint tensors each rank holds rows of (column-parallel, and the vocabulary-parallel
embeddings and head) or columns of (row-parallel); every other tensor is whole on every rank."""

from __future__ import annotations

import torch

from weightsvc.client import Slice
from weightsvc.protocol.manifest import Manifest

__all__ = ["COLUMN_PARALLEL", "ROW_PARALLEL", "VOCAB_PADDING", "VOCAB_PARALLEL", "WEIGHT_PARTS", "placed",
           "tp_select"]

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")
VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of this before splitting it
# A weight's served tensors that are split as it is: its elements (packed two per byte in fp4) and
# its per-row block scales (microscaled formats; `rounding.served_tensors`).
WEIGHT_PARTS = ("weight", "weight_packed", "weight_scale")


def tp_select(manifest: Manifest, rank: int, size: int, *, num_kv_heads: int | None = None,
              head_dim: int | None = None) -> dict[str, Slice | None]:
    """What tensor-parallel rank `rank` of `size` needs of a version: the rows or columns of each
    parallel tensor that vLLM's layers keep on that rank, and the other tensors whole.

    k/v projections with fewer KV heads than ranks are replicated, one head per group of ranks
    (`num_kv_heads` and `head_dim` from the model's config). fp8 scales come whole (a 128 x 128
    block spans the rows of several ranks). The microscaled formats' packed elements and block
    scales (one per row and block of 16 or 32) are split as their weight is, which keeps a rank's
    part on block boundaries wherever vLLM can split the layer at all; NVFP4's global scales come whole."""
    select: dict[str, Slice | None] = {}
    for t in manifest.tensors:
        module, _, param = t.name.rpartition(".")
        layer = module.rpartition(".")[2]
        select[t.name] = None
        if size == 1 or param not in (*WEIGHT_PARTS, "bias") or not t.shape:
            continue
        if layer in VOCAB_PARALLEL and param in WEIGHT_PARTS:
            per_rank = -(-t.shape[0] // VOCAB_PADDING) * VOCAB_PADDING // size
            start, stop = rank * per_rank, min((rank + 1) * per_rank, t.shape[0])
            if start < stop:
                select[t.name] = Slice(0, start, stop)
        elif layer in ("k_proj", "v_proj") and num_kv_heads and head_dim and num_kv_heads < size:
            head = rank // (size // num_kv_heads)
            select[t.name] = Slice(0, head * head_dim, (head + 1) * head_dim)
        elif layer in COLUMN_PARALLEL and t.shape[0] % size == 0:
            rows = t.shape[0] // size
            select[t.name] = Slice(0, rank * rows, (rank + 1) * rows)
        elif layer in ROW_PARALLEL and param in WEIGHT_PARTS and len(t.shape) == 2 and t.shape[1] % size == 0:
            cols = t.shape[1] // size
            select[t.name] = Slice(1, rank * cols, (rank + 1) * cols)
    return select


def placed(sliced: torch.Tensor, shape: tuple[int, ...], part: Slice) -> torch.Tensor:
    """`sliced` at its place in a tensor of the whole `shape`, for a loader that narrows the whole
    tensor to its rank's part itself. The rest is never read, and never touched: its pages stay
    unmapped, so the worker holds only its slice."""
    whole = torch.empty(shape, dtype=sliced.dtype)
    whole.narrow(part.dim, part.start, part.stop - part.start).copy_(sliced)
    return whole
