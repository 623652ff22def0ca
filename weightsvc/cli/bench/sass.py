"""K3_sass: the Triton export kernels compiled for a GPU (no GPU needed), their machine instructions
per element counted against a plain cast's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weightsvc.cli.bench._common import row

# How a launch specializes the kernels' arguments: pointer types, and which are 16-aligned (the CUDA
# caching allocator's blocks, and sizes that are multiples of 16).
_ARG_TYPES = {"src": "*fp32", "residual": "*fp32", "new_residual": "*fp32", "scales": "*fp32",
              "counts": "*i64", "blocks": "*i64", "keys": "*i64", "n": "i32"}
_ALIGNED = ("src", "dst", "residual", "new_residual", "n")


def compile_kernel(kernel: Any, constexprs: dict[str, object], served: str, arch: int = 90) -> Any:
    """A Triton kernel compiled ahead of time for CUDA compute capability `arch` (90: H100/H200),
    as a launch specializes it, down to the cubin: no GPU needed, only Triton's compiler (not under
    its interpreter). `served`: the dst pointer's type ("*i16", "*u8")."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from weightsvc.rounding import _triton

    names = kernel.arg_names
    types = _ARG_TYPES | {"dst": served}
    signature = {a: "constexpr" if a in constexprs else types.get(a, "i64") for a in names}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in _ALIGNED if a in names}
    return compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                   options=_triton.launch_options())


def _sass_instructions(cubin: bytes) -> int:
    """Machine instructions in a cubin (NOPs left out), disassembled by the nvdisasm Triton ships."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=True).stdout
    return sum(1 for line in text.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line) and "NOP" not in line)


def sass_bench(*, say: Callable[[str], Any]) -> dict[str, Any]:
    """`kernel_instructions`, in a process of its own (`python -m weightsvc.cli.bench.sass`) where
    Triton's interpreter is off: under it, kernels cannot be compiled. None where Triton or its
    compiler cannot be had."""
    say("K3_sass: the GPU kernels compiled for sm_90, their instructions counted")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "weightsvc.cli.bench.sass"], capture_output=True, text=True,
                          env=env, timeout=600)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"K3_sass": None, "details": {"k3_sass_skipped": why}}
    figures = json.loads(done.stdout)
    ratios = ", ".join(f"{k} {figures[f'K3_sass_{k}_vs_cast']:.1f}x"
                       for k in ("bf16_sr", "bf16_ef", "fp8_block_pow2_sr", "nvfp4_sr"))
    what = f"GPU kernels' machine instructions per element vs a cast ({figures['K3_sass_arch']})"
    return {"K3_sass": figures["K3_sass_bf16_sr_vs_cast"], "details": figures,
            "report": {"K3_sass": row(what, ratios)}}


def kernel_instructions(arch: int = 90) -> dict[str, Any]:
    """K3 measured without a GPU: the machine instructions per element of each export kernel, as
    compiled for `arch`, against a plain fp32 -> bf16 cast kernel compiled the same way. Every
    kernel here is straight-line code over the elements of one program, so instructions / elements
    per thread is what an element costs to issue; a kernel far above the cast is bound by its
    instructions, not by memory (the H200's measured K1 0.45). Must run outside the interpreter."""
    import triton
    import triton.language as tl

    from weightsvc.rounding import FORMATS, _triton
    from weightsvc.rounding._formats import SCALE_BLOCK, SCALE_ROW

    @triton.jit
    def cast_kernel(src, dst, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < n).to(tl.bfloat16), mask=i < n)

    per_thread = _triton.LAUNCH["block"] / (_triton.LAUNCH["num_warps"] * 32)
    bf16 = {"rtn": (False, False, True), "sr": (True, False, True), "sr_uncounted": (True, False, False),
            "ef": (False, True, True)}
    cases: dict[str, tuple[Any, dict[str, object], str]] = {
        "cast": (cast_kernel, {"BLOCK": _triton.LAUNCH["block"]}, "*bf16"),
        **{f"bf16_{k}": (_triton._bf16_kernel, _triton.bf16_constexprs(*v), "*i16") for k, v in bf16.items()},
    }
    scaled = (("fp8_block_pow2", "fp8_e4m3", SCALE_BLOCK, 4096), ("fp8_block", "fp8_e4m3", SCALE_BLOCK, 4000),
              ("mxfp8", "mxfp8", SCALE_ROW, 32), ("nvfp4", "nvfp4", SCALE_ROW, 16), ("mxfp4", "mxfp4", SCALE_ROW, 32))
    for label, name, mode, cols in scaled:  # (rows of 4096: shifts; of 4000: divisions)
        for rnd in ("sr", "ef"):
            constexprs = _triton.float_constexprs(FORMATS[name], mode, rnd == "sr", rnd == "ef", cols)
            cases[f"{label}_{rnd}"] = (_triton._float_kernel, constexprs, "*u8")
    per_element = {k: _sass_instructions(compile_kernel(*v, arch).asm["cubin"]) / per_thread for k, v in cases.items()}
    cast = per_element.pop("cast")
    return {
        "K3_sass_cast_per_element": round(cast, 1),
        **{f"K3_sass_{k}_per_element": round(v, 1) for k, v in per_element.items()},
        **{f"K3_sass_{k}_vs_cast": round(v / cast, 1) for k, v in per_element.items()},
        "K3_sass_arch": f"sm_{arch}",
        "K3_sass_launch": f"{_triton.LAUNCH['block']}x{_triton.LAUNCH['num_warps']}",
    }


if __name__ == "__main__":
    print(json.dumps(kernel_instructions()))
