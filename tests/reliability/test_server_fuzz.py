"""Fuzzing `estimax serve` through its OpenAPI description with schemathesis: every route
(TF Serving REST and Open Inference Protocol v2) gets generated valid and invalid requests.

Asserted: no 5xx answer (schemathesis' ``not_a_server_error`` check), the server process still
running and serving afterwards, and its memory flat: the RSS after a second full fuzzing pass
within a few MiB of the RSS after the first (the first pass warms caches, compiles the
batch sizes and fills the allocator's pools).

The served model is small and fast to build (a dense layer over 32x32 RGB images) but goes
through the real raw-image path: base64 JPEGs decoded and preprocessed in the server.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from .conftest import scale

pytest.importorskip("fastapi")
pytest.importorskip("schemathesis")
requests = pytest.importorskip("requests")
psutil = pytest.importorskip("psutil")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import serving_fixtures as fx  # noqa: E402

pytestmark = pytest.mark.slow
NAME = "tiny"
# The RSS may move by allocator noise; a leak of even a few hundred bytes a request over
# thousands of requests shows above this.
RSS_GROWTH_LIMIT_MIB = 24


def _export(root: str) -> str:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    import estimax as ex
    from estimax import serving

    def model_fn(features, labels, mode, params):
        x = features.astype(jnp.float32).reshape(features.shape[0], -1) / 255.0
        logits = nn.Dense(fx.NUM_CLASSES)(x)
        predictions = {"classes": logits.argmax(-1), "probabilities": jax.nn.softmax(logits)}
        if mode == ex.ModeKeys.PREDICT:
            return ex.EstimatorSpec(mode=mode, predictions=predictions)
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(logits, labels),
            optimizer=optax.sgd(0.1),
            predictions=predictions,
        )

    images, labels = fx.make_jpegs(8)
    est = ex.Estimator(
        model_fn,
        ex.RunConfig(model_dir=os.path.join(root, "model")),
        train_batch_size=8,
        predict_batch_size=8,
    )
    est.train(ex.numpy_input_fn(fx.preprocess_all(images), labels), max_steps=1)
    base = os.path.join(root, "serving")
    serving.export_version(
        est,
        base,
        preprocessing=serving.resnet_eval(fx.IMAGE_SIZE),
        check_inputs=images[:2],
    )
    return base


def _fuzz(url: str, max_examples: int, seed: int, har: str) -> tuple[int, str]:
    """Runs schemathesis once over every operation; returns (requests sent, its output)."""
    # The served model's name and version in the paths: otherwise nearly every request is a
    # 404 for an unknown model and never reaches the request parsing, batching and inference.
    config = os.path.join(os.path.dirname(har), "schemathesis.toml")
    with open(config, "w") as f:
        f.write(f'[parameters]\n"path.name" = "{NAME}"\n"path.version" = "1"\n')
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "schemathesis"),
        f"--config-file={config}",
        "run",
        f"{url}/openapi.json",
        "--checks=not_a_server_error",
        f"--max-examples={max_examples}",
        f"--seed={seed}",
        "--generation-deterministic",
        "--request-timeout=30",
        "--no-color",
        "--report=har",
        f"--report-har-path={har}",
        "--continue-on-failure",
    ]
    # In the test's directory: schemathesis keeps a cache (.schemathesis/) in its cwd.
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, cwd=os.path.dirname(har)
    )
    with open(har) as f:
        entries = json.load(f)["log"]["entries"]
    assert proc.returncode == 0, proc.stdout[-6000:]
    return len(entries), proc.stdout


def test_openapi_describes_both_protocols_with_their_schemas(server):
    url, _ = server
    spec = requests.get(url + "/openapi.json", timeout=30).json()
    paths = spec["paths"]
    for path in ("/v1/models/{name}:predict", "/v2/models/{name}/infer"):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body.get("properties") or body.get("oneOf") or body.get("anyOf"), (path, body)
    for path in ("/v1/models/{name}/metadata", "/v2/health/ready", "/v2/models/{name}"):
        assert "get" in paths[path]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = _export(str(tmp_path_factory.mktemp("server_fuzz")))
    args = [
        f"--model_base_path={base}",
        f"--model_name={NAME}",
        "--enable_batching",
        "--max_batch_size=8",
        "--batch_timeout_micros=2000",
        "--max_body_bytes=200000",
        "--max_image_pixels=20000",
    ]
    with fx.running_server(args) as (url, proc):
        yield url, proc


def test_fuzzed_server_answers_no_5xx_and_memory_stays_flat(server, tmp_path, reliability_record):
    url, proc = server
    examples = scale(25, 400)
    ps = psutil.Process(proc.pid)
    sent = 0
    ok = False
    try:
        first, _ = _fuzz(url, examples, 1, str(tmp_path / "first.har"))
        rss_first = ps.memory_info().rss
        second, out = _fuzz(url, examples, 2, str(tmp_path / "second.har"))
        rss_second = ps.memory_info().rss
        sent = first + second
        assert proc.poll() is None, "the server died"
        assert requests.get(url + "/v2/health/ready", timeout=30).status_code == 200
        growth = (rss_second - rss_first) / 2**20
        assert growth < RSS_GROWTH_LIMIT_MIB, (rss_first, rss_second)
        assert re.search(r"not_a_server_error\s+\d+\s*/\s*\d+ passed|passed", out), out[-3000:]
        ok = True
    finally:
        reliability_record("server", "estimax serve (schemathesis)", sent, ok)
    assert sent > 50 * 2
    # A real request still answers correctly after the storm.
    images, _ = fx.make_jpegs(1, seed=5)
    import base64

    body = {"instances": [{"b64": base64.b64encode(images[0]).decode()}]}
    r = requests.post(f"{url}/v1/models/{NAME}:predict", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert np.isclose(sum(r.json()["predictions"][0]["probabilities"]), 1.0, atol=1e-5)
