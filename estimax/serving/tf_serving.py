"""``tensorflow_model_server``: ``estimax serve`` under TF Serving's flags, meanings and defaults.

    tensorflow_model_server --port=8500 --rest_api_port=8501 \\
        --model_name=NAME --model_base_path=/models/NAME

A drop-in for the command line of TF Serving's ``tensorflow_model_server`` (KServe's stock
TensorFlow runtime, Docker images' entry points, launch scripts): ``--port`` is the gRPC port
(default 8500), ``--rest_api_port`` the HTTP port (default 0: no HTTP), and both bind every
interface (0.0.0.0), as TF Serving does. ``estimax serve`` keeps its own flags and defaults
(loopback only; ``--port`` the HTTP port).

Each TF Serving flag is either honoured (mapped to ``estimax serve``'s option of the same
meaning: ``--grpc_max_threads`` bounds the gRPC calls in progress as TF Serving's thread quota
does), accepted with one WARNING line naming it and why it has no meaning here (a knob of
TensorFlow's own runtime that changes no answer: ``--tensorflow_session_parallelism``...), or
refused in one line (a flag whose meaning estimax cannot keep: ``--ssl_config_file`` would
serve plaintext). A flag TF
Serving does not have is refused in one line naming it. Refusals exit 2. Flags are
``--name=value`` (or ``--name value``); booleans also ``--name`` and ``--name=true|false``.

``--model_config_file`` (a text ``ModelServerConfig``: ``model_config_list { config { name,
base_path, model_platform, model_version_policy, version_labels } }``) serves several models,
re-read every ``--model_config_file_poll_wait_seconds`` (``estimax.serving.registry``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from estimax.version import __version__

PROG = "tensorflow_model_server"
EXIT_USAGE = 2

log = logging.getLogger("estimax.serving.tf_serving")


class FlagError(ValueError):
    """A flag refused (its one line)."""


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


# Flags honoured: name -> (type, TF Serving's default, help).
HONOURED: dict[str, tuple[Any, Any, str]] = {
    "port": (int, 8500, "gRPC port (0: no gRPC)"),
    "rest_api_port": (int, 0, "HTTP port: TF Serving REST and v2 (0: no HTTP)"),
    "model_name": (str, "default", "the model's name"),
    "model_base_path": (str, "", "the folder of numeric versions"),
    "model_config_file": (str, "", "text ModelServerConfig: the models to serve"),
    "model_config_file_poll_wait_seconds": (int, 0, "re-read the config this often (0: once)"),
    "allow_version_labels_for_unavailable_models": (
        _bool,
        False,
        "a new version label may name a version not loaded yet",
    ),
    "monitoring_config_file": (str, "", "text MonitoringConfig (Prometheus path)"),
    "enable_batching": (_bool, False, "merge concurrent requests into batches"),
    "batching_parameters_file": (str, "", "text BatchingParameters"),
    "rest_api_timeout_in_ms": (int, 30_000, "a request taking longer fails"),
    "file_system_poll_wait_seconds": (int, 1, "poll for new versions this often (0: once)"),
    "enable_model_warmup": (_bool, True, "replay assets.extra/tf_serving_warmup_requests"),
    "num_request_iterations_for_warmup": (int, 1, "replay each warm-up record this often"),
    "enable_grpc_healthcheck_service": (_bool, True, "grpc.health.v1.Health: always served"),
    # TF Serving's defaults for these two (4 x the cores) cap its threads; estimax's gRPC
    # calls and REST requests need no thread each, so no bound and its own 2 unless given.
    "grpc_max_threads": (
        int,
        0,
        "gRPC calls in progress at once; past it RESOURCE_EXHAUSTED (0: no bound)",
    ),
    "rest_api_num_threads": (
        int,
        0,
        "processes parsing large HTTP bodies, at most one per core (0: estimax's 2)",
    ),
    "grpc_channel_arguments": (str, "", "gRPC server arguments: name=value,..."),
    "per_process_gpu_memory_fraction": (
        float,
        0.0,
        "the fraction of GPU memory taken (JAX's XLA_PYTHON_CLIENT_MEM_FRACTION; 0: JAX's)",
    ),
}

# Flags accepted with one WARNING line when given: they tune TensorFlow's own runtime, its
# loading threads or its file system, which estimax does not have, and change no answer
# (docs/serving.md lists them with the reason for each).
_SESSION = "TensorFlow's session threads (estimax runs XLA, not a TensorFlow session)"
_SAVED_MODEL = "how TensorFlow loads a SavedModel (estimax serves its own exports)"
IGNORED: dict[str, str] = {
    "tensorflow_session_parallelism": _SESSION,
    "tensorflow_intra_op_parallelism": _SESSION,
    "tensorflow_inter_op_parallelism": _SESSION,
    "tensorflow_session_config_file": _SESSION,
    "thread_pool_factory_config_file": _SESSION,
    "num_load_threads": "estimax loads one version at a time per model, each bounded by "
    "estimax serve's --version_load_timeout_seconds",
    "num_unload_threads": "a version is unloaded once its requests end, in its own thread",
    "max_num_load_retries": "a version that failed to load is tried again when its files "
    "change, not on a timer",
    "load_retry_interval_micros": "a version that failed to load is tried again when its "
    "files change, not on a timer",
    "flush_filesystem_caches": "estimax keeps no file-system cache to flush",
    "xla_cpu_compilation_enabled": "XLA always compiles estimax's exports",
    "enable_profiler": "TensorFlow's profiler service",
    "remove_unused_fields_from_bundle_metagraph": _SAVED_MODEL,
    "enable_signature_method_name_check": _SAVED_MODEL,
    "saved_model_tags": _SAVED_MODEL,
    "skip_initialize_tpu": "JAX initialises a TPU itself",
    "enable_per_model_batching_parameters": "every model is batched with the flags' "
    "parameters (--batching_parameters_file)",
    "num_tflite_pools": "TFLite models are not served",
    "num_tflite_interpreters_per_pool": "TFLite models are not served",
}

# Flags refused when set (to anything but their harmless value, given here): estimax would
# answer differently from what they ask.
REFUSED: dict[str, tuple[Any, str]] = {
    "ssl_config_file": ("", "TLS is not served by estimax (terminate TLS in front of it)"),
    "use_alts_credentials": (False, "ALTS credentials are not supported"),
    "grpc_socket_path": ("", "gRPC on a UNIX socket is not supported"),
    "platform_config_file": ("", "estimax serves its own exports, not TF platforms"),
    "rest_api_enable_cors_support": (False, "CORS headers are not sent"),
    "prefer_tflite_model": (False, "TFLite models are not served"),
    "use_tflite_model": (False, "TFLite models are not served"),
    "mixed_precision": ("", "the export's precision is served as exported"),
}

_BOOLS = {
    "enable_batching",
    "enable_model_warmup",
    "enable_grpc_healthcheck_service",
    "use_alts_credentials",
    "rest_api_enable_cors_support",
    "prefer_tflite_model",
    "use_tflite_model",
    "flush_filesystem_caches",
    "xla_cpu_compilation_enabled",
    "enable_profiler",
    "remove_unused_fields_from_bundle_metagraph",
    "enable_signature_method_name_check",
    "skip_initialize_tpu",
    "allow_version_labels_for_unavailable_models",
    "enable_per_model_batching_parameters",
}


def _split(argv: Sequence[str]) -> dict[str, str]:
    """``--name=value`` / ``--name value`` / ``--name`` (booleans) -> {name: text}."""
    known = set(HONOURED) | set(IGNORED) | set(REFUSED)
    given: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("-") or arg in ("-", "--"):
            raise FlagError(f"unexpected argument {arg!r} (flags are --name=value)")
        name, eq, value = arg.lstrip("-").partition("=")
        if name not in known:
            raise FlagError(f"unknown flag --{name}: not a TF Serving flag (see --help)")
        if not eq:
            if name in _BOOLS:
                value = "true"
            elif name.startswith("no") and name[2:] in _BOOLS:
                name, value = name[2:], "false"
            elif i < len(argv):
                value = argv[i]
                i += 1
            else:
                raise FlagError(f"--{name} needs a value (--{name}=VALUE)")
        given[name] = value
    return given


def _typed(name: str, text: str) -> Any:
    if name in _BOOLS:
        kind: Any = _bool
    elif name in HONOURED:
        kind = HONOURED[name][0]
    elif name in REFUSED:
        kind = type(REFUSED[name][0])
    else:
        return text
    try:
        return kind(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise FlagError(f"--{name}={text}: not a valid {getattr(kind, '__name__', kind)}") from None


def _usage() -> str:
    lines = [
        f"usage: {PROG} --port=8500 --rest_api_port=8501 --model_name=NAME --model_base_path=DIR",
        "",
        "TF Serving's flags (estimax serve under TF Serving's meanings and defaults):",
    ]
    for name, (_, default, text) in HONOURED.items():
        lines.append(f"  --{name} (default {default!r}): {text}")
    lines.append("Accepted with a warning (no effect): " + ", ".join(f"--{n}" for n in IGNORED))
    lines.append("Refused when set: " + ", ".join(f"--{n}" for n in REFUSED))
    return "\n".join(lines)


def _serve_defaults() -> argparse.Namespace:
    """``estimax serve``'s defaults (not Vertex AI's: this is TF Serving's command line)."""
    from estimax.serving import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"), {})
    return parser.parse_args(["serve"])


def translate(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """TF Serving's command line -> (``estimax serve``'s arguments, warnings to log).

    Raises FlagError (one line) for a flag refused or unknown, or a bad value or file.
    """
    given = {name: _typed(name, text) for name, text in _split(argv).items()}
    warnings: list[str] = []
    for name, value in given.items():
        if name in REFUSED and value != REFUSED[name][0]:
            raise FlagError(f"--{name}={argv_value(value)} is not supported: {REFUSED[name][1]}")
        if name in IGNORED:
            warnings.append(f"--{name} has no meaning in estimax ({IGNORED[name]}); ignored")
    flags = {name: given.get(name, default) for name, (_, default, _) in HONOURED.items()}
    args = _serve_defaults()
    args.host = "0.0.0.0"  # TF Serving binds every interface, gRPC and REST
    args.port = flags["rest_api_port"]
    args.grpc_port = flags["port"]
    args.port_flags = ("--rest_api_port", "--port")
    args.model_name = flags["model_name"]
    args.model_base_path = flags["model_base_path"] or None
    args.rest_api_timeout_in_ms = flags["rest_api_timeout_in_ms"]
    args.file_system_poll_wait_seconds = float(flags["file_system_poll_wait_seconds"])
    args.monitoring_config_file = flags["monitoring_config_file"]
    args.enable_batching = flags["enable_batching"]
    args.enable_model_warmup = flags["enable_model_warmup"]
    args.num_request_iterations_for_warmup = flags["num_request_iterations_for_warmup"]
    args.allow_version_labels_for_unavailable_models = flags[
        "allow_version_labels_for_unavailable_models"
    ]
    args.grpc_max_threads = flags["grpc_max_threads"]
    args.rest_api_num_threads = flags["rest_api_num_threads"]
    args.grpc_channel_arguments = flags["grpc_channel_arguments"]
    fraction = flags["per_process_gpu_memory_fraction"]
    if not 0.0 <= fraction <= 1.0:
        raise FlagError(f"--per_process_gpu_memory_fraction={fraction} is not between 0 and 1")
    # Read by JAX when it makes its GPU client (at the first load): set before serving.
    args.environment = {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{fraction:g}"} if fraction else {}
    if flags["model_config_file_poll_wait_seconds"] < 0:
        raise FlagError("--model_config_file_poll_wait_seconds must be >= 0")
    if flags["model_config_file"]:
        if "model_base_path" in given or "model_name" in given:
            warnings.append(
                "--model_config_file is given: --model_name and --model_base_path are not used "
                "(as in TF Serving)"
            )
        args.model_config_file = flags["model_config_file"]
        args.model_config_file_poll_wait_seconds = float(
            flags["model_config_file_poll_wait_seconds"]
        )
    elif flags["model_config_file_poll_wait_seconds"]:
        warnings.append(
            "--model_config_file_poll_wait_seconds is given without --model_config_file: not used"
        )
    if flags["batching_parameters_file"]:
        if not flags["enable_batching"]:
            warnings.append(
                "--batching_parameters_file is given without --enable_batching: not used"
            )
        else:
            warnings += batching_parameters(flags["batching_parameters_file"], args)
    return args, warnings


def argv_value(value: Any) -> str:
    """A flag's value as written on a command line."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _batching_parameters_class() -> Any:
    """TF Serving's ``BatchingParameters`` message (session_bundle_config.proto), built here:
    its .proto imports TensorFlow's session config, which estimax does not carry."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, wrappers_pb2

    fields = descriptor_pb2.FieldDescriptorProto
    wrappers = descriptor_pb2.FileDescriptorProto()
    wrappers_pb2.DESCRIPTOR.CopyToProto(wrappers)
    file = descriptor_pb2.FileDescriptorProto(
        name="estimax_batching_parameters.proto",
        package="tensorflow.serving",
        syntax="proto3",
        dependency=[wrappers.name],
    )
    message = file.message_type.add(name="BatchingParameters")
    for number, (name, kind) in enumerate(
        (
            ("max_batch_size", "Int64Value"),
            ("batch_timeout_micros", "Int64Value"),
            ("max_enqueued_batches", "Int64Value"),
            ("num_batch_threads", "Int64Value"),
            ("thread_pool_name", "StringValue"),
            ("allowed_batch_sizes", "int64"),
            ("pad_variable_length_inputs", "bool"),
            ("enable_large_batch_splitting", "BoolValue"),
            ("max_execution_batch_size", "Int64Value"),
            ("batch_padding_policy", "StringValue"),
        ),
        start=1,
    ):
        field = message.field.add(name=name, number=number)
        if kind == "int64":
            field.type, field.label = fields.TYPE_INT64, fields.LABEL_REPEATED
        elif kind == "bool":
            field.type, field.label = fields.TYPE_BOOL, fields.LABEL_OPTIONAL
        else:
            field.type, field.label = fields.TYPE_MESSAGE, fields.LABEL_OPTIONAL
            field.type_name = f".google.protobuf.{kind}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(wrappers)
    pool.Add(file)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("tensorflow.serving.BatchingParameters")
    )


def batching_parameters(path: str, args: argparse.Namespace) -> list[str]:
    """``--batching_parameters_file`` into ``args``' batching flags; returns warnings."""
    from google.protobuf import text_format

    flag = f"--batching_parameters_file={path}"
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise FlagError(f"{flag}: cannot read it: {e.strerror}") from None
    try:
        params = text_format.Parse(text, _batching_parameters_class()())
    except text_format.ParseError as e:
        raise FlagError(f"{flag}: not a BatchingParameters estimax reads ({e})") from None
    for name in ("max_batch_size", "batch_timeout_micros", "max_enqueued_batches"):
        if params.HasField(name):
            setattr(args, name, int(getattr(params, name).value))
    if params.HasField("num_batch_threads"):
        args.num_batch_threads = int(params.num_batch_threads.value)
    if params.allowed_batch_sizes:
        args.allowed_batch_sizes = tuple(int(n) for n in params.allowed_batch_sizes)
    return [
        f"{flag}: {name} is not used by estimax; ignored"
        for name in (
            "thread_pool_name",
            "enable_large_batch_splitting",
            "max_execution_batch_size",
            "batch_padding_policy",
        )
        if params.HasField(name)
    ] + (
        [f"{flag}: pad_variable_length_inputs is not used by estimax; ignored"]
        if params.pad_variable_length_inputs
        else []
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the server; one line and exit 2 for a refused flag or a bad path."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("--help", "-h", "--helpfull") for a in argv):
        print(_usage())
        return 0
    if "--version" in argv:
        print(f"{PROG} (estimax {__version__})")
        return 0
    try:
        args, warnings = translate(argv)
        from estimax.serving import cli

        for line in warnings:
            print(f"{PROG}: WARNING: {line}", file=sys.stderr, flush=True)
        os.environ.update(args.environment)
        return cli.serve(args)
    except (FlagError, OSError, ValueError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return EXIT_USAGE


def run() -> None:
    """The ``tensorflow_model_server`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    run()
