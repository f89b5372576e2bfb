"""The generated modules in proto/ are what `make proto` makes from proto/gret_serve.proto now."""
from __future__ import annotations

from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("gret_serve_pb2.py", "gret_serve_pb2.pyi", "gret_serve_pb2_grpc.py")


def test_generated_modules_match_the_proto(tmp_path):
    status = protoc.main(["protoc", f"-I{ROOT}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                          f"--grpc_python_out={tmp_path}", str(ROOT / "proto" / "gret_serve.proto")])
    assert status == 0
    for name in GENERATED:
        fresh = (tmp_path / "proto" / name).read_text()
        assert (ROOT / "proto" / name).read_text() == fresh, f"proto/{name} is stale: run `make proto`"
