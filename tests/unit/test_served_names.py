"""The served naming both ways: the served tensors a master becomes (`served_tensors`), and the
master (and role) each served tensor belongs to (`served_masters`, `master_of`); and the import of
the numerics loads no kernel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from weightsvc import rounding
from weightsvc.rounding import FORMATS, master_of, master_shape, served_masters, served_tensors

ROOT = Path(__file__).resolve().parents[2]
SHAPE = (64, 96)  # a multiple of every block (16, 32) along the rows; two 128-blocks in neither


@pytest.mark.parametrize("scaling", rounding.SCALINGS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_served_tensors_of_a_master_read_back_to_it(fmt: str, scaling: str) -> None:
    layout = served_tensors("x.weight", SHAPE, FORMATS[fmt], scaling)
    names = [name for name, _, _ in layout]
    assert served_masters(names) == {"x.weight": names}
    roles = [master_of(name, set(names)) for name in names]
    assert {master for master, _ in roles} == {"x.weight"}
    assert roles[0][1] == ("packed" if FORMATS[fmt].packed else "elements")
    assert [role for _, role in roles[1:]] == {
        "scale_inv": ["scale_inv"], "block_scale": ["block_scale"], "global_scale": ["block_scale", "global_scale"],
    }.get("global_scale" if FORMATS[fmt].global_scale else
          "block_scale" if FORMATS[fmt].block else "scale_inv" if FORMATS[fmt].scaled else "", [])
    assert master_shape(roles[0][1], layout[0][1]) == SHAPE


def test_a_version_of_many_masters_reads_back_in_order() -> None:
    masters = {
        "embed.weight": "bf16", "a.q_proj.weight": "nvfp4", "a.k_proj.weight": "mxfp4", "a.o_proj.weight": "mxfp8",
        "a.up_proj.weight": "fp8_e4m3", "norm.weight": "fp16",
        # a master whose name ends in a scale's suffix, of no master served: a master of its own
        "a.k_scale": "bf16", "b.weight_global_scale": "bf16",
    }
    layouts = {m: served_tensors(m, SHAPE, FORMATS[f]) for m, f in masters.items()}
    # the scales served before their elements, the masters' elements in the order given
    served = [n for layout in layouts.values() for n, _, _ in layout[1:]]
    served += [layout[0][0] for layout in layouts.values()]
    expected = {m: [n for n, _, _ in layout] for m, layout in layouts.items()}
    got = served_masters(served)
    assert got == expected and list(got) == list(expected)
    for master, names in expected.items():
        assert all(master_of(n, set(served))[0] == master for n in names)
    assert master_of("a.k_scale", served) == ("a.k_scale", "elements")


def test_importing_the_numerics_and_the_settings_loads_no_kernel() -> None:
    code = ("import sys, weightsvc.rounding, weightsvc.settings; "
            "print(sorted(m for m in ('numba', 'torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_device_choice() -> None:
    assert rounding.export_device("cpu") == "cpu"
    assert rounding.export_device("auto", "cpu") == "cpu"  # `export`: where the master lives
    assert rounding.export_device("auto", "cuda") == "cuda"
    with pytest.raises(ValueError, match="unknown device 'tpu'; choose one of auto, cpu, cuda"):
        rounding.export_device("tpu")


@pytest.mark.skipif(any(Path(n).exists() for n in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")),
                    reason="this machine has a GPU driver: torch is asked")
def test_without_a_gpu_driver_auto_exports_on_the_cpu_without_importing_torch() -> None:
    # torch is 250 MiB of a server's memory: a CPU-only server must not load it to learn it has no GPU.
    code = ("import sys, weightsvc.rounding as r; "
            "print(r.export_device('auto'), sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "cpu []"
