"""scripts/gpu_check.sh runs only on a CUDA machine: here it is checked to parse (the script and the
Python it runs), and its NIXL part to say it skipped where there is no GPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def embedded() -> str:
    found = re.search(r"<<'PYEOF'\n(.*?)\nPYEOF\n", SCRIPT.read_text(), re.S)
    assert found, "gpu_check.sh runs no Python"
    return found.group(1)


def test_the_script_and_its_python_parse() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    compile(embedded(), "gpu_check.sh", "exec")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the check itself")
def test_its_nixl_part_says_it_skipped_without_a_gpu() -> None:
    definitions = embedded().split("\nout = {")[0]  # (the functions only: the rest needs the GPU)
    done = subprocess.run([sys.executable, "-c", definitions + "\nprint(nixl_vram())"], capture_output=True,
                          text=True, timeout=300, cwd=SCRIPT.parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "{'nixl_vram': 'skipped: no CUDA'}"
