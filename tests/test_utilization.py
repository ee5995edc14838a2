"""MFU: the compiled step's flops per device, over the measured step time, over a cited peak."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import estimax as ex
from estimax.estimator import utilization
from estimax.parallel import chips

IN, HIDDEN, OUT = 128, 256, 128
BATCH = 512  # 64 rows per replica on 8 devices: the matmuls dwarf the optimizer's update


def train_flops(rows: int) -> int:
    """Two bias-free dense layers trained on ``rows``: forward 2 matmuls, backward 3 (no
    gradient for the input): 2*rows*(IN*HIDDEN) x 2 + 2*rows*(HIDDEN*OUT) x 3."""
    return 4 * rows * IN * HIDDEN + 6 * rows * HIDDEN * OUT


def model_fn(features, labels, mode, params):
    out = nn.Dense(OUT, use_bias=False)(nn.Dense(HIDDEN, use_bias=False)(features))
    loss = jnp.mean((out - labels) ** 2)
    return ex.EstimatorSpec(mode=mode, loss=loss, optimizer=optax.sgd(0.01))


def input_fn():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * BATCH, IN)).astype(np.float32)
    y = rng.normal(size=(2 * BATCH, OUT)).astype(np.float32)
    return ex.numpy_input_fn(x, y, shuffle=False)


class LoopClock(ex.SessionRunHook):
    """A fake clock that moves ``seconds`` before each loop: every loop takes exactly that."""

    def __init__(self, seconds: float):
        self.now = 0.0
        self.seconds = seconds

    def __call__(self) -> float:
        return self.now

    def before_run(self, run_context) -> None:
        self.now += self.seconds


def scalars(logdir: str, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return {}
    return {e.step: e.value for e in acc.Scalars(tag)}


def train(tmp_path, name: str, caplog, steps: int = 4, **config) -> tuple[ex.Estimator, list]:
    """Trains ``steps`` with 2-step loops of 0.5 s each (4 steps/s); the log lines."""
    clock = LoopClock(0.5)
    cfg = ex.RunConfig(
        model_dir=str(tmp_path / name), iterations_per_loop=2, log_step_count_steps=2, **config
    )
    est = ex.Estimator(model_fn, cfg, train_batch_size=BATCH, clock=clock)
    with caplog.at_level("INFO"):
        est.train(input_fn(), max_steps=steps, hooks=[clock])
    est.close()
    return est, [r.getMessage() for r in caplog.records]


FAKE_CHIP = chips.ChipSpec(1, 1, 1e-3, "https://example.com/fake", ("cpu",), "dense")


def test_per_device_flops_times_devices_is_the_global_count():
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    mesh = Mesh(np.array(jax.devices()), ("data",))
    w, x = jnp.ones((IN, HIDDEN)), jnp.ones((BATCH, IN))
    whole = utilization.compiled_flops(jax.jit(jnp.matmul).lower(x, w).compile())
    per_device = utilization.compiled_flops(
        jax.jit(
            jax.shard_map(jnp.matmul, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
        )
        .lower(x, w)
        .compile()
    )
    assert whole == 2 * BATCH * IN * HIDDEN
    assert per_device is not None and 8 * per_device == whole


def test_a_loop_body_counts_once_so_the_multiplier_restores_it():
    # Why a device loop of n steps is one step's flops, and why a micro-batch loop that is not
    # unrolled (off CPU) is multiplied by k: XLA's cost analysis counts a loop's body once.
    def steps(w, xs, unroll):
        return jax.lax.scan(lambda c, x: (c + jnp.sum(x @ w), None), 0.0, xs, unroll=unroll)[0]

    w, xs = jnp.ones((IN, HIDDEN)), jnp.ones((4, 64, IN))
    one = 2 * 64 * IN * HIDDEN
    for unroll, multiplier, expected in ((1, 1, one), (1, 4, 4 * one), (True, 1, 4 * one)):
        fn = jax.jit(functools.partial(steps, unroll=unroll))
        cost = utilization.StepUtilization(jax.devices()[:1], multiplier).cost(fn, w, xs)
        assert cost.flops == pytest.approx(expected, rel=0.01), (unroll, multiplier)


def test_mfu_is_the_compiled_flops_over_the_step_time_over_the_cited_peak(
    tmp_path, caplog, monkeypatch, no_compilation_cache
):
    monkeypatch.setattr(chips, "for_device", lambda device: ("fake", FAKE_CHIP))
    compiles: list[str] = []

    def on_compile(event: str, secs: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kw.get("fun_name", ""))

    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        est, lines = train(tmp_path, "fake", caplog)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
    tflops = scalars(est.model_dir, "TFLOP/s/device")
    mfu = scalars(est.model_dir, "MFU")
    assert sorted(tflops) == sorted(mfu) == [2, 4]
    for step in (2, 4):
        # 2 steps per 0.5 s loop: 4 steps/s.
        flops = tflops[step] * 1e12 / 4
        assert flops == pytest.approx(train_flops(BATCH // 8), rel=0.03)
        assert mfu[step] == pytest.approx(100 * flops * 4 / 1e9, rel=1e-5)  # the peak: 1 GFLOP/s
    assert f"MFU: {mfu[4]:.3g}%" in lines
    assert any(line.startswith("TFLOP/s per device: ") for line in lines)
    assert not any(line.startswith("MFU unknown") for line in lines)
    peak_said = [line for line in lines if "GFLOP per device per step" in line]
    assert len(peak_said) == 1 and "https://example.com/fake" in peak_said[0]
    # The train step was compiled once: reading its flops found jit's own executable.
    train_step_compiles = [name for name in compiles if "per_replica" in name]
    assert len(train_step_compiles) == 1, compiles


@pytest.mark.parametrize(
    "config", [{"steps_per_device_call": 2}, {"gradient_accumulation_steps": 2}], ids=str
)
def test_a_device_loop_or_micro_batches_still_give_one_steps_flops(
    tmp_path, caplog, monkeypatch, config
):
    monkeypatch.setattr(chips, "for_device", lambda device: ("fake", FAKE_CHIP))
    est, _ = train(tmp_path, "loop", caplog, **config)
    tflops = scalars(est.model_dir, "TFLOP/s/device")
    assert sorted(tflops) == [2, 4]
    assert tflops[4] * 1e12 / 4 == pytest.approx(train_flops(BATCH // 8), rel=0.03)


def test_on_cpu_mfu_is_unknown_said_once_and_not_written(tmp_path, caplog):
    est, _ = train(tmp_path, "cpu", caplog, steps=2)
    with caplog.at_level("INFO"):
        # A second run of the same Estimator (a train_and_evaluate segment) says it no more.
        est.train(input_fn(), max_steps=4, hooks=[est.clock])
    lines = [r.getMessage() for r in caplog.records]
    unknown = [line for line in lines if line.startswith("MFU unknown")]
    assert unknown == [
        "MFU unknown: no peak for cpu (estimax.parallel.chips cites the chips it knows); "
        "TFLOP/s per device is logged"
    ]
    assert not any(line.startswith("MFU: ") for line in lines)
    assert scalars(est.model_dir, "MFU") == {}
    assert sorted(scalars(est.model_dir, "TFLOP/s/device")) == [2, 4]


def test_no_cost_analysis_says_so_once_and_writes_neither(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(chips, "for_device", lambda device: ("fake", FAKE_CHIP))
    monkeypatch.setattr(utilization, "compiled_flops", lambda compiled: None)  # as on XLA:GPU
    est, lines = train(tmp_path, "gpu", caplog)
    assert [line for line in lines if line.startswith("MFU")] == [
        "MFU unknown: the compiler gives no cost analysis"
    ]
    assert scalars(est.model_dir, "MFU") == scalars(est.model_dir, "TFLOP/s/device") == {}
    assert sorted(scalars(est.model_dir, "global_step/sec")) == [2, 4]


def test_a_step_with_custom_kernels_says_their_work_is_uncounted(tmp_path, caplog, monkeypatch):
    # estimax's CPU convolutions call oneDNN through XLA's FFI where the library is built
    # (`make` builds it): XLA counts such a call as no flops, so the step's TFLOP/s is unknown.
    from estimax import ops
    from estimax.ops import native

    monkeypatch.setattr(chips, "for_device", lambda device: ("fake", FAKE_CHIP))

    def conv_model_fn(features, labels, mode, params):
        out = ops.FastConv(8, (3, 3), use_bias=False)(features.reshape(-1, 8, 8, 2))
        loss = jnp.mean((out.reshape(out.shape[0], -1)[:, :OUT] - labels) ** 2)
        return ex.EstimatorSpec(mode=mode, loss=loss, optimizer=optax.sgd(0.01))

    clock = LoopClock(0.5)
    cfg = ex.RunConfig(
        model_dir=str(tmp_path / "conv"), iterations_per_loop=2, log_step_count_steps=2
    )
    est = ex.Estimator(conv_model_fn, cfg, train_batch_size=BATCH, clock=clock)
    with caplog.at_level("INFO"):
        est.train(input_fn(), max_steps=2, hooks=[clock])
    est.close()
    lines = [r.getMessage() for r in caplog.records]
    if native.available():
        assert (
            "TFLOP/s and MFU unknown: XLA's cost analysis cannot count the work of the step's "
            "custom kernels (estimax_onednn_conv_backward_weights, estimax_onednn_conv_forward)"
        ) in lines
        assert scalars(est.model_dir, "TFLOP/s/device") == scalars(est.model_dir, "MFU") == {}
    else:  # XLA's own convolutions: counted
        assert not any("unknown" in line for line in lines)
        assert sorted(scalars(est.model_dir, "MFU")) == [2]
