"""Regenerates the Python code of estimax/serving/protos from the .proto files checked in there.

    pip install grpcio-tools==1.85.1      # the `protos` extra; matches the grpcio pin
    python scripts/gen_protos.py          # rewrites *_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python scripts/gen_protos.py --check  # exit 1 if the checked-in code differs

The .proto files are the published ones, unmodified (see estimax/serving/protos/README.md for
where each comes from). protoc writes imports by the .proto path (``from tensorflow.core...``);
they are rewritten under ``estimax.serving.protos`` so that no top-level ``tensorflow`` or
``tensorflow_serving`` package is created or shadowed (a rewrite no protoc option does for
Python).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTOS = os.path.join(ROOT, "estimax", "serving", "protos")
PACKAGE = "estimax.serving.protos"
TOP_LEVEL = ("tensorflow", "tensorflow_serving")
# Only these define services; the others get no (empty) *_pb2_grpc.py.
SERVICES = (
    "tensorflow_serving/apis/prediction_service.proto",
    "tensorflow_serving/apis/model_service.proto",
)
# Triton's protos import each other by bare name (`import "model_config.proto"`), so their
# folder is its own include root: {folder: (its .proto files, those that define services)}.
FLAT = {"triton": (("grpc_service.proto", "model_config.proto"), ("grpc_service.proto",))}
GENERATED = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_IMPORT = re.compile(rf"^(from|import) ({'|'.join(TOP_LEVEL)})(\b)", re.M)
# `import x_pb2 as ...` in a FLAT folder's generated code.
_FLAT_IMPORT = re.compile(r"^import (\w+_pb2) as", re.M)


def proto_files() -> list[str]:
    """The .proto files under estimax/serving/protos, relative to it."""
    found = []
    for top in TOP_LEVEL:
        for dirpath, _, names in os.walk(os.path.join(PROTOS, top)):
            found += [
                os.path.relpath(os.path.join(dirpath, n), PROTOS)
                for n in names
                if n.endswith(".proto")
            ]
    return sorted(found)


def generate(out: str) -> list[str]:
    """Runs protoc into ``out``; returns the generated files (relative paths)."""
    import grpc_tools
    from grpc_tools import protoc

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    files = proto_files()
    base = ["protoc", f"-I{PROTOS}", f"-I{include}"]
    if protoc.main([*base, f"--python_out={out}", f"--pyi_out={out}", *files]) != 0:
        raise SystemExit("protoc failed (messages above)")
    if protoc.main([*base, f"--grpc_python_out={out}", *SERVICES]) != 0:
        raise SystemExit("protoc failed for the services (messages above)")
    for folder, (files, services) in FLAT.items():
        flat_out = os.path.join(out, folder)
        os.makedirs(flat_out, exist_ok=True)
        flat = ["protoc", f"-I{os.path.join(PROTOS, folder)}", f"-I{include}"]
        if (
            protoc.main([*flat, f"--python_out={flat_out}", f"--pyi_out={flat_out}", *files]) != 0
            or protoc.main([*flat, f"--grpc_python_out={flat_out}", *services]) != 0
        ):
            raise SystemExit(f"protoc failed for {folder}/ (messages above)")
    written = []
    for dirpath, _, names in os.walk(out):
        for name in names:
            if not name.endswith(GENERATED):
                continue
            path = os.path.join(dirpath, name)
            with open(path) as f:
                text = f.read()
            # `from tensorflow.core... import x` -> `from estimax.serving.protos.tensorflow.core...`
            text = _IMPORT.sub(lambda m: f"{m.group(1)} {PACKAGE}.{m.group(2)}", text)
            folder = os.path.relpath(dirpath, out).split(os.sep)[0]
            if folder in FLAT:  # `import x_pb2 as` -> `from estimax.serving.protos.triton import`
                text = _FLAT_IMPORT.sub(rf"from {PACKAGE}.{folder} import \1 as", text)
            with open(path, "w") as f:
                f.write(text)
            written.append(os.path.relpath(path, out))
    for dirpath, _, _ in os.walk(out):
        if dirpath != out:
            init = os.path.join(dirpath, "__init__.py")
            if not os.path.exists(init):
                open(init, "w").close()
                written.append(os.path.relpath(init, out))
    return sorted(written)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        written = generate(tmp)
        if args.check:
            differ = [
                p
                for p in written
                if not os.path.exists(os.path.join(PROTOS, p))
                or not filecmp.cmp(os.path.join(tmp, p), os.path.join(PROTOS, p), shallow=False)
            ]
            if differ:
                print(f"gen_protos: {len(differ)} generated files differ: {differ[:5]}")
                return 1
            print(f"gen_protos: {len(written)} generated files match the .proto files")
            return 0
        # Remove what an older run generated (a .proto may have been dropped since).
        for dirpath, _, names in os.walk(PROTOS):
            for name in names:
                if name.endswith(GENERATED):
                    os.remove(os.path.join(dirpath, name))
        for rel in written:
            os.makedirs(os.path.dirname(os.path.join(PROTOS, rel)), exist_ok=True)
            shutil.copyfile(os.path.join(tmp, rel), os.path.join(PROTOS, rel))
    print(f"gen_protos: wrote {len(written)} files under {os.path.relpath(PROTOS, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
