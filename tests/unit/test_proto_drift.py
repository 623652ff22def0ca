"""The committed generated code must be what scripts/gen_proto.py makes from proto/ today."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = gen.generate(tmp_path)
    assert fresh, "protoc generated nothing"
    for path in fresh:
        committed = ROOT / "weightsvc" / "v1" / path.name
        assert committed.exists(), f"{path.name} is generated but not committed"
        assert committed.read_text() == path.read_text(), (
            f"weightsvc/v1/{path.name} is stale: run python scripts/gen_proto.py"
        )
