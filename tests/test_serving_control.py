"""Model control (#53): the v2 repository extension over REST and gRPC (tritonclient), TF
Serving's HandleReloadConfigRequest, ``--model_control_mode``, a failed load keeping the old
state, unloads draining, and one broken model (a missing base_path, a bad name) never stopping
the others.

One real server (``--model_control_mode=explicit``) serves the module; the tests run in order.
The drain and the mode checks run in-process on the same real parts (a ``ServingCore`` with a
``ModelRegistry``, the small dense export). (This process never imports
``estimax.serving.grpc_server``: its v2 messages share names with tritonclient's.)
"""

from __future__ import annotations

import asyncio
import json
import os
import threading

import numpy as np
import pytest

requests = pytest.importorskip("requests")
grpc = pytest.importorskip("grpc")
triton_http = pytest.importorskip("tritonclient.http")
triton_grpc = pytest.importorskip("tritonclient.grpc")
import serving_fixtures as fx  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from estimax import command  # noqa: E402
from estimax.serving import registry  # noqa: E402

IMAGES = fx.make_jpegs(2)[0]


def _config(models: dict[str, str]) -> str:
    body = "".join(f'  config {{ name: "{n}" base_path: "{p}" }}\n' for n, p in models.items())
    return f"model_config_list {{\n{body}}}\n"


def _damage(base: str) -> str:
    """Overwrites every file of version 1 under ``base`` (the export is there, unreadable)."""
    for folder, _, files in os.walk(os.path.join(base, "1")):
        for f in files:
            with open(os.path.join(folder, f), "wb") as out:
                out.write(b"damaged")
    return base


@pytest.fixture(scope="module")
def served(tmp_path_factory, dense_export):
    root = tmp_path_factory.mktemp("control")
    models = {
        "a": dense_export(str(root / "a")),
        "b": dense_export(str(root / "b")),
        "c": dense_export(str(root / "c")),
        "ghost": str(root / "nonexistent" / "x"),  # a broken model: its folder is missing
    }
    damaged = _damage(dense_export(str(root / "damaged")))
    config = root / "models.config"
    config.write_text(_config(models))
    grpc_port = fx.free_port()
    args = [
        f"--model_config_file={config}",
        "--model_control_mode=explicit",
        "--load_model=a",
        "--load_model=b",
        "--load_model=ghost",
        f"--grpc_port={grpc_port}",
        "--readiness=any",  # ghost is never ready
        "--metrics_path=/metrics",
    ]
    log = str(root / "server.log")
    with fx.running_server(args, log_path=log) as (url, proc):
        yield {
            "url": url,
            "grpc": f"127.0.0.1:{grpc_port}",
            "models": models,
            "damaged": damaged,
            "log": log,
        }


def _infer(client, name: str, module) -> np.ndarray:
    """One v2 inference of ``name`` with tritonclient (``module``: its http or grpc)."""
    x = module.InferInput("image_bytes", [1], "BYTES")
    x.set_data_from_numpy(np.array([IMAGES[0]], dtype=object))
    return client.infer(name, [x]).as_numpy("classes")


def _index(served, over: str = "http") -> dict[str, list[dict]]:
    """The repository index by model: REST (tritonclient.http) or gRPC (as JSON)."""
    if over == "http":
        entries = triton_http.InferenceServerClient(served["url"][7:]).get_model_repository_index()
    else:
        client = triton_grpc.InferenceServerClient(served["grpc"])
        entries = client.get_model_repository_index(as_json=True).get("models", [])
    by_name: dict[str, list[dict]] = {}
    for e in entries:
        by_name.setdefault(e["name"], []).append(e)
    return by_name


# ----------------------------------------------------------------------------- the start
def test_a_missing_base_path_does_not_stop_the_others_and_the_index_says_why(served):
    index = _index(served)
    assert [(e["version"], e["state"]) for e in index["a"]] == [("1", "READY")]
    assert [(e["version"], e["state"]) for e in index["b"]] == [("1", "READY")]
    assert index["c"] == [
        {"name": "c", "version": "", "state": "UNAVAILABLE", "reason": "unloaded"}
    ]
    (ghost,) = index["ghost"]
    assert ghost["state"] == "UNAVAILABLE"
    assert f"base_path {served['models']['ghost']} does not exist" in ghost["reason"]
    assert "--model_base_path" not in ghost["reason"]  # no flag the user did not give
    r = requests.post(
        f"{served['url']}/v1/models/ghost:predict", json={"instances": [{"b64": "AA=="}]}
    )
    assert r.status_code == 404 and "Servable not found" in r.json()["error"]
    ready_only = requests.post(f"{served['url']}/v2/repository/index", json={"ready": True})
    assert sorted(e["name"] for e in ready_only.json()) == ["a", "b"]


# ----------------------------------------------------------------------------- round trips
def test_load_unload_and_reload_round_trips_never_disturb_another_model(served):
    """8 clients of model a predict through every control call on c (REST, gRPC, TF Serving's
    HandleReloadConfigRequest): none of them sees an error."""
    from estimax.serving.protos.tensorflow_serving.apis import (
        model_management_pb2,
        model_service_pb2_grpc,
    )
    from estimax.serving.protos.tensorflow_serving.config import model_server_config_pb2

    stop = threading.Event()
    errors: list[str] = []
    counts = [0] * 8

    def client(i: int) -> None:
        http = triton_http.InferenceServerClient(served["url"][7:])
        while not stop.is_set():
            try:
                _infer(http, "a", triton_http)
                counts[i] += 1
            except Exception as e:  # noqa: BLE001 - every error is the test's failure
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        http = triton_http.InferenceServerClient(served["url"][7:])
        rpc = triton_grpc.InferenceServerClient(served["grpc"])
        for over, control, module in (("http", http, triton_http), ("grpc", rpc, triton_grpc)):
            control.load_model("c")
            assert [e["state"] for e in _index(served, over)["c"]] == ["READY"]
            assert _infer(control, "c", module).shape == (1,)
            control.load_model("c")  # a reload: served throughout
            assert _infer(control, "c", module).shape == (1,)
            control.unload_model("c")
            assert _index(served, over)["c"][0]["reason"] == "unloaded"
            with pytest.raises(InferenceServerException, match="Servable not found"):
                _infer(control, "c", module)
        # TF Serving's whole-config reload: c comes back with the file's other models.
        request = model_management_pb2.ReloadConfigRequest()
        request.config.CopyFrom(
            registry_config(served["models"], model_server_config_pb2.ModelServerConfig())
        )
        with grpc.insecure_channel(served["grpc"]) as channel:
            stub = model_service_pb2_grpc.ModelServiceStub(channel)
            stub.HandleReloadConfigRequest(request, timeout=120)
        assert _infer(http, "c", triton_http).shape == (1,)
        http.unload_model("c")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert errors == []
    assert all(n > 0 for n in counts), counts
    metrics = requests.get(f"{served['url']}/metrics").text
    for action in ("load", "reload", "unload", "reload_config"):
        assert f'estimax_serving_model_control_total{{action="{action}"' in metrics, action
    with open(served["log"]) as f:
        log = f.read()
    assert "api=repository_load" in log and "api=repository_unload" in log
    assert "api=RepositoryModelLoad" in log and "api=RepositoryIndex" in log
    assert "model control: loaded model 'c'" in log


def registry_config(models: dict[str, str], message):
    """``models`` as a ``ModelServerConfig`` message."""
    for name, base in models.items():
        message.model_config_list.config.add(name=name, base_path=base)
    return message


def test_a_failed_load_keeps_the_old_state_and_the_index_says_why(served):
    http = triton_http.InferenceServerClient(served["url"][7:])
    before = _infer(http, "b", triton_http)
    override = json.dumps({"base_path": served["damaged"]})
    with pytest.raises(InferenceServerException, match="failed to load 'b'") as e:
        http.load_model("b", config=override)
    assert f"still serving it from {served['models']['b']}" in str(e.value)
    np.testing.assert_array_equal(_infer(http, "b", triton_http), before)  # served on
    for over in ("http", "grpc"):
        states = {(e["version"], e["state"]) for e in _index(served, over)["b"]}
        assert states == {("1", "READY"), ("1", "UNAVAILABLE")}
        (failed,) = [e for e in _index(served, over)["b"] if e["state"] == "UNAVAILABLE"]
        assert failed["reason"].startswith("load failed: version 1:")
    http.load_model("b")  # a load that works clears the failure
    assert [e["state"] for e in _index(served)["b"]] == ["READY"]


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "config, why",
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"bogus": 1}', "unknown fields ['bogus']"),
        ('{"base_path": 3}', "base_path must be a non-empty string"),
        ('{"name": "other"}', "name 'other' is not 'b'"),
        ('{"version_policy": {"latest": {"num_versions": 0}}}', "must be an integer >= 1"),
        ('{"version_policy": {"newest": {}}}', "version_policy must be one of"),
        ('{"dynamic_batching": {"priority_levels": 0}}', "priority_levels must be an integer >= 1"),
        ('{"dynamic_batching": {"priority_levels": "x"}}', "priority_levels must be an integer"),
        (
            '{"dynamic_batching": {"priority_levels": 2, "default_priority_level": 3}}',
            "default_priority_level=3 is outside its priority_levels=2",
        ),
        (  # the server's 3 levels, when the override gives none
            '{"dynamic_batching": {"default_priority_level": 4}}',
            "default_priority_level=4 is outside its priority_levels=3",
        ),
        ('{"response_cache": {"enable": "yes"}}', "response_cache.enable must be true or false"),
        ('{"response_cache": true}', 'response_cache must be {"enable": true}'),
    ],
)
def test_an_invalid_config_override_is_one_line(served, config, why):
    r = requests.post(
        f"{served['url']}/v2/repository/models/b/load",
        json={"parameters": {"config": config}},
    )
    assert r.status_code == 400 and why in r.json()["error"], r.text
    assert "\n" not in r.json()["error"]
    with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT") as e:
        triton_grpc.InferenceServerClient(served["grpc"]).load_model("b", config=config)
    assert why in str(e.value)


def test_loading_an_unknown_model_is_not_found(served):
    r = requests.post(f"{served['url']}/v2/repository/models/nope/load")
    assert r.status_code == 404 and "no such model in the repository" in r.json()["error"]
    with pytest.raises(InferenceServerException, match="NOT_FOUND"):
        triton_grpc.InferenceServerClient(served["grpc"]).load_model("nope")
    r = requests.post(f"{served['url']}/v2/repository/models/nope/unload")
    assert r.status_code == 404 and "no such model" in r.json()["error"]


def _metric(served, name: str, **labels) -> float:
    """A Prometheus sample's value from /metrics (0 if absent)."""
    text = requests.get(served["url"] + "/metrics", timeout=30).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _config_of(served, name: str) -> dict:
    return requests.get(f"{served['url']}/v2/models/{name}/config", timeout=30).json()


CACHE = "estimax_serving_response_cache_total"


def test_a_load_override_turns_one_models_cache_on_and_sets_its_levels(served):
    http = triton_http.InferenceServerClient(served["url"][7:])
    rpc = triton_grpc.InferenceServerClient(served["grpc"])
    override = {
        "response_cache": {"enable": True},
        "dynamic_batching": {"priority_levels": 4, "default_priority_level": 1},
    }
    http.load_model("c", config=json.dumps(override))
    try:
        config = _config_of(served, "c")
        assert config["response_cache"] == {"enable": True}
        assert config["parameters"]["response_cache"] == {"string_value": "on"}
        assert config["parameters"]["priority_levels"] == {"string_value": "4"}
        assert config["parameters"]["default_priority_level"] == {"string_value": "1"}
        other = _config_of(served, "a")  # the server's defaults: no cache, 3 levels
        assert not other["response_cache"].get("enable", False)
        assert other["parameters"]["response_cache"]["string_value"].startswith("off: not enabled")
        assert other["parameters"]["priority_levels"] == {"string_value": "3"}
        # Over REST, then gRPC: the repeat is a hit with the same bytes.
        for client, module in ((http, triton_http), (rpc, triton_grpc)):
            hits = _metric(served, CACHE, model_name="c", result="hit")
            x = module.InferInput("image_bytes", [1], "BYTES")
            x.set_data_from_numpy(np.array([IMAGES[1]], dtype=object))
            one = client.infer("c", [x]).as_numpy("probabilities")
            two = client.infer("c", [x]).as_numpy("probabilities")
            assert one.tobytes() == two.tobytes()
            assert _metric(served, CACHE, model_name="c", result="hit") >= hits + 1
        for _ in range(2):
            _infer(http, "a", triton_http)
        assert _metric(served, CACHE, model_name="a", result="miss") == 0  # never looked up
        # c's 4th level is its own; a keeps the server's 3.
        x = triton_http.InferInput("image_bytes", [1], "BYTES")
        x.set_data_from_numpy(np.array([IMAGES[0]], dtype=object))
        assert http.infer("c", [x], priority=4).as_numpy("classes").shape == (1,)
        with pytest.raises(InferenceServerException, match="give 1 .highest. to 3"):
            http.infer("a", [x], priority=4)
        # A load without an override takes the repository's config again (Triton's way).
        http.load_model("c")
        assert not _config_of(served, "c")["response_cache"].get("enable", False)
    finally:
        http.unload_model("c")


class _Copied:
    """Stands in for a trained Estimator whose export is ``source`` (a real export's folder):
    ``export_version`` publishes it, writing its own ``serving.json``."""

    def __init__(self, source: str) -> None:
        self.source = source

    def export_saved_model(self, parent, serving_input_fn, checkpoint_path=None, platforms=None):
        import shutil

        out = os.path.join(parent, "export")
        shutil.copytree(self.source, out)
        return out


def test_a_version_declaring_random_answers_is_never_cached(served, tmp_path):
    from estimax import export
    from estimax.export import record as record_lib

    base = str(tmp_path / "drawn")
    path = export.export_version(
        _Copied(os.path.join(served["models"]["a"], "1")),
        base,
        preprocessing=export.resnet_eval(fx.IMAGE_SIZE),
        random=True,
    )
    assert record_lib.read(path).random
    http = triton_http.InferenceServerClient(served["url"][7:])
    override = {"base_path": base, "response_cache": {"enable": True}}
    http.load_model("drawn", config=json.dumps(override))  # asks for the cache: refused
    try:
        for _ in range(2):
            _infer(http, "drawn", triton_http)
        for result in ("hit", "miss"):
            assert _metric(served, CACHE, model_name="drawn", result=result) == 0
        config = _config_of(served, "drawn")
        assert not config["response_cache"].get("enable", False)
        reason = "off: this version declares random answers (serving.json)"
        assert config["parameters"]["response_cache"] == {"string_value": reason}
        for over in ("http", "grpc"):
            (entry,) = _index(served, over)["drawn"]
            assert entry["state"] == "READY" and entry["reason"] == f"response cache {reason}"
        with open(served["log"]) as f:
            lines = [line for line in f if "declares random answers" in line]
        assert len(lines) == 1 and "Model drawn: version 1" in lines[0], lines
    finally:
        http.unload_model("drawn")


def test_a_bad_config_json_fails_the_load_in_one_line_and_the_index_says_why(served, tmp_path):
    import shutil

    base = tmp_path / "bad"
    shutil.copytree(os.path.join(served["models"]["a"], "1"), base / "1")
    (base / "config.json").write_text('{"dynamic_batching": {"priority_levels": 0}}')
    override = json.dumps({"base_path": str(base)})
    r = requests.post(
        f"{served['url']}/v2/repository/models/bad/load", json={"parameters": {"config": override}}
    )
    error = r.json()["error"]
    assert r.status_code == 400 and "\n" not in error
    assert f"{base}/config.json: dynamic_batching.priority_levels must be an integer" in error
    entries = _index(served)["bad"]
    assert all(e["state"] == "UNAVAILABLE" for e in entries)
    assert any(
        e["reason"].startswith("load failed: ") and "config.json" in e["reason"] for e in entries
    )
    requests.post(f"{served['url']}/v2/repository/models/bad/unload")  # forgets the failure


@pytest.fixture
def kept_logging():
    """The logging set-up as it was after the test: a start that got as far as configuring the
    server's logging leaves handlers on capsys's stream, closed once the test ends."""
    import logging

    root, access = logging.getLogger(), logging.getLogger("estimax.serving.access")
    saved = (root.handlers[:], root.level, access.handlers[:], access.propagate, access.level)
    yield
    root.handlers[:], access.handlers[:] = saved[0], saved[2]
    root.setLevel(saved[1])
    access.propagate = saved[3]
    access.setLevel(saved[4])


def test_a_bad_config_json_at_start_is_one_line_naming_the_file(
    tmp_path, capsys, dense_export, kept_logging
):
    base = dense_export(str(tmp_path))
    with open(os.path.join(base, "config.json"), "w") as f:
        f.write('{"response_cache": {"enable": "yes"}}')
    argv = ["serve", f"--model_base_path={base}", f"--port={fx.free_port()}"]
    assert command.main(argv, env={}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"{base}/config.json: response_cache.enable must be true or false" in err[0], err


# ----------------------------------------------------------------------------- in-process
def _control(base: str, mode: str, drain_s: float = 60.0):
    """A real core, registry and control over the dense export at ``base`` (model "m")."""
    from estimax.serving.control import ModelControl
    from estimax.serving.core import ServingCore
    from estimax.serving.manager import ModelManager
    from estimax.serving.options import ServerOptions

    core = ServingCore([], ServerOptions(access_log=False))

    def make(config: registry.ModelConfig) -> ModelManager:
        return ModelManager(config.name, config.base_path, [1], poll_wait_seconds=0)

    models = registry.ModelRegistry(core, make)
    config = registry.ModelConfig("m", base)
    return core, ModelControl(models, [config], mode, drain_s)


def test_unload_drains_the_requests_in_flight(tmp_path, dense_export):
    core, control = _control(dense_export(str(tmp_path)), "explicit")
    control.load("m")
    done: list[str] = []
    with core.servable("m", None) as servable:  # a request in flight on m
        unloading = threading.Thread(target=lambda: done.append(control.unload("m")))
        unloading.start()
        fx.wait_until(lambda: "m" not in core.models, "m to stop taking requests", 60)
        assert unloading.is_alive() and not done  # waiting for the request
        (entry,) = control.index()
        assert entry["state"] == "UNLOADING" and entry["version"] == "1"
        features = servable.prepare({"image_bytes": [IMAGES[0]]})
        assert servable.run(features)["classes"].shape == (1,)  # it completes
    unloading.join(60)
    assert done and done[0].startswith("unloaded model 'm' in ")
    assert control.index() == [
        {"name": "m", "version": "", "state": "UNAVAILABLE", "reason": "unloaded"}
    ]


def test_unload_waits_for_the_drain_bound_at_most(tmp_path, dense_export):
    core, control = _control(dense_export(str(tmp_path)), "explicit", drain_s=0)
    control.load("m")
    with core.servable("m", None) as servable:
        message = control.unload("m")  # answers at once, the request still in flight
        assert "still in flight after 0 s (--unload_drain_secs)" in message
        features = servable.prepare({"image_bytes": [IMAGES[0]]})
        assert servable.run(features)["classes"].shape == (1,)  # not freed under it


@pytest.mark.parametrize("mode", ["none", "poll"])
def test_control_calls_are_refused_in_none_and_poll_modes(tmp_path, mode):
    from estimax.serving.control import ModelControl
    from estimax.serving.options import ServerOptions
    from estimax.serving.server import Server

    server = Server([], ServerOptions(access_log=False))
    models = registry.ModelRegistry(server.core, lambda config: None)
    server.core.control = ModelControl(models, [], mode)
    for action in ("load", "unload"):
        status, body = asyncio.run(_post(server.app, f"/v2/repository/models/x/{action}"))
        assert status == 400, body
        error = body["error"]
        assert f"--model_control_mode={mode}" in error and "\n" not in error
    # The index answers in every mode.
    assert asyncio.run(_post(server.app, "/v2/repository/index")) == (200, [])


async def _post(app, path: str) -> tuple[int, object]:
    """``POST path`` with no body, straight to the ASGI app: (status, JSON answer)."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


def test_serve_refuses_a_model_name_that_is_not_url_safe_naming_the_entry(tmp_path, capsys):
    config = tmp_path / "models.config"
    config.write_text(_config({"ok": str(tmp_path), "../../etc": str(tmp_path)}))
    argv = ["serve", f"--model_config_file={config}", "--port=0"]
    assert command.main(argv, env={}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config 1: model name '../../etc' is not URL-safe" in err[0], err
    assert "it holds '/'" in err[0]
    for bad in (*BAD_NAMES, "a/b", "a\\b", "/", ".", "..", "...", "-x", "", "a\nb"):
        with pytest.raises(registry.ConfigError, match="not URL-safe"):
            registry.check_name(bad, "x")
    for good in ("efficientnet-b1.v2_x~", "a", "9", "Model_2.1"):
        registry.check_name(good, "x")


BAD_NAMES = ("../../etc", "a b", "a?b", "a%2Fb", "modèle")


@pytest.mark.parametrize(
    "flags",
    [
        ["--model_base_path={base}", "--model_name=a b"],
        ["--model_config_file={config}", "--model_control_mode=explicit", "--load_model=a?b"],
        ["--model_config_file={config}", "--model_control_mode=explicit", "--load_model=modèle"],
    ],
)
def test_every_flag_naming_a_model_takes_the_one_name_rule(tmp_path, capsys, flags):
    config = tmp_path / "models.config"
    config.write_text(_config({"ok": str(tmp_path)}))
    argv = ["serve", "--port=0", *(f.format(base=tmp_path, config=config) for f in flags)]
    assert command.main(argv, env={}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not URL-safe" in err[0], err
    assert "--model_name: model name 'a b'" in err[0] or "--load_model: model name" in err[0]


def test_a_v2_load_of_a_name_that_is_not_url_safe_is_refused(served):
    grpc_client = triton_grpc.InferenceServerClient(served["grpc"])
    config = json.dumps({"base_path": served["models"]["a"]})
    for name in BAD_NAMES:  # gRPC carries the name as it is
        with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT") as e:
            grpc_client.load_model(name, config=config)
        assert "is not URL-safe" in str(e.value), (name, str(e.value))
    for escaped in ("a%20b", "a%3Fb", "mod%C3%A8le", "a%252Fb"):  # REST: the name decoded
        r = requests.post(
            f"{served['url']}/v2/repository/models/{escaped}/load",
            json={"parameters": {"config": config}},
        )
        assert r.status_code == 400 and "is not URL-safe" in r.json()["error"], (escaped, r.text)
    assert not set(BAD_NAMES) & set(_index(served))  # none was served


def test_load_model_needs_explicit_mode_and_a_known_model(tmp_path, capsys, dense_export):
    base = dense_export(str(tmp_path))
    config = tmp_path / "models.config"
    config.write_text(_config({"m": base}))
    for flags, why in (
        (["--load_model=m"], "--load_model needs --model_control_mode=explicit"),
        (["--model_control_mode=explicit", "--load_model=x"], "--load_model=x: no such model"),
    ):
        argv = ["serve", f"--model_config_file={config}", "--port=0", *flags]
        assert command.main(argv, env={}) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err


def test_the_control_mode_decides_what_loads_at_start_and_what_is_polled():
    import argparse

    from estimax.serving import cli

    configs = [registry.ModelConfig(n, f"/m/{n}") for n in ("a", "b")]

    def mode(**flags):
        args = argparse.Namespace(
            **{
                "model_config_file": "models.config",
                "model_config_file_poll_wait_seconds": 0.0,
                "file_system_poll_wait_seconds": 2.0,
                "unload_drain_secs": 30.0,
                "load_model": None,
                **flags,
            }
        )
        name, loaded, poll = cli._control_mode(args, configs)
        return name, [c.name for c in loaded], poll

    assert mode(model_control_mode="none") == ("none", ["a", "b"], 0.0)  # today's
    assert mode(model_control_mode="poll") == ("poll", ["a", "b"], 2.0)  # the file watched
    assert mode(model_control_mode="poll", model_config_file_poll_wait_seconds=5.0)[2] == 5.0
    assert mode(model_control_mode="explicit") == ("explicit", [], 0.0)
    assert mode(model_control_mode="explicit", load_model=["b"])[1] == ["b"]
    assert mode(model_control_mode="explicit", load_model=["*"])[1] == ["a", "b"]
    with pytest.raises(ValueError, match="a poll would undo the load and unload calls"):
        mode(model_control_mode="explicit", model_config_file_poll_wait_seconds=1.0)
    with pytest.raises(ValueError, match="--unload_drain_secs must be >= 0"):
        mode(model_control_mode="explicit", unload_drain_secs=-1.0)
