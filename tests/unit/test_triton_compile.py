"""Every Triton kernel the service launches compiles for an H200 (sm_90), down to the cubin, without a GPU.

The interpreter that stands in for the GPU elsewhere runs the kernels as numpy: it accepts code that
the compiler rejects (mixed types in `tl.where`, a shift by a tensor of the wrong width) and says
nothing of the machine code. Compiled here, a kernel that breaks the compiler breaks in CI, not in a
GPU session; and the PTX shows what only a GPU could otherwise show: memory accesses 16 bytes wide
(the launch's pointers and sizes are 16-aligned, as the CUDA caching allocator's are), no FMA in
the ef residual, whose last bit would then differ from the CPU's, and the scaled formats' division
rounded as IEEE says, as numpy's and numba's are.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from weightsvc.cli.bench.sass import compile_kernel  # noqa: E402
from weightsvc.rounding import _triton  # noqa: E402
from weightsvc.rounding._formats import FORMATS, SCALE_BLOCK, SCALE_NONE, SCALE_ROW, SCALE_TENSOR  # noqa: E402

CASES = [
    (name, mode, cols, rounding)
    for name, fmt in FORMATS.items()
    for mode, cols in (
        [(SCALE_ROW, fmt.block)]
        if fmt.block
        else [(SCALE_TENSOR, 1), (SCALE_ROW, 4096), (SCALE_ROW, 1000), (SCALE_BLOCK, 4096), (SCALE_BLOCK, 1000)]
        if fmt.width == 8
        else [(SCALE_NONE, 1)]
    )
    for rounding in ("sr", "ef")
]  # rows of a power-of-two length take shifts, the others divisions


def case_id(name: str, mode: int, cols: int, rounding: str) -> str:
    return f"{name}-{mode}-{cols}-{rounding}"


RUNS = "bf16-runs"  # many small tensors in one launch


def compile_ptx(name: str, mode: int, cols: int, rounding: str) -> str:
    """The PTX of the kernel for one case, as a launch specializes it: 16-aligned pointers and size."""
    fmt, stochastic, ef = FORMATS[name], rounding == "sr", rounding == "ef"
    if rounding == "runs":
        kernel, constexprs = _triton._bf16_runs_kernel, _triton.bf16_constexprs(True, False)
        constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
    elif name == "bf16":
        kernel, constexprs = _triton._bf16_kernel, _triton.bf16_constexprs(stochastic, ef)
    else:
        kernel, constexprs = _triton._float_kernel, _triton.float_constexprs(fmt, mode, stochastic, ef, cols)
    binary = compile_kernel(kernel, constexprs, "*i16" if fmt.width == 16 else "*u8")
    assert binary.asm["cubin"], "no machine code"
    return str(binary.asm["ptx"])


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    # The tests run the kernels under the interpreter, whose kernels do not compile: compile in a
    # process of its own.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # (as a module from the repository's root: the weightsvc next to these tests, not an installed one)
    done = subprocess.run([sys.executable, "-m", "tests.unit.test_triton_compile"], env=env, capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout))


def memory_ops(ptx: str) -> set[str]:
    return set(re.findall(r"\b(?:ld|st)\.global[.\w]*", ptx))


@pytest.mark.parametrize(("name", "mode", "cols", "rounding"), CASES, ids=[case_id(*c) for c in CASES])
def test_every_kernel_compiles_with_wide_accesses_and_no_fma(ptx: dict[str, str], name: str, mode: int, cols: int,
                                                             rounding: str) -> None:
    code = ptx[case_id(name, mode, cols, rounding)]
    ops = memory_ops(code)
    assert "ld.global.v4.b32" in ops, ops  # the master, 4 fp32 a load
    if name == "bf16":
        assert "st.global.v4.b32" in ops, ops  # 8 bf16 a store
    if rounding == "ef":
        assert "st.global.v4.b32" in ops, ops  # the new residual
    assert "fma" not in code
    if mode != SCALE_NONE:  # u / scale: an IEEE division (not div.full's approximation), subnormals kept
        assert "div.rn.f32" in code and "div.full" not in code and ".ftz" not in code


def test_the_runs_kernel_compiles(ptx: dict[str, str]) -> None:
    # Its blocks start wherever a small tensor starts: no alignment to widen its accesses with.
    assert {"ld.global.b32", "st.global.b16"} <= memory_ops(ptx[RUNS])


if __name__ == "__main__":
    json.dump({case_id(*c): compile_ptx(*c) for c in CASES} | {RUNS: compile_ptx("bf16", 0, 1, "runs")}, sys.stdout)
