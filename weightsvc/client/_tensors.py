"""Torch tensors from served bytes, and running a module on a served copy. The only client module
that imports torch, when it is first imported (the clients import it on first use)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

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


class _StraightThrough(torch.autograd.Function):
    """The served value forward; backward, the gradient at it goes to the master unchanged (the
    rounding counts as the identity: a straight-through estimator)."""

    @staticmethod
    def forward(ctx: Any, master: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.master_dtype = master.dtype
        # (a new tensor either way: a Function's output must not be its input as it is)
        return value.to(dtype) if value.dtype != dtype else value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.to(ctx.master_dtype), None, None


class _Served(torch.nn.Module):
    """The parametrization that stands a parameter's served copy in for it (`served_weights`)."""

    def __init__(self, value: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.value = value  # (a plain attribute, not a buffer: the module's state dict stays the masters')
        self.dtype = dtype

    def forward(self, master: torch.Tensor) -> torch.Tensor:
        return _StraightThrough.apply(master, self.value, self.dtype)


def _places(module: torch.nn.Module) -> dict[int, tuple[torch.nn.Parameter, list[tuple[torch.nn.Module, str, str]]]]:
    """Each parameter, once, with every (owner module, attribute, state-dict name) that holds it:
    a tied parameter has several."""
    out: dict[int, tuple[torch.nn.Parameter, list[tuple[torch.nn.Module, str, str]]]] = {}
    seen: set[tuple[int, str]] = set()
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for attr, param in owner._parameters.items():
            if param is None or (id(owner), attr) in seen:
                continue
            seen.add((id(owner), attr))
            out.setdefault(id(param), (param, []))[1].append((owner, attr, f"{prefix}.{attr}" if prefix else attr))
    return out


def _check_plain(module: torch.nn.Module) -> None:
    """Refuse a parametrized module: its state dict does not carry the names the learner pushed, and a
    served copy already standing in must not stand in twice."""
    from torch.nn.utils import parametrize

    for prefix, sub in module.named_modules():
        if parametrize.is_parametrized(sub):
            raise ValueError(f"module {prefix or type(module).__name__!r} is parametrized already (a served copy "
                             "standing in, or another parametrization): its weights are not the masters")


@contextlib.contextmanager
def served_weights(module: torch.nn.Module, served: Mapping[str, torch.Tensor], *,
                   dtype: torch.dtype | None = None) -> Iterator[torch.nn.Module]:
    """Run `module` on the served copy while its parameters stay the fp32 masters.

        with served_weights(policy, info.served):
            loss = objective(policy(batch))
            loss.backward()          # gradients at the served weights, on the master parameters
        optimizer.step()             # updates the masters

    Each parameter reads as its served value (scaled formats dequantized with their scales,
    `dequantize`) in `dtype` (None: the parameter's own; the served values are exact in fp32), and
    its gradient lands on the master unchanged. The module is parametrized for the duration
    (`torch.nn.utils.parametrize`: a weight read anywhere, a tied one through either name, is the
    served copy; every forward makes its own autograd node, so several forwards and backwards
    accumulate as usual); its state dict keeps the masters' names outside the context.
    Buffers stay as they are. Everything is checked before the module is touched.
    """
    from torch.nn.utils import parametrize

    _check_plain(module)
    values = dequantize(served)
    plan = []
    for param, where in _places(module).values():
        names = [name for _, _, name in where]
        name = next((n for n in names if n in values), None)
        if name is None:
            raise KeyError(f"the served copy has no tensor {names[0]!r}"
                           + (f" (nor its tied names {names[1:]})" if len(names) > 1 else ""))
        if tuple(values[name].shape) != tuple(param.shape):
            raise ValueError(f"tensor {name!r}: the served copy has shape {list(values[name].shape)}, the module "
                             f"{list(param.shape)}")
        plan.append((param, where, values[name]))
    registered: list[tuple[torch.nn.Module, str]] = []
    # Each owner's parameter order, restored on exit (an optimizer's state is loaded by that order).
    orders = {id(owner): (owner, list(owner._parameters)) for _, where, _ in plan for owner, _, _ in where}
    try:
        for param, where, value in plan:
            stand_in = _Served(value.to(param.device), dtype or param.dtype)
            for owner, attr, _ in where:
                parametrize.register_parametrization(owner, attr, stand_in, unsafe=True)
                registered.append((owner, attr))
        yield module
    finally:
        for owner, attr in reversed(registered):  # the very Parameter objects come back (optimizers hold them)
            parametrize.remove_parametrizations(owner, attr, leave_parametrized=False)
        for owner, order in orders.values():
            for attr in order:
                owner._parameters[attr] = owner._parameters.pop(attr)


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
