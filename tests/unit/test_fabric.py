"""The NIXL agents weightsvc builds (server, readers, bench) do not spin: NIXL's Python API gives its
progress thread no wait, and `new_agent` puts one in. If a NIXL release stops taking it, an idle
agent burns a core again and this fails. And how a READ is cut into pieces, for both ends."""

from __future__ import annotations

import subprocess
import sys

import pytest

from weightsvc.protocol.fabric import MemoryRange, cut_pieces

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


def test_reads_are_cut_into_pieces_across_tensors_and_ranges_each_span_counted_from_its_destination() -> None:
    ranges = {"a": [MemoryRange(1000, 5, 0), MemoryRange(2000, 3, 0)], "b": [MemoryRange(3000, 6, 1)]}
    pieces = cut_pieces([("a", 100, 0, ranges["a"]), ("b", 200, 1, ranges["b"])], 4)
    assert [p.nbytes for p in pieces] == [4, 4, 4, 2]
    assert [p.local for p in pieces] == [[(100, 4, 0)], [(104, 1, 0), (105, 3, 0)], [(200, 4, 1)], [(204, 2, 1)]]
    assert [p.remote for p in pieces] == [[(1000, 4, 0)], [(1004, 1, 0), (2000, 3, 0)], [(3000, 4, 1)],
                                          [(3004, 2, 1)]]
    assert [p.spans for p in pieces] == [[("a", 0, 4)], [("a", 4, 8)], [("b", 0, 4)], [("b", 4, 6)]]
    assert cut_pieces([("empty", 100, 0, [])], 4) == []
