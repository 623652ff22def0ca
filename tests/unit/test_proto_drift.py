"""The committed generated code must be what scripts/gen_proto.py makes from proto/ today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    # In a process of its own: protoc's library and NIXL's abort when loaded into one process (either order).
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    fresh = sorted((tmp_path / "weightsvc" / "v1").glob("*_pb2*"))
    assert fresh, "protoc generated nothing"
    for path in fresh:
        committed = ROOT / "weightsvc" / "v1" / path.name
        assert committed.exists(), f"{path.name} is generated but not committed"
        assert committed.read_text() == path.read_text(), (
            f"weightsvc/v1/{path.name} is stale: run python scripts/gen_proto.py"
        )
