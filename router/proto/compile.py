"""Regenerate the Python modules of ``generate.proto``: ``python -m router.proto.compile``.

Runs ``grpc_tools.protoc`` from the repository root (so the generated imports read
``from router.proto import generate_pb2``) and puts a "generated" header on each file.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO = Path("router/proto/generate.proto")
OUTPUTS = ("generate_pb2.py", "generate_pb2.pyi", "generate_pb2_grpc.py")
HEADER = (
    "# Generated from router/proto/generate.proto by grpcio-tools; do not edit.\n"
    "# Regenerate: python -m router.proto.compile (from the repository root).\n"
    "# ruff: noqa\n"
    "# fmt: off\n"
)


def main() -> int:
    from grpc_tools import protoc

    root = Path(__file__).resolve().parents[2]
    args = ["protoc", "-I", str(root), "--python_out", str(root), "--pyi_out", str(root)]
    args += ["--grpc_python_out", str(root), str(root / PROTO)]
    if protoc.main(args) != 0:
        print(f"protoc failed on {PROTO}", file=sys.stderr)
        return 1
    for name in OUTPUTS:
        path = root / PROTO.parent / name
        path.write_text(HEADER + path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
