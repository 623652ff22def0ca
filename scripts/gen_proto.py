"""Regenerate the committed gRPC code: proto/weightsvc/v1/*.proto -> weightsvc/v1/*_pb2*.py(i).

Usage: python scripts/gen_proto.py [--out DIR]   (DIR defaults to the repository root)

The proto path mirrors the package path, so the generated imports (`from weightsvc.v1 import ...`)
resolve inside our own package without rewriting.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency

    protos = sorted(PROTO_ROOT.glob("weightsvc/v1/*.proto"))
    (out / "weightsvc" / "v1").mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *map(str, protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out / "weightsvc" / "v1").glob("*_pb2*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT)
    for path in generate(parser.parse_args().out):
        print(path, file=sys.stderr)


if __name__ == "__main__":
    main()
