"""The estimax command: serve exports, classify images with one, check and convert them.

    estimax serve --model_base_path=DIR --model_name=resnet [--port=8501 --grpc_port=8500]
    estimax predict --model_base_path=DIR image1.jpg image2.png
    estimax export-check --model_base_path=DIR [--model_version=N]

Flags keep TensorFlow Serving's names, but for the ports: TF Serving's ``--port`` is its gRPC
port and ``--rest_api_port`` its HTTP port; here ``--port`` (alias ``--rest_api_port``) is the HTTP
port and ``--grpc_port`` the gRPC port. Bad flags or paths print one line and exit non-zero.

**Vertex AI.** With ``AIP_MODE=PREDICTION`` in the environment (a Vertex AI custom serving
container), ``serve``'s defaults come from Vertex's variables: ``--port`` from
``AIP_HTTP_PORT`` (8080 if unset), ``--host`` 0.0.0.0, ``--model_base_path`` from
``AIP_STORAGE_URI`` (the model's artifact URI: the folder of numeric versions), and the server
also answers health checks at ``AIP_HEALTH_ROUTE`` and predictions at ``AIP_PREDICT_ROUTE``
(``{"instances": [...]}`` -> ``{"predictions": [...]}``). Flags given on the command line win.
"""

from __future__ import annotations

import argparse
import json
import logging as std_logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

EXIT_USAGE = 2


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless it says its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, "", argparse.SUPPRESS):
            return text
        return super()._get_help_string(action) or text


def _parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    # Each subcommand's help fits its line of an 80-column terminal (56 characters).
    parser = argparse.ArgumentParser(
        prog="estimax", description=__doc__.split("\n")[0], formatter_class=_Defaults
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # Listed for --help; the `estimax` command (estimax.command) hands `estimax doctor ...` to
    # estimax.doctor before this parser sees it.
    sub.add_parser("doctor", help="devices, kernels, storage; --launch: a launch dry-run")
    _serve_parser(sub, os.environ if env is None else env)

    predict = sub.add_parser(
        "predict",
        help="classify image files with a version (and name them)",
        formatter_class=_Defaults,
    )
    predict.add_argument(
        "--model_base_path", required=True, help="folder (or URL) of numeric versions"
    )
    predict.add_argument(
        "--model_version", type=int, default=None, help="the version (default: the newest)"
    )
    predict.add_argument("--top_k", type=int, default=5, help="classes printed per image")
    predict.add_argument("images", nargs="+", help="JPEG or PNG files")

    check = sub.add_parser(
        "export-check",
        help="rerun a version's parity examples on this machine",
        formatter_class=_Defaults,
    )
    check.add_argument("--model_base_path", required=True, help="folder of numeric versions")
    check.add_argument(
        "--model_version", type=int, default=None, help="the version (default: the newest)"
    )

    _add_export_commands(sub)
    return parser


def _add_export_commands(sub: argparse._SubParsersAction) -> None:
    """``export-savedmodel`` and ``export-onnx``: a version in another serving format."""
    # estimax.serving.savedmodel / onnx_export: need the estimax[tf] / estimax[onnx] extras.
    for name, what, output, module in (
        (
            "export-savedmodel",
            "a TF SavedModel (estimax[tf])",
            ("--output_dir", "the SavedModel to write"),
            "savedmodel",
        ),
        (
            # Image preprocessing stays the client's job (onnx_export's docstring).
            "export-onnx",
            "an ONNX model (estimax[onnx])",
            ("--output", "the .onnx file to write"),
            "onnx_export",
        ),
    ):
        export = sub.add_parser(name, help=f"a version -> {what}", formatter_class=_Defaults)
        export.add_argument(
            "--model_base_path", required=True, help="folder (or URL) of numeric versions"
        )
        export.add_argument(
            "--model_version", type=int, default=None, help="the version (default: the newest)"
        )
        export.add_argument(
            output[0], required=True, help=f"{output[1]} (new; parents are created)"
        )
        export.add_argument(
            "--atol", default=None, help=f"see python -m estimax.serving.{module} -h"
        )


def _serve_parser(sub: Any, env: Mapping[str, str]) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve versions over HTTP (TF Serving, v2) and gRPC",
        formatter_class=_Defaults,
    )
    serve.add_argument(
        "--model_base_path",
        default=None,
        help="directory (or gs://, s3:// URL) holding numeric version folders (required; "
        "default under Vertex AI: AIP_STORAGE_URI)",
    )
    serve.add_argument("--model_name", default="default", help="the NAME in /v1/models/NAME")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)"
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
        "GRPCInferenceService; TF Serving uses 8500); 0: no gRPC",
    )
    serve.add_argument(
        "--rest_api_timeout_in_ms",
        "--rest_api_timeout_ms",
        type=int,
        default=30_000,
        dest="rest_api_timeout_in_ms",
        help="a request taking longer answers 504 (gRPC: DEADLINE_EXCEEDED)",
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
    _batching_flags(serve)
    _limit_flags(serve)
    _connection_flags(serve)
    _ops_flags(serve)
    _vertex_defaults(serve, env)


def _batching_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--enable_batching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="merge concurrent requests into batches (TF Serving's batching knobs below)",
    )
    serve.add_argument(
        "--max_batch_size", type=int, default=32, help="most instances in one model call"
    )
    serve.add_argument(
        "--batch_timeout_micros",
        type=int,
        default=1000,
        help="most time a batch waits to fill after its first request",
    )
    serve.add_argument(
        "--max_enqueued_batches",
        type=int,
        default=16,
        help="queue bound in batches of --max_batch_size; past it requests answer 429",
    )
    serve.add_argument(
        "--num_batch_threads", type=int, default=1, help="model calls run at the same time"
    )
    serve.add_argument(
        "--allowed_batch_sizes",
        type=_sizes,
        default=(),
        help="comma-separated sizes batches are padded to; the last must be "
        "--max_batch_size (default: powers of two)",
    )


def _limit_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--max_body_bytes",
        type=int,
        default=64 << 20,
        help="larger bodies answer 413 (gRPC messages: RESOURCE_EXHAUSTED)",
    )
    serve.add_argument(
        "--max_instances", type=int, default=1024, help="more in one request answer 400"
    )
    serve.add_argument(
        "--max_image_pixels",
        type=int,
        default=1 << 26,
        help="larger images (by their header) answer 400 before they are decoded",
    )


def _connection_flags(serve: argparse.ArgumentParser) -> None:
    # TF Serving's naming (--rest_api_timeout_in_ms); uvicorn's --timeout-keep-alive and
    # --limit-concurrency, nginx's client_header_timeout/client_body_timeout are the same ideas.
    serve.add_argument(
        "--rest_api_header_timeout_in_ms",
        type=int,
        default=10_000,
        help="a connection's request line and headers must arrive within this; else 408 and "
        "closed (a silent connection: closed). Also gRPC's handshake timeout",
    )
    serve.add_argument(
        "--rest_api_body_timeout_in_ms",
        type=int,
        default=30_000,
        help="a request's whole body must arrive within this of its headers; else 408 and closed",
    )
    serve.add_argument(
        "--rest_api_keep_alive_timeout_in_ms",
        type=int,
        default=5_000,
        help="an idle HTTP connection is closed after this (uvicorn's --timeout-keep-alive; "
        "behind a load balancer, set it above the balancer's idle timeout)",
    )
    serve.add_argument(
        "--max_connections",
        type=int,
        default=1000,
        help="open connections per port; past it the longest-waiting idle or stalled HTTP "
        "connection is closed (gRPC: refused). Lowered to fit the open-file limit (ulimit -n)",
    )
    serve.add_argument(
        "--max_header_bytes",
        type=int,
        default=64 << 10,
        help="a request line and headers larger than this answer 431",
    )


def _ops_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--monitoring_config_file",
        default="",
        help="TF Serving's monitoring config (text MonitoringConfig: prometheus_config "
        "{ enable: true, path: ... }): serve Prometheus metrics at its path (default: none)",
    )
    serve.add_argument(
        "--metrics_path",
        default="",
        help="serve Prometheus metrics at this HTTP path, e.g. /metrics or "
        "/monitoring/prometheus/metrics (default: none)",
    )
    serve.add_argument(
        "--access_log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write one line per request (time, client, protocol, route, model, version, "
        "status, latency, instances)",
    )
    serve.add_argument(
        "--access_log_file",
        default="",
        help="where the access log goes (default: standard error)",
    )
    serve.add_argument(
        "--access_log_format",
        choices=("text", "json"),
        default="text",
        help="text (key=value) or json (JSON lines)",
    )
    serve.add_argument(
        "--log_level",
        choices=("debug", "info", "warning", "error", "critical"),
        default="info",
        help="server log level (info: versions loaded and unloaded; warning: failed requests "
        "with their cause)",
    )


def _vertex_defaults(serve: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Under Vertex AI (``AIP_MODE=PREDICTION``) its variables are the defaults (module doc)."""
    serve.set_defaults(vertex_predict_route="", vertex_health_route="", vertex_bad_port="")
    if env.get("AIP_MODE") != "PREDICTION":
        return
    port = env.get("AIP_HTTP_PORT", "8080")
    serve.set_defaults(
        port=int(port) if port.isdigit() else 8080,
        vertex_bad_port="" if port.isdigit() else port,  # one line in serve()
        host="0.0.0.0",
        model_base_path=env.get("AIP_STORAGE_URI") or None,
        vertex_predict_route=env.get("AIP_PREDICT_ROUTE", ""),
        vertex_health_route=env.get("AIP_HEALTH_ROUTE", ""),
        vertex=True,
    )


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


def _server_options(args: argparse.Namespace) -> Any:
    """The ``ServerOptions`` of ``serve``'s flags (ValueError naming a bad one)."""
    from estimax.serving.batching import BatchingOptions
    from estimax.serving.metrics import parse_monitoring_config
    from estimax.serving.rest import ServerOptions
    from estimax.serving.transport import ConnectionLimits

    batching = BatchingOptions(
        args.max_batch_size,
        args.batch_timeout_micros,
        args.max_enqueued_batches,
        args.num_batch_threads,
        tuple(args.allowed_batch_sizes),
    )
    batching.validate()
    if args.monitoring_config_file and args.metrics_path:
        raise ValueError("give --monitoring_config_file or --metrics_path, not both")
    metrics_path = (
        parse_monitoring_config(args.monitoring_config_file)
        if args.monitoring_config_file
        else args.metrics_path or None
    )
    if metrics_path is not None and not metrics_path.startswith("/"):
        raise ValueError(f"--metrics_path={metrics_path} must start with /")
    options = ServerOptions(
        enable_batching=args.enable_batching,
        batching=batching,
        rest_api_timeout_in_ms=args.rest_api_timeout_in_ms,
        max_body_bytes=args.max_body_bytes,
        max_instances=args.max_instances,
        max_image_pixels=args.max_image_pixels,
        grpc_port=args.grpc_port,
        grpc_host=args.host,
        metrics_paths=(metrics_path,) if metrics_path else (),
        access_log=args.access_log,
        access_log_format=args.access_log_format,
        vertex_predict_route=args.vertex_predict_route,
        vertex_health_route=args.vertex_health_route,
        limits=ConnectionLimits(
            header_timeout_s=args.rest_api_header_timeout_in_ms / 1000,
            body_timeout_s=args.rest_api_body_timeout_in_ms / 1000,
            keep_alive_timeout_s=args.rest_api_keep_alive_timeout_in_ms / 1000,
            max_connections=args.max_connections,
            max_header_bytes=args.max_header_bytes,
        ),
    )
    options.limits.validate()
    return options


def _check_vertex(args: argparse.Namespace) -> None:
    """One line naming the Vertex AI variable that is missing or wrong."""
    if not getattr(args, "vertex", False):
        return
    if args.vertex_bad_port:
        raise ValueError(f"AIP_HTTP_PORT={args.vertex_bad_port!r} is not a port number")
    for flag, variable in (
        (args.vertex_predict_route, "AIP_PREDICT_ROUTE"),
        (args.vertex_health_route, "AIP_HEALTH_ROUTE"),
    ):
        if not flag.startswith("/"):
            raise ValueError(
                f"AIP_MODE=PREDICTION but {variable}={flag!r}: Vertex AI sets it to the "
                "route it calls (a path starting with /)"
            )


def _refuse_one_version(base: str) -> None:
    """One line when the path given is a single version's folder, not the model's."""
    import fsspec

    from estimax.serving.artifact import SIGNATURE_FILE

    fs, root = fsspec.core.url_to_fs(base)
    if fs.exists(f"{root.rstrip('/')}/{SIGNATURE_FILE}"):
        raise ValueError(
            f"{base} is one version's export, not a model base path: serve the folder that "
            "holds it as a numbered version (e.g. move it to BASE/1 and give BASE)"
        )


def _configure_logging(args: argparse.Namespace) -> None:
    """The server's log (``--log_level``) and the access log (its own stream, bare lines)."""
    std_logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    access = std_logging.getLogger("estimax.serving.access")
    access.propagate = False
    handler = (
        std_logging.FileHandler(args.access_log_file)  # OSError names the file
        if args.access_log_file
        else std_logging.StreamHandler(sys.stderr)
    )
    handler.setFormatter(std_logging.Formatter("%(message)s"))
    access.handlers[:] = [handler]
    access.setLevel(std_logging.INFO)
    if args.log_level != "debug":  # JAX's start-up notes (no TPU found...) are not the server's
        std_logging.getLogger("jax").setLevel(std_logging.WARNING)


def serve(args: argparse.Namespace) -> int:
    """Runs the server until interrupted."""
    import uvicorn

    from estimax.serving import transport
    from estimax.serving.manager import ModelManager
    from estimax.serving.rest import Server
    from estimax.serving.servable import default_batch_sizes
    from estimax.serving.versions import list_versions

    _check_vertex(args)
    if not args.model_base_path:
        raise ValueError(
            "--model_base_path is required (or AIP_STORAGE_URI with AIP_MODE=PREDICTION)"
        )
    options = _server_options(args)
    for flag, port in (("--port", args.port), ("--grpc_port", args.grpc_port)):
        _check_port(flag, args.host, port)
    if args.grpc_port and args.grpc_port == args.port:
        raise ValueError(f"--grpc_port={args.grpc_port} is also --port; give two ports")
    if not list_versions(args.model_base_path):  # fails early, with the flag's name, if absent
        _refuse_one_version(args.model_base_path)
    _configure_logging(args)
    options = _fit_connections(options, ports=2 if args.grpc_port else 1)
    batching = options.batching
    sizes = list(batching.allowed_batch_sizes) or default_batch_sizes(batching.max_batch_size)
    manager = ModelManager(
        args.model_name,
        args.model_base_path,
        sizes,
        num_versions=args.num_versions,
        poll_wait_seconds=args.file_system_poll_wait_seconds,
    )
    server = Server(manager, options)
    manager.start()  # loads and warms the newest version before the port opens
    print(
        f"Serving model {args.model_name!r} from {args.model_base_path} on "
        f"http://{args.host}:{args.port} (REST: /v1/models/{args.model_name}, v2: "
        f"/v2/models/{args.model_name})"
        + (f"; gRPC on {args.host}:{args.grpc_port}" if args.grpc_port else "")
        + (f"; metrics on {', '.join(options.metrics_paths)}" if options.metrics_paths else "")
        + (f"; Vertex AI: {args.vertex_predict_route}" if args.vertex_predict_route else ""),
        flush=True,
    )
    http = transport.protocol_class(
        options.limits, on_close=server.core.metrics.connection_closed, refuse_app=server.refuse_app
    )
    try:
        uvicorn.run(
            server.app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=False,
            http=http,
            timeout_keep_alive=options.limits.keep_alive_timeout_s,
        )
    finally:
        manager.stop()
    return 0


def _fit_connections(options: Any, ports: int) -> Any:
    """``options`` with ``--max_connections`` lowered to fit the open-file limit (logged)."""
    import dataclasses

    from estimax.serving import transport

    fitted, why = transport.fitted_max_connections(options.limits.max_connections, ports)
    if why:
        std_logging.getLogger("estimax.serving.transport").warning(why)
    limits = dataclasses.replace(options.limits, max_connections=fitted)
    return dataclasses.replace(options, limits=limits)


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
            # [class id, probability] (and the class's name when the export has them).
            top = np.argsort(-probabilities[i], kind="stable")[: args.top_k]
            line["top_k"] = [
                [int(c), float(probabilities[i][c])]
                + ([str(servable.class_names[c])] if servable.class_names is not None else [])
                for c in top
            ]
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


def export_onnx(args: argparse.Namespace) -> int:
    """A version as an ONNX model (``estimax.serving.onnx_export``)."""
    from estimax.serving import onnx_export

    path, _ = _version_dir(args.model_base_path, args.model_version)
    argv = [f"--export_dir={path}", f"--output={args.output}"]
    return onnx_export.main(argv + ([f"--atol={args.atol}"] if args.atol else []))


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Entry point of the ``estimax`` console script (``env``: the environment to read)."""
    args = _parser(env).parse_args(argv)
    std_logging.basicConfig(level=std_logging.WARNING)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    from estimax.serving.versions import ExportCheckError

    try:
        return {
            "serve": serve,
            "predict": predict,
            "export-check": export_check,
            "export-savedmodel": export_savedmodel,
            "export-onnx": export_onnx,
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
