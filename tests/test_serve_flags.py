"""``estimax serve``'s flags come from one table (``estimax.serving.cli.FLAGS``) that names the
``ServerOptions`` field each one sets; its defaults are the dataclass's."""

from __future__ import annotations

import argparse
import dataclasses

from estimax.serving import cli
from estimax.serving.options import ServerOptions

# ServerOptions fields set from flags that are not theirs alone (serve's address and port, the
# metrics path or monitoring config, Vertex AI's variables), or groups of fields.
DERIVED = {"grpc_host", "rest", "metrics_paths", "vertex_predict_route", "vertex_health_route"}


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"), {})
    return parser.parse_args(["serve", *argv])


def _fields(options: object, prefix: str = "") -> set[str]:
    names = set()
    for f in dataclasses.fields(options):  # type: ignore[arg-type]
        value = getattr(options, f.name)
        if dataclasses.is_dataclass(value):
            names |= _fields(value, f"{f.name}.")
        else:
            names.add(prefix + f.name)
    return names


def test_every_option_has_one_flag_and_the_defaults_are_the_dataclass_s():
    flagged = [f.field for f in cli.FLAGS if f.field]
    assert len(flagged) == len(set(flagged))
    assert set(flagged) | DERIVED == _fields(ServerOptions())
    assert cli._server_options(_parse()) == ServerOptions()


def test_each_flag_sets_its_field():
    given = {
        "--grpc_port": ("8500", 8500),
        "--rest_api_timeout_ms": ("7", 7),
        "--no-enable_model_warmup": (None, False),
        "--num_request_iterations_for_warmup": ("3", 3),
        "--enable_batching": (None, True),
        "--max_batch_size": ("8", 8),
        "--allowed_batch_sizes": ("2,32", (2, 32)),
        "--rest_api_header_timeout_in_ms": ("1500", 1.5),
        "--max_header_bytes": ("9000", 9000),
        "--grpc_max_threads": ("4", 4),
        "--grpc_channel_arguments": ("grpc.a=1,grpc.b=x", (("grpc.a", 1), ("grpc.b", "x"))),
        "--rest_api_num_threads": ("1", 1),
        "--no-access_log": (None, False),
        "--access_log_format": ("json", "json"),
        "--readiness": ("any", "any"),
    }
    by_name = {n: f for f in cli.FLAGS for n in f.names}
    for name, (text, want) in given.items():
        flag = by_name[name.replace("--no-", "--")]
        options = cli._server_options(_parse(name if text is None else f"{name}={text}"))
        value: object = options
        for part in flag.field.split("."):
            value = getattr(value, part)
        assert value == want, name
