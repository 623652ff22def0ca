"""The NIXL agents weightsvc builds (server, readers, bench) do not spin: NIXL's Python API gives its
progress thread no wait, and `new_agent` puts one in. If a NIXL release stops taking it, an idle
agent burns a core again and this fails."""

from __future__ import annotations

import subprocess
import sys

import pytest

IDLE = """
import os, time
from weightsvc.protocol.fabric import new_agent
agent = new_agent("idle")
time.sleep(0.5)  # (its threads started)
before = sum(os.times()[:2])
time.sleep(2)
print(sum(os.times()[:2]) - before)
"""


@pytest.mark.usefixtures("nixl_installed")
def test_an_idle_agent_leaves_the_cpu_alone() -> None:
    done = subprocess.run([sys.executable, "-c", IDLE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    cpu_s = float(done.stdout.split()[-1])
    assert cpu_s < 0.5, f"an idle NIXL agent used {cpu_s:.2f} s of CPU in 2 s: its progress thread spins"
