"""The ``estimax`` command: ``serve``, ``predict`` and ``export-check``.

    estimax serve --model_base_path=DIR --model_name=resnet [--port=8501 --grpc_port=8500]
    estimax predict --model_base_path=DIR image1.jpg image2.png
    estimax export-check --model_base_path=DIR [--model_version=N]

Flags keep TensorFlow Serving's names, but for the ports: TF Serving's ``--port`` is its gRPC
port and ``--rest_api_port`` its HTTP port; here ``--port`` (alias ``--rest_api_port``) is the HTTP
port and ``--grpc_port`` the gRPC port. Bad flags or paths print one line and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import logging as std_logging
import os
import sys
from collections.abc import Sequence

import numpy as np

EXIT_USAGE = 2


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="estimax", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the versions under --model_base_path over HTTP")
    serve.add_argument(
        "--model_base_path",
        required=True,
        help="directory (or gs://, s3:// URL) holding numeric version folders",
    )
    serve.add_argument("--model_name", default="default", help="the NAME in /v1/models/NAME")
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default loopback only; 0.0.0.0 for all)",
    )
    serve.add_argument(
        "--port",
        "--rest_api_port",
        type=int,
        default=8501,
        dest="port",
        help="HTTP port: TF Serving REST (/v1) and Open Inference Protocol v2 (/v2). NOTE: "
        "TF Serving's --port is its gRPC port; here gRPC is --grpc_port",
    )
    serve.add_argument(
        "--grpc_port",
        type=int,
        default=0,
        help="gRPC port (TF Serving's PredictionService/ModelService and v2's "
        "GRPCInferenceService; TF Serving uses 8500); 0: no gRPC (default)",
    )
    serve.add_argument(
        "--rest_api_timeout_in_ms",
        "--rest_api_timeout_ms",
        type=int,
        default=30_000,
        dest="rest_api_timeout_in_ms",
    )
    serve.add_argument(
        "--file_system_poll_wait_seconds",
        type=float,
        default=1.0,
        help="poll for new versions this often (0: load once)",
    )
    serve.add_argument(
        "--num_versions",
        type=int,
        default=1,
        help="serve the newest N versions (TF Serving's latest{N} policy)",
    )
    serve.add_argument("--enable_batching", action=argparse.BooleanOptionalAction, default=False)
    serve.add_argument("--max_batch_size", type=int, default=32)
    serve.add_argument("--batch_timeout_micros", type=int, default=1000)
    serve.add_argument("--max_enqueued_batches", type=int, default=16)
    serve.add_argument("--num_batch_threads", type=int, default=1)
    serve.add_argument(
        "--allowed_batch_sizes",
        type=_sizes,
        default=(),
        help="comma-separated sizes batches are padded to; the last must be "
        "--max_batch_size (default: powers of two)",
    )
    serve.add_argument("--max_body_bytes", type=int, default=64 << 20)
    serve.add_argument("--max_instances", type=int, default=1024)
    serve.add_argument("--max_image_pixels", type=int, default=1 << 26)
    serve.add_argument("--log_level", default="warning")

    predict = sub.add_parser("predict", help="classify image files with the latest version")
    predict.add_argument("--model_base_path", required=True)
    predict.add_argument("--model_version", type=int, default=None)
    predict.add_argument("--top_k", type=int, default=5)
    predict.add_argument("images", nargs="+", help="JPEG or PNG files")

    check = sub.add_parser("export-check", help="rerun a version's stored parity examples")
    check.add_argument("--model_base_path", required=True)
    check.add_argument("--model_version", type=int, default=None)

    # estimax.serving.savedmodel: needs the estimax[tf] extra (TensorFlow).
    saved = sub.add_parser(
        "export-savedmodel",
        help="a version -> a TensorFlow SavedModel (serving_default as the original's); "
        "needs TensorFlow (the estimax[tf] extra)",
    )
    saved.add_argument("--model_base_path", required=True)
    saved.add_argument("--model_version", type=int, default=None)
    saved.add_argument("--output_dir", required=True, help="the SavedModel to write (new)")
    saved.add_argument("--atol", default=None, help="see python -m estimax.serving.savedmodel -h")
    return parser


def _version_dir(base: str, version: int | None) -> tuple[str, int]:
    from estimax.serving.versions import list_versions

    versions = list_versions(base)
    if not versions:
        raise FileNotFoundError(
            f"--model_base_path={base} has no published version "
            "(numeric folders with serving.json or signature.json)"
        )
    if version is None:
        version = versions[-1]
    elif version not in versions:
        raise FileNotFoundError(
            f"--model_version={version} is not under {base} (versions: {versions})"
        )
    return f"{base.rstrip('/')}/{version}", version


def _check_port(flag: str, host: str, port: int) -> None:
    """One clear line (not a server's traceback) when a port cannot be bound."""
    import socket

    if port == 0 and flag == "--grpc_port":
        return
    if not 0 < port < 65536:
        raise ValueError(f"{flag}={port} is not a TCP port (1-65535)")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(
                f"{flag}={port}: cannot listen on {host}:{port}: {e.strerror}"
            ) from None


def serve(args: argparse.Namespace) -> int:
    """Runs the server until interrupted."""
    import uvicorn

    from estimax.serving.batching import BatchingOptions
    from estimax.serving.manager import ModelManager
    from estimax.serving.rest import Server, ServerOptions
    from estimax.serving.servable import default_batch_sizes
    from estimax.serving.versions import list_versions

    batching = BatchingOptions(
        args.max_batch_size,
        args.batch_timeout_micros,
        args.max_enqueued_batches,
        args.num_batch_threads,
        tuple(args.allowed_batch_sizes),
    )
    batching.validate()
    for flag, port in (("--port", args.port), ("--grpc_port", args.grpc_port)):
        _check_port(flag, args.host, port)
    if args.grpc_port and args.grpc_port == args.port:
        raise ValueError(f"--grpc_port={args.grpc_port} is also --port; give two ports")
    list_versions(args.model_base_path)  # fails early, with the flag's name, if absent
    sizes = list(batching.allowed_batch_sizes) or default_batch_sizes(batching.max_batch_size)
    manager = ModelManager(
        args.model_name,
        args.model_base_path,
        sizes,
        num_versions=args.num_versions,
        poll_wait_seconds=args.file_system_poll_wait_seconds,
    )
    options = ServerOptions(
        enable_batching=args.enable_batching,
        batching=batching,
        rest_api_timeout_in_ms=args.rest_api_timeout_in_ms,
        max_body_bytes=args.max_body_bytes,
        max_instances=args.max_instances,
        max_image_pixels=args.max_image_pixels,
        grpc_port=args.grpc_port,
        grpc_host=args.host,
    )
    server = Server(manager, options)
    manager.start()  # loads and warms the newest version before the port opens
    for state in manager.states():
        if state.error:
            print(
                f"estimax serve: version {state.version} failed to load: {state.error}",
                file=sys.stderr,
            )
    print(
        f"Serving model {args.model_name!r} from {args.model_base_path} on "
        f"http://{args.host}:{args.port} (REST: /v1/models/{args.model_name}, v2: "
        f"/v2/models/{args.model_name})"
        + (f"; gRPC on {args.host}:{args.grpc_port}" if args.grpc_port else ""),
        flush=True,
    )
    try:
        uvicorn.run(
            server.app, host=args.host, port=args.port, log_level=args.log_level, access_log=False
        )
    finally:
        manager.stop()
    return 0


def predict(args: argparse.Namespace) -> int:
    """Prints one JSON line per image: its class and the top-k probabilities."""
    from estimax.serving.servable import Servable

    path, version = _version_dir(args.model_base_path, args.model_version)
    servable = Servable(path, version)
    if servable.preprocessing is None:
        raise ValueError(
            f"{path} takes arrays, not images (it was exported without "
            "preprocessing); send arrays to the server instead"
        )
    images = []
    for name in args.images:
        with open(name, "rb") as f:  # FileNotFoundError names the file
            images.append(f.read())
    outputs = servable.predict_images(images)
    probabilities = outputs.get("probabilities")
    for i, name in enumerate(args.images):
        line: dict = {"image": name, "model_version": version}
        for key, value in outputs.items():
            if key != "probabilities":
                line[key] = np.asarray(value[i]).tolist()
        if probabilities is not None:
            top = np.argsort(-probabilities[i])[: args.top_k]
            line["top_k"] = [[int(c), float(probabilities[i][c])] for c in top]
        print(json.dumps(line))
    return 0


def export_check(args: argparse.Namespace) -> int:
    """Reruns a version's stored examples; exit 1 beyond the tolerance."""
    from estimax.serving.versions import check_version

    path, _ = _version_dir(args.model_base_path, args.model_version)
    count, diffs = check_version(path)
    print(
        f"export-check: {path}: {count} examples match "
        + ", ".join(f"{k} (max |diff| {v:.3g})" for k, v in diffs.items())
    )
    return 0


def export_savedmodel(args: argparse.Namespace) -> int:
    """A version as a TensorFlow SavedModel (``estimax.serving.savedmodel``)."""
    from estimax.serving import savedmodel

    path, _ = _version_dir(args.model_base_path, args.model_version)
    argv = [f"--export_dir={path}", f"--output_dir={args.output_dir}"]
    return savedmodel.main(argv + ([f"--atol={args.atol}"] if args.atol else []))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``estimax`` console script."""
    args = _parser().parse_args(argv)
    std_logging.basicConfig(level=std_logging.WARNING)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    from estimax.serving.versions import ExportCheckError

    try:
        return {
            "serve": serve,
            "predict": predict,
            "export-check": export_check,
            "export-savedmodel": export_savedmodel,
        }[args.command](args)
    except ExportCheckError as e:
        print(f"estimax {args.command}: FAILED: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"estimax {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE


def run() -> None:
    """Console-script wrapper."""
    sys.exit(main())


if __name__ == "__main__":
    run()
