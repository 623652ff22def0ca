"""Torch tensors from served bytes, and running a module on a served copy. The only client module
that imports torch, when it is first imported (the clients import it on first use)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from weightsvc.client._common import verify_data
from weightsvc.protocol.manifest import Manifest

TORCH_DTYPES = {
    "F64": torch.float64,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U8": torch.uint8,
}


def tensors_from_data(manifest: Manifest, data: bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Verify each served tensor's checksum and return views of `data` as torch tensors, by name;
    a tied alias is the same tensor as the one it names.

    The views share `data`'s memory; a read-only `data` (a file's bytes) is copied once first,
    since torch would warn on every tensor that it cannot write through."""
    verify_data(manifest, data)
    view = memoryview(data)
    if view.readonly and len(view):
        view = memoryview(bytearray(view))
    out: dict[str, torch.Tensor] = {}
    # Each tensor has a storage of its own (saving one saves its bytes alone), made with one
    # frombuffer call and, unless 1-D, one as_strided: 100,000 tensors in 0.2-0.4 s, not 0.75 s.
    strides: dict[tuple[int, ...], tuple[int, ...]] = {}
    for t in manifest.tensors:
        dtype = TORCH_DTYPES[t.dtype]  # verify_data let through only dtypes of the manifest's format
        if t.nbytes == 0:
            out[t.name] = torch.empty(t.shape, dtype=dtype)
            continue
        flat = torch.frombuffer(view, dtype=dtype, count=t.nbytes // dtype.itemsize, offset=t.offset)
        if len(t.shape) != 1:
            stride = strides.get(t.shape)
            if stride is None:
                stride = strides[t.shape] = _contiguous_strides(t.shape)
            flat = flat.as_strided(t.shape, stride)
        out[t.name] = flat
    return manifest.with_aliases(out)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


@contextlib.contextmanager
def served_weights(module: torch.nn.Module, served: Mapping[str, torch.Tensor]) -> Iterator[torch.nn.Module]:
    """Run `module` on the served copy while its parameters stay the fp32 masters.

        with served_weights(policy, info.served):
            loss = objective(policy(batch))
            loss.backward()          # gradients at the served weights, on the master parameters
        optimizer.step()             # updates the masters

    Scaled formats are dequantized with their scales (`dequantize`).
    """
    params = dict(module.named_parameters())
    values = dequantize(served)
    saved = {}
    try:
        with torch.no_grad():
            for name, p in params.items():
                if name not in values:
                    raise KeyError(f"the served copy has no tensor {name!r}")
                saved[name] = p.data.clone()
                p.data.copy_(values[name].to(p.dtype).reshape(p.shape))
        yield module
    finally:
        with torch.no_grad():
            for name, master in saved.items():
                params[name].data.copy_(master)


def _format_of(served: Mapping[str, torch.Tensor], name: str) -> str:
    """The format master `name` is served in, from the served tensors' names and dtypes
    (`rounding.served_tensors`): fp4 comes packed, mxfp8's e4m3 has UE8M0 block scales, fp8's fp32
    ones; "" for a tensor served as it is (bf16, fp16, fp32)."""
    from weightsvc import rounding

    if name + rounding.PACKED_SUFFIX in served:
        return "nvfp4" if name + rounding.GLOBAL_SCALE_SUFFIX in served else "mxfp4"
    if name + rounding.BLOCK_SCALE_SUFFIX in served and name in served and served[name].dtype == torch.float8_e4m3fn:
        return "mxfp8"
    if name + rounding.SCALE_SUFFIX in served:
        return "fp8"
    return ""


def dequantized(served: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """The values of master tensor `name` of a served copy, as fp32: fp8 codes times their
    `<name>_scale_inv` scales (128 x 128 blocks, rows or the whole tensor); mxfp8, mxfp4 and nvfp4
    element values times their block scales (and NVFP4's global scale), fp4 unpacked; other
    tensors widened."""
    from weightsvc import rounding

    kind = _format_of(served, name)
    if kind in rounding.MICROSCALED:
        fmt = rounding.FORMATS[kind]
        elements = served[name + rounding.PACKED_SUFFIX] if fmt.packed else served[name]
        n, k = elements.shape
        shape = (n, 2 * k) if fmt.packed else (n, k)
        return torch.from_numpy(rounding.dequantize(served, name, fmt, shape)).to(elements.device)
    values = served[name].float()
    if kind != "fp8":
        return values
    scale = served[name + rounding.SCALE_SUFFIX]
    if scale.dim() == 2 and scale.shape != (values.shape[0], 1):  # 128 x 128 blocks
        n, k = values.shape
        scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return values * scale


def dequantize(served: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The values of every master tensor of a served copy, by master name (`dequantized`): the
    scale tensors dropped, packed fp4 elements under their master's name."""
    from weightsvc import rounding

    masters = rounding.served_masters(served)  # (the inverse of the served naming: one rule)
    return {name: dequantized(served, name) if _format_of(served, name) else served[name] for name in masters}
