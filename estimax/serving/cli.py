"""``estimax serve``: its flags, checked, and the server they start.

    estimax serve --model_base_path=DIR --model_name=resnet [--port=8501 --grpc_port=8500]

Flags keep TensorFlow Serving's names, but for the ports: TF Serving's ``--port`` is its gRPC
port and ``--rest_api_port`` its HTTP port; here ``--port`` (alias ``--rest_api_port``) is the HTTP
port and ``--grpc_port`` the gRPC port (``tensorflow_model_server``, ``serving/tf_serving.py``,
takes TF Serving's flags with TF Serving's meanings). Bad flags or paths print one line and exit
non-zero.

**Vertex AI.** With ``AIP_MODE=PREDICTION`` in the environment (a Vertex AI custom serving
container), ``serve``'s defaults come from Vertex's variables: ``--port`` from
``AIP_HTTP_PORT`` (8080 if unset), ``--host`` 0.0.0.0, ``--model_base_path`` from
``AIP_STORAGE_URI`` (the model's artifact URI: the folder of numeric versions), and the server
also answers health checks at ``AIP_HEALTH_ROUTE`` and predictions at ``AIP_PREDICT_ROUTE``
(``{"instances": [...]}`` -> ``{"predictions": [...]}``). Flags given on the command line win.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import logging as std_logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from logging.handlers import WatchedFileHandler
from typing import Any

from estimax.export.cli import Defaults
from estimax.serving.batching import BatchingOptions
from estimax.serving.options import READINESS, ServerOptions
from estimax.serving.transport import ConnectionLimits


@dataclasses.dataclass(frozen=True)
class Flag:
    """One ``serve`` flag, defined once: the parser and ``ServerOptions`` are built from it.

    Attributes:
      names: the flag, then its aliases (TF Serving's or KServe's spellings).
      help: its ``--help`` line.
      type: how its text is read (``bool``: ``--x``/``--no-x``); None: its field's type (that
        of the field's default), or ``str`` for a flag with no field.
      default: its default; for a flag with a ``field``, None takes the field's own default
        (times ``scale``), so each default is written once, in the dataclass.
      field: the ``ServerOptions`` field it sets (``batching.x``: ``BatchingOptions.x``,
        ``limits.x``: ``ConnectionLimits.x``); empty: read by ``serve`` itself.
      scale: the flag's value is the field's times this (milliseconds of a field in seconds).
      check: ``check(flag, value)`` -> the field's value, or ValueError naming the flag.
      choices: the values it accepts, if only some.
    """

    names: tuple[str, ...]
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    field: str = ""
    scale: int = 1
    check: Callable[[str, Any], Any] | None = None
    choices: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The flag's own name (``--port``)."""
        return self.names[0]

    @property
    def dest(self) -> str:
        """Its attribute in the parsed arguments (``port``)."""
        return self.name.removeprefix("--")

    def value_type(self) -> Callable[[str], Any] | None:
        """How the flag's text is read: ``type``, else the type of its field's default."""
        if self.type is None and self.field:
            return type(self.default_value())
        return self.type

    def default_value(self) -> Any:
        """The default: given, or the ``ServerOptions`` field's (times ``scale``)."""
        if self.default is not None or not self.field:
            return self.default
        value = _field_default(self.field)
        return self.type(value * self.scale) if self.scale != 1 and self.type else value

    def option_value(self, args: argparse.Namespace) -> Any:
        """The field's value from this flag's in ``args`` (ValueError naming the flag)."""
        value = getattr(args, self.dest)
        if self.check is not None:
            return self.check(self.name, value)
        return value / self.scale if self.scale != 1 else value


def _field_default(path: str) -> Any:
    """The default of ``ServerOptions`` field ``path`` (``limits.max_connections``)."""
    value: Any = ServerOptions()
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _at_least_0(flag: str, value: int) -> int:
    if value < 0:
        raise ValueError(f"{flag}={value} must be >= 0")
    return value


def _json_workers(flag: str, value: int) -> int:
    return min(_at_least_0(flag, value), os.cpu_count() or 1)


def _grpc_arguments(flag: str, value: str) -> tuple[tuple[str, int | str], ...]:
    return grpc_arguments(value)


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


# Every ``serve`` flag, in ``--help``'s order. Those with a ``field`` make ``ServerOptions``
# (``_server_options``); the others say what to serve, where, and how to log.
FLAGS: tuple[Flag, ...] = (
    Flag(
        ("--model_base_path",),
        "directory (or gs://, s3:// URL) holding numeric version folders (required; "
        "default under Vertex AI: AIP_STORAGE_URI)",
    ),
    Flag(("--model_name",), "the NAME in /v1/models/NAME", default="default"),
    Flag(
        ("--model_config_file",),
        "serve several models: TF Serving's text ModelServerConfig (model_config_list { "
        "config { name, base_path, model_version_policy, version_labels } ... }); replaces "
        "--model_base_path and --model_name (default: none)",
        default="",
    ),
    Flag(
        ("--model_config_file_poll_wait_seconds",),
        "re-read --model_config_file this often (models added, removed, relabelled; a bad "
        "file is logged and the old config kept); 0: read once",
        float,
        0.0,
    ),
    Flag(
        ("--allow_version_labels_for_unavailable_models",),
        "let a new version label name a version that is not loaded yet (TF Serving's flag)",
        bool,
        False,
    ),
    Flag(
        ("--model_control_mode",),
        "who loads models: none (all at start; load/unload calls refused), poll (as none, "
        "and the config file watched) or explicit (only --load_model at start, the others "
        "by the v2 repository extension's load/unload calls)",
        default="none",
        choices=("none", "poll", "explicit"),
    ),
    Flag(
        ("--unload_drain_secs",),
        "an unload call waits this long at most for the model's requests in flight; past "
        "it, it answers and the versions are freed when they end",
        float,
        30.0,
    ),
    Flag(("--host",), "address to bind (0.0.0.0 for all interfaces)", default="127.0.0.1"),
    Flag(
        ("--port", "--rest_api_port"),
        "HTTP port: TF Serving REST (/v1) and Open Inference Protocol v2 (/v2). NOTE: "
        "TF Serving's --port is its gRPC port; here gRPC is --grpc_port",
        int,
        8501,
    ),
    Flag(
        ("--grpc_port",),
        "gRPC port (TF Serving's PredictionService/ModelService and v2's "
        "GRPCInferenceService; TF Serving uses 8500); 0: no gRPC",
        field="grpc_port",
    ),
    Flag(
        ("--rest_api_timeout_in_ms", "--rest_api_timeout_ms"),
        "a request taking longer answers 504 (gRPC: DEADLINE_EXCEEDED); 0 or less: no "
        "deadline (as TF Serving)",
        field="rest_api_timeout_in_ms",
    ),
    Flag(
        ("--readiness",),
        "the server's readiness (gRPC health \"\", /v2/health/ready): all (TF Serving's: "
        "every model has a version available) or any (one broken model does not make the "
        "server unready; probe /v2/models/NAME/ready or gRPC health NAME per model)",
        field="readiness",
        choices=READINESS,
    ),
    Flag(
        ("--file_system_poll_wait_seconds",),
        "poll for new versions this often (0: load once)",
        float,
        1.0,
    ),
    Flag(
        ("--version_load_timeout_seconds",),
        "a version still loading (reading, compiling, warming, checking) after this is "
        "logged and set aside, and the others load meanwhile; it is tried again once that "
        "load ends (a file on a hung mount)",
        float,
        600.0,
    ),
    Flag(
        ("--num_versions",),
        "serve the newest N versions (TF Serving's latest{N} policy)",
        int,
        1,
    ),
    Flag(
        ("--enable_model_warmup",),
        "replay a version's assets.extra/tf_serving_warmup_requests (TF Serving's "
        "PredictionLog records, up to 1000) before it is served",
        field="enable_model_warmup",
    ),
    Flag(
        ("--num_request_iterations_for_warmup",),
        "replay each warm-up record this many times",
        field="warmup_iterations",
    ),
    # Batching: TF Serving's knobs.
    Flag(
        ("--enable_batching",),
        "merge concurrent requests into batches (TF Serving's batching knobs below)",
        field="enable_batching",
    ),
    Flag(
        ("--max_batch_size",),
        "most instances in one model call",
        field="batching.max_batch_size",
    ),
    Flag(
        ("--batch_timeout_micros",),
        "most time a batch waits to fill after its first request",
        field="batching.batch_timeout_micros",
    ),
    Flag(
        ("--max_enqueued_batches",),
        "queue bound in batches of --max_batch_size; past it requests answer 429",
        field="batching.max_enqueued_batches",
    ),
    Flag(
        ("--num_batch_threads",),
        "model calls run at the same time",
        field="batching.num_batch_threads",
    ),
    Flag(
        ("--allowed_batch_sizes",),
        "comma-separated sizes batches are padded to; the last must be "
        "--max_batch_size (default: powers of two)",
        _sizes,
        field="batching.allowed_batch_sizes",
    ),
    # What one request may hold.
    Flag(
        ("--max_body_bytes",),
        "larger bodies answer 413 (gRPC messages: RESOURCE_EXHAUSTED)",
        field="max_body_bytes",
    ),
    Flag(
        ("--max_body_bytes_in_flight",),
        "HTTP request bodies held at once (counted as their bytes arrive, not as "
        "declared); a body that would pass it answers 503 with Retry-After",
        field="max_body_bytes_in_flight",
    ),
    Flag(("--max_instances",), "more in one request answer 400", field="max_instances"),
    Flag(
        ("--max_image_pixels",),
        "larger images (by their header) answer 400 before they are decoded",
        field="max_image_pixels",
    ),
    # Connections. TF Serving's naming (--rest_api_timeout_in_ms); uvicorn's
    # --timeout-keep-alive and --limit-concurrency, nginx's client_header_timeout and
    # client_body_timeout are the same ideas.
    Flag(
        ("--rest_api_header_timeout_in_ms",),
        "a connection's request line and headers must arrive within this; else 408 and "
        "closed (a silent connection: closed). Also gRPC's handshake timeout",
        int,
        field="limits.header_timeout_s",
        scale=1000,
    ),
    Flag(
        ("--rest_api_body_timeout_in_ms",),
        "a request's whole body must arrive within this of its headers; else 408 and closed",
        int,
        field="limits.body_timeout_s",
        scale=1000,
    ),
    Flag(
        ("--rest_api_keep_alive_timeout_in_ms",),
        "an idle HTTP connection is closed after this (uvicorn's --timeout-keep-alive; "
        "behind a load balancer, set it above the balancer's idle timeout)",
        int,
        field="limits.keep_alive_timeout_s",
        scale=1000,
    ),
    Flag(
        ("--max_connections",),
        "open connections per port; past it the longest-waiting idle or stalled HTTP "
        "connection is closed (gRPC: refused). Lowered to fit the open-file limit (ulimit -n)",
        field="limits.max_connections",
    ),
    Flag(
        ("--max_header_bytes",),
        "a request line and headers larger than this answer 431",
        field="limits.max_header_bytes",
    ),
    # TF Serving's names and meanings, where estimax has the same resource.
    Flag(
        ("--grpc_max_threads",),
        "gRPC calls in progress at once, at most (TF Serving's gRPC threads); past it a "
        "call answers RESOURCE_EXHAUSTED at once (0: no bound)",
        field="grpc_max_concurrent_rpcs",
        check=_at_least_0,
    ),
    Flag(
        ("--grpc_channel_arguments",),
        "comma-separated gRPC server arguments, e.g. grpc.max_connection_age_ms=2000 "
        "(integers as integers, as TF Serving); they replace estimax's own of the same name "
        "(default: none)",
        default="",
        field="grpc_arguments",
        check=_grpc_arguments,
    ),
    Flag(
        ("--rest_api_num_threads",),
        "processes that parse large HTTP bodies and write large answers, at most one per "
        "core (TF Serving's REST threads; 0: 2)",
        field="json_workers",
        check=_json_workers,
    ),
    # Operations: metrics, logs, documentation pages.
    Flag(
        ("--monitoring_config_file",),
        "TF Serving's monitoring config (text MonitoringConfig: prometheus_config "
        "{ enable: true, path: ... }): serve Prometheus metrics at its path (default: none)",
        default="",
    ),
    Flag(
        ("--metrics_path",),
        "serve Prometheus metrics at this HTTP path, e.g. /metrics or "
        "/monitoring/prometheus/metrics (default: none)",
        default="",
    ),
    Flag(
        ("--access_log",),
        "write one line per request (time, client, protocol, route, model, version, "
        "status, latency, instances)",
        field="access_log",
    ),
    Flag(
        ("--access_log_file",),
        "where the access log goes (default: standard error); reopened when it is moved "
        "or removed (logrotate), and on SIGHUP",
        default="",
    ),
    Flag(
        ("--api_docs",),
        "serve /docs (Swagger UI) and /redoc (ReDoc); their pages load scripts from a "
        "public CDN (/openapi.json is always served)",
        field="api_docs",
    ),
    Flag(
        ("--access_log_format",),
        "text (key=value) or json (JSON lines)",
        field="access_log_format",
        choices=("text", "json"),
    ),
    Flag(
        ("--log_level",),
        "server log level (info: versions loaded and unloaded; warning: failed requests "
        "with their cause)",
        default="info",
        choices=("debug", "info", "warning", "error", "critical"),
    ),
    # Admission and the response cache (estimax.serving.admission, .response_cache).
    Flag(
        ("--priority_levels",),
        "request priority levels (v2 parameters.priority: 1 the highest; 0 the default level); "
        "the default of models whose config gives no dynamic_batching.priority_levels",
        field="priority_levels",
    ),
    Flag(
        ("--default_priority_level",),
        "the level of a request that gives no priority (a model's "
        "dynamic_batching.default_priority_level wins)",
        field="default_priority_level",
    ),
    Flag(
        ("--priority_aging_ms",),
        "a waiting request rises one priority level per this many ms (low ones never starve); "
        "0: no aging",
        field="priority_aging_ms",
    ),
    Flag(
        ("--max_concurrent_per_model",),
        "run threads (--num_batch_threads) one model may hold at once, running or queued; "
        "a flooded model's other requests wait in its own queue. 0: no cap",
        field="max_concurrent_per_model",
    ),
    Flag(
        ("--response_cache_models",),
        "comma-separated models whose answers are cached (identical inputs, same version), "
        "unless a model's config (BASE_PATH/config.json, a load's override) sets "
        'response_cache.enable; a version declaring "random": true in serving.json is never '
        "cached",
        _names,
        field="response_cache_models",
    ),
    Flag(
        ("--response_cache_bytes",),
        "the response cache's bound for the whole server, in bytes (least recently used "
        "answers evicted)",
        field="response_cache_bytes",
    ),
)


def add_parser(sub: Any, env: Mapping[str, str]) -> None:
    """Adds ``serve`` (its flags' defaults from ``env`` under Vertex AI) to ``sub``."""
    serve = sub.add_parser(
        "serve",
        help="serve versions over HTTP (TF Serving, v2) and gRPC",
        formatter_class=Defaults,
    )
    for flag in FLAGS:
        kwargs: dict[str, Any] = {"default": flag.default_value(), "help": flag.help}
        kind = flag.value_type()
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind is not None and kind is not str:
            kwargs["type"] = kind
        if flag.choices:
            kwargs["choices"] = flag.choices
        serve.add_argument(*flag.names, dest=flag.dest, **kwargs)
    serve.add_argument(
        "--load_model",
        action="append",
        metavar="NAME",
        help="with --model_control_mode=explicit: load this model of the config at start "
        "(repeat it; '*': all) (default: none)",
    )
    _vertex_defaults(serve, env)


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


def _server_options(args: argparse.Namespace) -> ServerOptions:
    """The ``ServerOptions`` of ``serve``'s flags (ValueError naming a bad one)."""
    from estimax.serving.metrics import parse_monitoring_config

    fields: dict[str, dict[str, Any]] = {"": {}, "batching": {}, "limits": {}}
    for flag in FLAGS:
        if flag.field:
            group, _, name = flag.field.rpartition(".")
            fields[group][name] = flag.option_value(args)
    batching = BatchingOptions(**fields["batching"])
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
        **fields[""],
        batching=batching,
        limits=ConnectionLimits(**fields["limits"]),
        grpc_host=args.host,
        metrics_paths=(metrics_path,) if metrics_path else (),
        vertex_predict_route=args.vertex_predict_route,
        vertex_health_route=args.vertex_health_route,
        rest=args.port != 0,
    )
    options.limits.validate()
    options.validate()
    if options.warmup_iterations < 1:
        raise ValueError("--num_request_iterations_for_warmup must be >= 1")
    return options


def grpc_arguments(text: str) -> tuple[tuple[str, int | str], ...]:
    """``--grpc_channel_arguments``: ``name=value,...`` -> ``((name, value), ...)``, a value
    that is an integer as an int (TF Serving's rule); ValueError naming the flag if malformed."""
    pairs: list[tuple[str, int | str]] = []
    for item in text.split(","):
        if not item.strip():
            continue
        name, eq, value = item.strip().partition("=")
        if not eq or not name.strip():
            raise ValueError(
                f"--grpc_channel_arguments: {item.strip()!r} is not name=value "
                "(e.g. grpc.max_connection_age_ms=2000)"
            )
        value = value.strip()
        number = value[1:] if value[:1] in "+-" else value
        pairs.append((name.strip(), int(value) if number.isascii() and number.isdigit() else value))
    return tuple(pairs)


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

    from estimax.export.artifact import SIGNATURE_FILE

    fs, root = fsspec.core.url_to_fs(base)
    if fs.exists(f"{root.rstrip('/')}/{SIGNATURE_FILE}"):
        raise ValueError(
            f"{base} is one version's export, not a model base path: serve the folder that "
            "holds it as a numbered version (e.g. move it to BASE/1 and give BASE)"
        )


def escape_controls(text: str) -> str:
    """``text`` with each non-printable character (CR, LF, ESC...) written as ``repr`` would."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class OneLineFormatter(std_logging.Formatter):
    """A log line per record, whatever its message holds: control characters in the message
    (a model name from a config file or a gRPC request, a path) are escaped, so they cannot
    forge a log line (CR/LF) or drive a terminal (ESC). Tracebacks, formatted apart, keep their
    lines."""

    def formatMessage(self, record: std_logging.LogRecord) -> str:  # noqa: N802 - logging's
        """The record's line, its message escaped (``escape_controls``)."""
        if not record.message.isprintable():
            record = copy.copy(record)  # other handlers see the message as logged
            record.message = escape_controls(record.message)
        return super().formatMessage(record)


def _configure_logging(args: argparse.Namespace) -> std_logging.Handler:
    """The server's log (``--log_level``) and the access log (its own stream, bare lines).

    Returns the access log's handler. A file is written through a ``WatchedFileHandler``:
    moved or removed (``logrotate``'s default ``create``), it is reopened at the next line
    rather than written on unseen (``copytruncate`` needs nothing).
    """
    std_logging.basicConfig(level=args.log_level.upper(), force=True)
    for root_handler in std_logging.getLogger().handlers:
        root_handler.setFormatter(
            OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
    access = std_logging.getLogger("estimax.serving.access")
    access.propagate = False
    handler: std_logging.Handler = (
        WatchedFileHandler(args.access_log_file)  # OSError names the file
        if args.access_log_file
        else std_logging.StreamHandler(sys.stderr)
    )
    handler.setFormatter(std_logging.Formatter("%(message)s"))
    access.handlers[:] = [handler]
    access.setLevel(std_logging.INFO)
    if args.log_level != "debug":  # JAX's start-up notes (no TPU found...) are not the server's
        std_logging.getLogger("jax").setLevel(std_logging.WARNING)
    return handler


def _reopen_on_hangup(handler: std_logging.Handler) -> None:
    """SIGHUP reopens the access log (as nginx's USR1, logrotate's ``postrotate``) and never
    ends the server (Python's default for it: ended at once)."""

    def reopen() -> None:
        if isinstance(handler, WatchedFileHandler):
            # Under the handler's lock: a request's line may be being written.
            with handler.lock or contextlib.nullcontext():
                handler.reopenIfNeeded()
        std_logging.getLogger("estimax.serving").info(
            "SIGHUP: the access log is reopened%s; serving on",
            f" ({handler.baseFilename})" if isinstance(handler, WatchedFileHandler) else "",
        )

    def hangup(signum: int, frame: Any) -> None:
        # Not in the handler itself: the signal may land while this thread holds the log's
        # lock in the middle of a line.
        threading.Thread(target=reopen, name="sighup", daemon=True).start()

    signal.signal(signal.SIGHUP, hangup)


def serve(args: argparse.Namespace) -> int:
    """Runs the server until interrupted."""
    from estimax.export.servable import default_batch_sizes
    from estimax.export.versions import list_versions
    from estimax.serving import memory, registry
    from estimax.serving.control import ModelControl
    from estimax.serving.manager import ModelManager
    from estimax.serving.server import Server

    memory.keep_freed_memory()  # a served model's buffers are reused, not faulted anew (memory.py)
    _check_vertex(args)
    configs = _model_configs(args)
    mode, loaded, poll_seconds = _control_mode(args, configs)
    options = _server_options(args)
    if not args.version_load_timeout_seconds > 0:
        raise ValueError("--version_load_timeout_seconds must be > 0")
    # The flags' names in messages: tensorflow_model_server names the ports as TF Serving does.
    http_flag, grpc_flag = getattr(args, "port_flags", ("--port", "--grpc_port"))
    if not args.port and not args.grpc_port:
        raise ValueError(f"{http_flag}=0 and {grpc_flag}=0: nothing would be served")
    for flag, port in ((http_flag, args.port), (grpc_flag, args.grpc_port)):
        if port:  # 0: that port is off
            _check_port(flag, args.host, port)
    if args.grpc_port and args.grpc_port == args.port:
        raise ValueError(f"{grpc_flag}={args.grpc_port} is also {http_flag}; give two ports")
    for config in configs:
        try:
            versions = list_versions(config.base_path)  # fails early, naming the path
        except FileNotFoundError:
            if not args.model_config_file:
                raise  # the one model asked for: nothing would be served
            # One model of several whose folder is missing does not stop the others: it waits
            # for versions (its manager logs why; the v2 repository index says it), as an empty
            # one does, and requests to it answer 404 (TF Serving's way for an empty one).
            continue
        if not versions:
            _refuse_one_version(config.base_path)
    access_handler = _configure_logging(args)
    options = _fit_connections(options, ports=2 if args.grpc_port else 1)
    batching = options.batching
    sizes = list(batching.allowed_batch_sizes) or default_batch_sizes(batching.max_batch_size)

    def make_manager(config: registry.ModelConfig) -> ModelManager:
        return ModelManager(
            config.name,
            config.base_path,
            sizes,
            poll_wait_seconds=args.file_system_poll_wait_seconds,
            load_timeout_s=args.version_load_timeout_seconds,
            policy=config.policy,
        )

    server = Server([], options)
    models = registry.ModelRegistry(
        server.core, make_manager, args.allow_version_labels_for_unavailable_models
    )
    control = ModelControl(models, configs, mode, args.unload_drain_secs)
    # Loads and warms every model's versions before the ports open; a label refused here is
    # one line and no server (as TF Serving).
    models.apply(loaded)
    server.core.control = control
    server.core.reload_config = control.reload_config
    if poll_seconds > 0:
        poller = registry.ConfigPoller(args.model_config_file, models, poll_seconds)
        poller.start()
        server.on_stop.append(poller.stop)
    configs = loaded
    names = ", ".join(repr(c.name) for c in configs) or "none yet (--model_control_mode=explicit)"
    where = args.model_config_file or args.model_base_path
    print(
        f"Serving model{'s' if len(configs) > 1 else ''} {names} from {where} on "
        + (
            f"http://{args.host}:{args.port} (REST: /v1/models/NAME, v2: /v2/models/NAME)"
            if args.port
            else "no HTTP port"
        )
        + (f"; gRPC on {args.host}:{args.grpc_port}" if args.grpc_port else "")
        + (f"; metrics on {', '.join(options.metrics_paths)}" if options.metrics_paths else "")
        + (f"; Vertex AI: {args.vertex_predict_route}" if args.vertex_predict_route else ""),
        flush=True,
    )
    _reopen_on_hangup(access_handler)
    if args.port:
        server.run(args.host, args.port, args.log_level)
    else:
        server.run_grpc_only()
    return 0


def _control_mode(args: argparse.Namespace, configs: list[Any]) -> tuple[str, list[Any], float]:
    """``--model_control_mode``: the mode, the models to load at start, and how often the
    config file is polled (0: never); ValueError naming the flag that does not fit."""
    mode = getattr(args, "model_control_mode", "none")
    wanted = getattr(args, "load_model", None) or []
    poll = args.model_config_file_poll_wait_seconds if args.model_config_file else 0.0
    if not getattr(args, "unload_drain_secs", 30.0) >= 0:
        raise ValueError("--unload_drain_secs must be >= 0")
    if mode != "explicit":
        if wanted:
            raise ValueError("--load_model needs --model_control_mode=explicit")
        if mode == "poll" and args.model_config_file and poll <= 0:
            poll = (
                args.file_system_poll_wait_seconds
                if args.file_system_poll_wait_seconds > 0
                else 1.0
            )
        return mode, configs, poll
    if poll > 0:
        raise ValueError(
            "--model_config_file_poll_wait_seconds with --model_control_mode=explicit: a poll "
            "would undo the load and unload calls; give --model_control_mode=poll to watch "
            "the file, or no poll"
        )
    from estimax.serving.registry import check_name

    names = {c.name for c in configs}
    for name in wanted:
        if name != "*":
            check_name(name, "--load_model")
    unknown = [n for n in wanted if n != "*" and n not in names]
    if unknown:
        raise ValueError(
            f"--load_model={unknown[0]}: no such model in "
            f"{args.model_config_file or '--model_name'} (it has {', '.join(sorted(names))})"
        )
    loaded = configs if "*" in wanted else [c for c in configs if c.name in wanted]
    return mode, loaded, 0.0


def _model_configs(args: argparse.Namespace) -> list[Any]:
    """The models to serve: ``--model_config_file``'s, or ``--model_base_path``'s one."""
    from estimax.serving import registry
    from estimax.serving.manager import VersionPolicy

    if args.model_config_file:
        configs = registry.read_config(args.model_config_file)
        if not configs:
            raise ValueError(
                f"--model_config_file={args.model_config_file}: no model (give "
                "model_config_list { config { name: ... base_path: ... } })"
            )
        return configs
    if args.model_config_file_poll_wait_seconds:
        raise ValueError("--model_config_file_poll_wait_seconds needs --model_config_file")
    if not args.model_base_path:
        raise ValueError(
            "--model_base_path is required (or AIP_STORAGE_URI with AIP_MODE=PREDICTION; or "
            "--model_config_file for several models)"
        )
    if args.num_versions < 1:
        raise ValueError("--num_versions must be >= 1")
    registry.check_name(args.model_name, "--model_name")
    return [
        registry.ModelConfig(
            args.model_name, args.model_base_path, VersionPolicy("latest", args.num_versions)
        )
    ]


def _fit_connections(options: ServerOptions, ports: int) -> ServerOptions:
    """``options`` with ``--max_connections`` lowered to fit the open-file limit (logged)."""
    from estimax.serving import transport

    fitted, why = transport.fitted_max_connections(options.limits.max_connections, ports)
    if why:
        std_logging.getLogger("estimax.serving.transport").warning(why)
    limits = dataclasses.replace(options.limits, max_connections=fitted)
    return dataclasses.replace(options, limits=limits)


# What ``estimax.command`` runs for each subcommand added here.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"serve": serve}
