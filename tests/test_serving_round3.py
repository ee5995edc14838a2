"""Hostile configs and environments, round three (issue #54, serving causes 1-4, 6, 7, 10 and
the warm-up CRCs): each cause fails here without its fix.

In process, on the piece that was wrong (the registry, the warm-up reader, the core's deadline
and readiness, the config reader): versions are loaded by a stand-in loader, as a server would
only add time. The process boundary is tested where it is what matters (one line and exit 2 at
start).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import struct
import threading
import tracemalloc
import types

import pytest
from google.protobuf import text_format

from estimax import command
from estimax.export import artifact
from estimax.serving import cli, registry, warmup
from estimax.serving.core import ApiError, ServingCore
from estimax.serving.manager import ModelManager
from estimax.serving.options import ServerOptions
from estimax.serving.protos.tensorflow_serving.config import model_server_config_pb2

NAME = "m"


# ----------------------------------------------------------------------------- helpers
class _Servable:
    """What the manager needs of a loaded version: no model, nothing compiled."""

    def __init__(self, path: str):
        self.path = path
        self.model = types.SimpleNamespace(close=lambda: None)

    def warm(self) -> None:
        pass

    def retire(self) -> None:
        pass


def _base(root, name: str, versions=(1,)) -> str:
    """A model base path whose versions the manager lists (their signature file)."""
    base = root / name
    for v in versions:
        (base / str(v)).mkdir(parents=True)
        (base / str(v) / artifact.SIGNATURE_FILE).write_text("{}")
    return str(base)


def _registry(load, options: ServerOptions | None = None):
    core = ServingCore([], options or ServerOptions())

    def make(config: registry.ModelConfig) -> ModelManager:
        return ModelManager(
            config.name, config.base_path, [1], poll_wait_seconds=0, load=load, policy=config.policy
        )

    return core, registry.ModelRegistry(core, make)


def _config_text(models: dict[str, str]) -> str:
    body = "".join(f'config {{ name: "{n}" base_path: "{p}" }} ' for n, p in models.items())
    return f"model_config_list {{ {body}}}"


# ----------------------------------------------------------------------------- cause 1
def test_a_new_base_path_loads_while_the_old_serves_and_a_bad_one_keeps_the_old(tmp_path):
    """The model was removed before its new path loaded (404 meanwhile), and a missing new path
    left it down for good."""
    old, new = _base(tmp_path, "old"), _base(tmp_path, "new")
    broken = _base(tmp_path, "broken")
    seen_while_loading = []

    def load(path, version, sizes):
        if path.startswith(broken):
            raise ValueError("damaged variables")
        if path.startswith(new):  # what a request finds while the new path loads
            model = core.models.get(NAME)
            seen_while_loading.append(model and model.manager.get())
        return _Servable(path)

    core, models = _registry(load)
    models.apply([registry.ModelConfig(NAME, old)])
    first = core.models[NAME].manager.get()
    assert first is not None and first.path.startswith(old)

    for bad, why in ((str(tmp_path / "absent"), "does not exist"), (broken, "damaged variables")):
        with pytest.raises(registry.ConfigError) as e:
            models.apply([registry.ModelConfig(NAME, bad)])
        assert why in str(e.value) and f"still serving model {NAME!r} from {old}" in str(e.value)
        assert core.models[NAME].manager.get() is first  # served on, untouched
        assert models.configs[NAME].base_path == old  # tried again at the next apply

    models.apply([registry.ModelConfig(NAME, new)])
    assert seen_while_loading == [first]  # the old version answered during the new one's load
    assert core.models[NAME].manager.get().path.startswith(new)
    assert models.configs[NAME].base_path == new
    assert core.ready(NAME, None)


def test_the_config_poller_reports_a_bad_new_base_path_and_retries_it(tmp_path, caplog):
    old = _base(tmp_path, "old")
    core, models = _registry(lambda path, version, sizes: _Servable(path))
    path = tmp_path / "models.config"
    path.write_text(_config_text({NAME: old}))
    poller = registry.ConfigPoller(str(path), models, 60)
    models.apply(registry.read_config(str(path)))
    late = str(tmp_path / "late")
    path.write_text(_config_text({NAME: late}))
    with caplog.at_level(logging.ERROR, "estimax.serving.registry"):
        poller.poll()
        poller.poll()  # once per distinct error
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lines) == 1 and late in lines[0] and "still serving" in lines[0], lines
    assert core.models[NAME].manager.get().path.startswith(old)
    _base(tmp_path, "late")  # the path appears: the next poll serves it
    poller.poll()
    assert core.models[NAME].manager.get().path.startswith(late)


# ----------------------------------------------------------------------------- cause 2 + CRCs
def _framed(records: list[bytes], path) -> None:
    warmup.write_records(str(path), records)


def test_a_huge_sparse_warmup_file_is_refused_without_reading_it(tmp_path):
    """A 3 GiB sparse warm-up file was read whole into memory (peak +3 GiB)."""
    path = tmp_path / "tf_serving_warmup_requests"
    _framed([b"x" * 10], path)
    os.truncate(path, 3 << 30)  # sparse: takes no disk
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="bytes of warm-up records") as e:
            warmup.read_records(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # streamed and bounded: not the file
    assert str(path) in str(e.value)


def test_warmup_records_are_streamed_with_a_bound_per_record(tmp_path):
    """A record declaring more than the bound is refused before its data is read, and the
    file is read one record at a time (a file under the byte bound is not read whole)."""
    path = tmp_path / "records"
    _framed([b"a" * 100, b"b" * 100], path)
    length = struct.pack("<Q", 512 << 20)
    with open(path, "ab") as f:  # a third record declaring 512 MiB, then a sparse hole
        f.write(length + struct.pack("<I", warmup.masked_crc32c(length)))
    os.truncate(path, 600 << 20)
    records = warmup.iter_records(str(path), max_record_bytes=1 << 20)
    tracemalloc.start()
    try:
        assert next(records) == b"a" * 100 and next(records) == b"b" * 100
        with pytest.raises(ValueError, match=r"record 2: 536870912 bytes declared"):
            next(records)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


@pytest.mark.parametrize(
    ("where", "why"), [(8, "length CRC"), (12 + 3, "data CRC"), (-1, "data CRC")]
)
def test_warmup_records_with_a_bad_crc_are_refused_naming_the_record(tmp_path, where, why):
    """TF Serving's RecordReader checks both CRCs: a flipped bit fails the version's load."""
    path = tmp_path / "records"
    _framed([b"first record", b"second record"], path)
    data = bytearray(path.read_bytes())
    second = 16 + len(b"first record")
    data[second + where if where >= 0 else where] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError) as e:
        warmup.read_records(str(path))
    assert str(e.value) == f"{path}: record 1: corrupted record ({why})"


def test_a_warmup_file_with_a_bad_crc_fails_the_version(tmp_path):
    version = tmp_path / "1"
    (version / warmup.WARMUP_DIR).mkdir(parents=True)
    path = version / warmup.WARMUP_DIR / warmup.WARMUP_FILE
    _framed([b"\x32\x00"], path)  # predict_log {}, then its data CRC flipped
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    limits = types.SimpleNamespace(options=ServerOptions())
    with pytest.raises(ValueError, match=r"record 0: corrupted record \(data CRC\)") as e:
        warmup.replay(_Servable(str(version)), str(version), limits)  # type: ignore[arg-type]
    assert str(path) in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- cause 3
def test_readiness_any_keeps_the_server_ready_with_one_broken_model(tmp_path):
    """One broken model made gRPC health "" NOT_SERVING and /v2/health/ready 503."""
    good = ModelManager("good", _base(tmp_path, "good"), [1], load=lambda p, v, s: _Servable(p))
    good.poll()
    broken = ModelManager("broken", str(tmp_path / "absent"), [1])
    broken.poll()
    assert not ServingCore([good, broken], ServerOptions()).ready_all()  # TF Serving's default
    core = ServingCore([good, broken], ServerOptions(readiness="any"))
    assert core.ready_all()
    assert core.ready("good", None) and not core.ready("broken", None)  # per model: its own
    assert not ServingCore([broken], ServerOptions(readiness="any")).ready_all()
    with pytest.raises(ValueError, match="--readiness='most'"):
        ServingCore([], ServerOptions(readiness="most"))


def test_the_readiness_flag_sets_its_option():
    parser = cli.argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"), {})
    args = parser.parse_args(["serve", "--readiness=any"])
    assert cli._server_options(args).readiness == "any"
    assert cli._server_options(parser.parse_args(["serve"])).readiness == "all"


# ----------------------------------------------------------------------------- cause 4
@pytest.mark.parametrize("timeout_ms", [0, -1])
def test_a_non_positive_rest_api_timeout_means_no_deadline(timeout_ms):
    """Every predict answered 504 (a deadline already past) while ready said 200."""
    core = ServingCore([], ServerOptions(rest_api_timeout_in_ms=timeout_ms))

    async def run(*args):
        await asyncio.sleep(0)  # yields to the loop, where a past deadline would cancel it
        return {"y": 1}

    core._prepare_and_run = run  # type: ignore[method-assign]
    assert asyncio.run(core.infer(None, {})) == {"y": 1}  # type: ignore[arg-type]
    core.options.rest_api_timeout_in_ms = 1  # a positive one still bounds it
    core._prepare_and_run = lambda *a: asyncio.sleep(3600)  # type: ignore[method-assign]
    with pytest.raises(ApiError, match="timed out after 1 ms"):
        asyncio.run(core.infer(None, {}))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- cause 6
def _bounded(fn, *args):
    """``fn(*args)`` in a thread, joined with a bound: a read that blocks fails the test
    instead of hanging the suite."""
    out: list = []

    def call():
        try:
            out.append(fn(*args))
        except Exception as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(60)
    assert out, f"{fn.__name__} blocked"
    return out[0]


def test_a_config_file_that_is_not_a_regular_file_is_refused_unread(tmp_path):
    """A FIFO blocked the server (or its poller) for ever; /dev/zero read to MemoryError."""
    fifo = tmp_path / "fifo.config"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.config"
    zero.symlink_to("/dev/zero")
    for path in (fifo, zero, tmp_path):
        error = _bounded(registry.read_config, str(path))
        assert isinstance(error, registry.ConfigError), error
        assert "not a regular file" in str(error) and str(path) in str(error)
    big = tmp_path / "big.config"
    big.write_text(_config_text({NAME: "/m"}) + " " * 100)
    with pytest.raises(registry.ConfigError, match="larger than 64 bytes"):
        registry.read_config(str(big), max_bytes=64)


def test_the_poller_keeps_the_config_when_the_file_becomes_a_fifo(tmp_path, caplog):
    old = _base(tmp_path, "old")
    core, models = _registry(lambda path, version, sizes: _Servable(path))
    path = tmp_path / "models.config"
    path.write_text(_config_text({NAME: old}))
    models.apply(registry.read_config(str(path)))
    path.unlink()
    os.mkfifo(path)
    with caplog.at_level(logging.ERROR, "estimax.serving.registry"):
        assert _bounded(registry.ConfigPoller(str(path), models, 60).poll) is None
    assert any("not a regular file" in r.getMessage() for r in caplog.records)
    assert list(core.models) == [NAME] and core.ready(NAME, None)


def test_serve_refuses_a_fifo_config_in_one_line(tmp_path, capsys):
    fifo = tmp_path / "fifo.config"
    os.mkfifo(fifo)
    argv = ["serve", f"--model_config_file={fifo}", "--port=0"]
    assert _bounded(command.main, argv, {}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a regular file" in err[0] and str(fifo) in err[0], err


# ----------------------------------------------------------------------------- cause 7
FORGED = "\r\n2026-01-01 00:00:00,000 INFO estimax.serving.manager: FORGED"


@pytest.mark.parametrize("name", ["a" + FORGED, "a\x1b[31mred", "a\rb", "a\x00b", "a\u2028b"])
def test_model_names_with_control_characters_are_refused(tmp_path, name):
    """CR/LF or ESC in a name forged the server's log lines."""
    config = model_server_config_pb2.ModelServerConfig()
    config.model_config_list.config.add(name=name, base_path="/m")
    with pytest.raises(registry.ConfigError, match="control character") as e:
        registry.models_of(config, "ReloadConfigRequest")
    assert e.value.args[0].isprintable()  # the name is shown escaped
    core, models = _registry(lambda path, version, sizes: _Servable(path))
    with pytest.raises(registry.ConfigError, match="control character"):
        models.reload(config)  # HandleReloadConfigRequest's path
    path = tmp_path / "models.config"
    path.write_text(text_format.MessageToString(config))  # the name escaped as text protos do
    with pytest.raises(registry.ConfigError, match="control character"):
        registry.read_config(str(path))


def test_serve_refuses_a_model_name_with_a_newline_in_one_line(tmp_path, capsys):
    argv = ["serve", f"--model_base_path={tmp_path}", "--model_name=a\nFORGED", "--port=0"]
    assert command.main(argv, env={}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "control character" in err[0], err


def test_the_server_log_escapes_control_characters():
    """Defense in depth: whatever a message holds, one record is one printable line."""
    formatter = cli.OneLineFormatter("%(levelname)s %(message)s")
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "model %s", ("a" + FORGED,), None)
    line = formatter.format(record)
    assert line.isprintable() and "\\r\\n2026" in line
    assert record.getMessage() == "model a" + FORGED  # other handlers see it as logged


# ----------------------------------------------------------------------------- cause 10
class _CountingName(str):
    """A model name counting the comparisons made with it."""

    compared = 0

    def __eq__(self, other):
        _CountingName.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_the_duplicate_name_check_is_linear():
    """Each name was compared with every name before it: 20,000 models took 25 s a poll."""
    n = 2000
    policy = types.SimpleNamespace(WhichOneof=lambda _: None)
    config = types.SimpleNamespace(
        WhichOneof=lambda _: "model_config_list",
        model_config_list=types.SimpleNamespace(
            config=[
                types.SimpleNamespace(
                    name=_CountingName(f"model-{i}"),
                    base_path=f"/m/{i}",
                    model_platform="",
                    model_version_policy=policy,
                    version_labels={},
                )
                for i in range(n)
            ]
        ),
    )
    _CountingName.compared = 0
    assert len(registry.models_of(config, "x")) == n
    assert _CountingName.compared <= n  # quadratic: n * (n - 1) / 2 = 1,999,000
    config.model_config_list.config.append(config.model_config_list.config[7])
    with pytest.raises(registry.ConfigError, match="Illegal to list model model-7 multiple"):
        registry.models_of(config, "x")


def test_an_unchanged_config_file_is_not_parsed_again(tmp_path, monkeypatch):
    """A poll of the same text (nothing else applied meanwhile) costs a read, not a parse."""
    old = _base(tmp_path, "old")
    core, models = _registry(lambda path, version, sizes: _Servable(path))
    path = tmp_path / "models.config"
    path.write_text(_config_text({NAME: old}))
    poller = registry.ConfigPoller(str(path), models, 60)
    parsed = []
    parse = registry.parse_config
    monkeypatch.setattr(registry, "parse_config", lambda *a: parsed.append(1) or parse(*a))
    for _ in range(3):
        poller.poll()
    assert len(parsed) == 1 and list(core.models) == [NAME]
    other = model_server_config_pb2.ModelServerConfig()
    other.model_config_list.config.add(name="other", base_path=old)
    models.reload(other)  # HandleReloadConfigRequest: the file wins again at the next poll
    poller.poll()
    assert len(parsed) == 2 and list(core.models) == [NAME]


# ----------------------------------------------------------------------------- fuzzed
# The hostile inputs of this round, generated (hypothesis, in process: the pieces that take
# them): names with control characters, non-positive timeouts, config files that are no regular
# file.
NAME_CHARS = ("Cc", "Zl", "Zp", "Cs", "Ll", "Lu", "Nd", "Zs")


def test_fuzzed_model_names_are_served_url_safe_or_refused_in_one_line():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=100, deadline=None, database=None, derandomize=True)
    @given(st.text(st.characters(codec=None, categories=NAME_CHARS), min_size=1, max_size=40))
    def fuzz(name: str) -> None:
        config = model_server_config_pb2.ModelServerConfig()
        safe = name.encode("utf-8", errors="replace").decode()  # protobuf strings are UTF-8
        config.model_config_list.config.add(name=safe, base_path="/m")
        # Served only when URL-safe (RFC 3986's unreserved characters, a letter or digit
        # first); anything else refused in one printable line naming the entry.
        url_safe = re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.~-]*", safe) is not None
        try:
            (model,) = registry.models_of(config, "ReloadConfigRequest")
        except registry.ConfigError as e:
            assert not url_safe and str(e).isprintable(), (safe, str(e))
            assert str(e).startswith("ReloadConfigRequest: config 0: model name"), str(e)
        else:
            assert model.name == safe and url_safe

    fuzz()


def test_fuzzed_timeouts_never_make_a_past_deadline():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    async def run(*args):
        await asyncio.sleep(0)
        return {"y": 1}

    @settings(max_examples=50, deadline=None, database=None, derandomize=True)
    @given(st.integers(max_value=0) | st.sampled_from([0, -1, -(2**63), -(10**30)]))
    def fuzz(timeout_ms: int) -> None:
        core = ServingCore([], ServerOptions(rest_api_timeout_in_ms=timeout_ms))
        core._prepare_and_run = run  # type: ignore[method-assign]
        assert asyncio.run(core.infer(None, {})) == {"y": 1}  # type: ignore[arg-type]

    fuzz()


def test_fuzzed_config_files_are_read_or_refused_in_one_line(tmp_path):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    kinds = st.sampled_from(["file", "fifo", "zero", "folder", "dangling", "big"])

    @settings(max_examples=60, deadline=None, database=None, derandomize=True)
    @given(kinds, st.binary(max_size=200), st.integers(0, 10**9))
    def fuzz(kind: str, data: bytes, n: int) -> None:
        path = tmp_path / f"config-{n}"
        if kind == "file":
            path.write_bytes(data)
        elif kind == "big":
            path.write_bytes(b" " * 300 + data)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "zero":
            path.symlink_to("/dev/zero")
        elif kind == "folder":
            path.mkdir()
        else:
            path.symlink_to(tmp_path / "absent")
        try:
            result = _bounded(registry.read_config, str(path), 256)
        finally:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink()
        if isinstance(result, registry.ConfigError):
            assert str(path) in str(result) and "\n" not in str(result), result
        else:
            assert kind == "file" and isinstance(result, list), (kind, result)

    fuzz()
