"""estimax.ops: CPU-fast convolution / max-pool equal the reference ops and their grads.

Reference: ``lax.conv_general_dilated`` / ``flax.linen.max_pool`` and plain
``jax.vjp``. Tolerances: fp32 results agree to ``5e-5 * max|ref|`` (the matmul
formulation sums the same products in a different order; fp32 has a 6e-8 unit
roundoff and the sums here have <= 10^4 terms); bf16 inputs agree to
``2e-2 * max|ref|`` (bf16 keeps 8 significant bits: 4e-3 relative per rounding,
compounded by the bf16 output rounding of the reference).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from estimax import ops
from estimax.ops import native

NHWC = ("NHWC", "HWIO", "NHWC")
FP32_TOL = 5e-5
BF16_TOL = 2e-2

# (id, input [B, H, W, Cin], kernel [KH, KW, Cin, Cout], strides, padding): every
# convolution shape/stride/padding the models use, at small sizes.
CONV_CASES = [
    ("mnist_5x5_same_cin1", (2, 12, 12, 1), (5, 5, 1, 4), (1, 1), "SAME"),
    ("mnist_5x5_same", (2, 7, 7, 3), (5, 5, 3, 4), (1, 1), "SAME"),
    ("resnet_stem_7x7_s2_fixedpad_valid", (2, 17, 17, 3), (7, 7, 3, 4), (2, 2), "VALID"),
    ("resnet_stem_7x7_s2_same_odd", (2, 11, 11, 3), (7, 7, 3, 4), (2, 2), "SAME"),
    ("1x1_same", (2, 6, 6, 5), (1, 1, 5, 7), (1, 1), "SAME"),
    ("1x1_s2_valid_proj", (2, 7, 7, 5), (1, 1, 5, 7), (2, 2), "VALID"),
    ("3x3_same", (2, 6, 6, 5), (3, 3, 5, 4), (1, 1), "SAME"),
    ("3x3_s2_fixedpad_valid", (2, 9, 9, 5), (3, 3, 5, 4), (2, 2), "VALID"),
    ("3x3_s2_same_even", (2, 8, 8, 5), (3, 3, 5, 4), (2, 2), "SAME"),
    ("3x3_valid_inception", (2, 9, 9, 3), (3, 3, 3, 4), (1, 1), "VALID"),
    ("5x5_same_inception", (2, 7, 7, 3), (5, 5, 3, 4), (1, 1), "SAME"),
    ("1x7_same", (2, 8, 9, 3), (1, 7, 3, 4), (1, 1), "SAME"),
    ("7x1_same", (2, 9, 8, 3), (7, 1, 3, 4), (1, 1), "SAME"),
    ("1x3_same", (2, 5, 6, 3), (1, 3, 3, 4), (1, 1), "SAME"),
    ("3x1_same", (2, 6, 5, 3), (3, 1, 3, 4), (1, 1), "SAME"),
    ("explicit_asym_pad", (2, 8, 9, 3), (3, 3, 3, 4), (1, 1), ((1, 2), (0, 1))),
    ("explicit_pad_s2", (2, 9, 8, 3), (3, 3, 3, 4), (2, 2), ((1, 1), (2, 0))),
]
# Every strategy the fast path can pick must be exact, not just the default.
STRATEGIES = [
    ("xla", "matmul", "im2col"),
    ("im2col", "matmul", "offsets"),
    ("im2col", "matmul", "im2col_t"),
]


# LLVM at level 0 (as tests/test_models.py) for the jitted ops under test: XLA's HLO passes are
# the default's, the machine code compiles several times faster, and the reference comparisons
# hold at the tolerances above.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _jit(fn):
    """``jax.jit(fn)`` whose calls compile at ``FAST_COMPILE`` (``.lower`` is jit's)."""
    jitted = jax.jit(fn)

    def call(*args):
        return jitted.lower(*args).compile(FAST_COMPILE)(*args)

    call.lower = jitted.lower
    return call


def _ref(x, w, strides, padding):
    return lax.conv_general_dilated(x, w, strides, padding, dimension_numbers=NHWC)


def _data(x_shape, w_shape, strides, padding, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(x_shape), dtype)
    w = jnp.asarray(rng.standard_normal(w_shape), dtype)
    y_shape = jax.eval_shape(functools.partial(_ref, strides=strides, padding=padding), x, w).shape
    g = jnp.asarray(rng.standard_normal(y_shape), dtype)
    return x, w, g


def _close(got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    scale = max(float(np.abs(want).max()), 1e-6)
    err = float(np.abs(got - want).max())
    assert err <= tol * scale, f"max abs err {err:.3g} > {tol} * {scale:.3g}"


def _value_and_vjp(f, x, w, g):
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(g))


@pytest.mark.parametrize("use_onednn", [True, False], ids=["default", "xla_only"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv_forward_and_grads_match_reference(case, use_onednn):
    # The default strategies (oneDNN where built) and the pure-XLA ones without it.
    _, xs, ws, strides, padding = case
    x, w, g = _data(xs, ws, strides, padding)
    want = _value_and_vjp(functools.partial(_ref, strides=strides, padding=padding), x, w, g)
    mine = lambda x, w: ops.conv_general_dilated(x, w, strides, padding, dimension_numbers=NHWC)
    with native.native_kernels(use_onednn):
        got = _jit(lambda x, w, g: _value_and_vjp(mine, x, w, g))(x, w, g)
    for a, b in zip(got, want, strict=False):
        _close(a, b, FP32_TOL)


# ---------------------------------------------------------------------------- oneDNN


def _need_onednn():
    if native.available():
        return
    if os.environ.get("ESTIMAX_REQUIRE_ONEDNN") == "1":
        pytest.fail(f"ESTIMAX_REQUIRE_ONEDNN=1 but {native.status()}")
    pytest.skip(f"oneDNN kernels not built: {native.status()}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_onednn_forward_and_grads_match_reference(case, dtype):
    # The oneDNN kernels this CPU serves: native bf16 where it has bf16 convolutions (AVX-512
    # bf16/AMX), fp32 kernels on upcast values elsewhere (AVX2; test_cpu_ops_isa.py forces that
    # path on every machine).
    _need_onednn()
    _, xs, ws, strides, padding = case
    x, w, g = _data(xs, ws, strides, padding, dtype=jnp.dtype(dtype), seed=6)
    f32 = lambda a: a.astype(jnp.float32)
    want = _value_and_vjp(
        functools.partial(_ref, strides=strides, padding=padding), f32(x), f32(w), f32(g)
    )
    chosen = ops.conv_strategies(xs, ws, strides, padding, jnp.dtype(dtype))
    expected = (
        "onednn" if dtype == "float32" or native.dtype_support()["bfloat16"] else "onednn_f32"
    )
    assert chosen == (expected,) * 3
    mine = functools.partial(
        ops.conv_with_strategy,
        window_strides=strides,
        padding=padding,
        fwd=chosen[0],
        dx=chosen[1],
        dw=chosen[2],
    )
    fn = _jit(lambda x, w, g: _value_and_vjp(mine, x, w, g))
    assert "estimax_onednn_conv" in fn.lower(x, w, g).as_text()  # really the oneDNN path
    for a, b in zip(fn(x, w, g), want, strict=False):
        assert a.dtype == x.dtype
        _close(a, b, FP32_TOL if dtype == "float32" else BF16_TOL)


def test_onednn_under_shard_map_on_8_devices_matches_one_device():
    # The estimator's path: per-replica convolutions inside shard_map, gradients pmean'd.
    _need_onednn()
    if jax.device_count() < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (set by make test)")
    mesh = jax.make_mesh((8,), ("data",))
    x, w, _ = _data((16, 9, 9, 3), (3, 3, 3, 8), (1, 1), "SAME", seed=7)
    loss = lambda w, x: jnp.mean(
        jnp.sin(ops.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC))
    )
    ref_loss = lambda w, x: jnp.mean(jnp.sin(_ref(x, w, (1, 1), "SAME")))

    def per_replica(w, x):
        w = lax.pcast(w, "data", to="varying")
        return lax.pmean(jax.grad(loss)(w, x), "data")

    sharded = _jit(jax.shard_map(per_replica, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    want = jax.grad(ref_loss)(w, x)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    assert "estimax_onednn_conv" in sharded.lower(w, x).as_text()
    _close(sharded(w, x), want, FP32_TOL)


def test_native_kernels_off_leaves_no_custom_call_in_an_export():
    # What export_saved_model relies on: with the kernels off, a CPU export is plain StableHLO.
    _need_onednn()
    x, w, _ = _data((2, 8, 8, 3), (3, 3, 3, 4), (1, 1), "SAME")
    # Two separate functions: JAX caches a function's trace, and the switch acts when tracing.
    fwd = lambda: (
        lambda x, w: ops.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC)
    )
    assert "estimax_onednn_conv" in jax.jit(fwd()).lower(x, w).as_text()
    with native.native_kernels(False):
        text = _exported_text(fwd(), x, w, platform="cpu")
    assert "estimax_onednn_conv" not in text and "stablehlo.convolution" in text


def test_native_status_command_names_the_kernels():
    proc = subprocess.run(
        [sys.executable, "-m", "estimax.ops.native", "status"],
        capture_output=True,
        text=True,
        check=False,
    )
    if native.available():
        # "oneDNN 3.13.2 on <CPU> (<isa> kernels): fp32 ..., bf16 ... (<library>)"
        assert proc.returncode == 0 and proc.stdout.startswith("oneDNN 3."), proc.stdout
        assert f"({native.isa()} kernels)" in proc.stdout and native.isa() != "unknown"
    else:
        assert proc.returncode == 1 and "XLA's own" in proc.stdout, proc.stdout


def test_native_build_failure_says_what_to_install(tmp_path, monkeypatch):
    # No oneDNN 3 where pip would install it: the message names the index's packages.
    monkeypatch.setenv("ESTIMAX_ONEDNN_PREFIX", str(tmp_path))
    with pytest.raises(
        RuntimeError, match=r"(?s)oneDNN 3 not found.*pip install 'estimax\[onednn\]'"
    ):
        native.build(output=tmp_path / "lib.so")
    # A oneDNN 2 there (as Debian's libdnnl-dev 2.6 in /usr) is refused, not built against.
    header = tmp_path / "include" / "oneapi" / "dnnl" / "dnnl_version.h"
    header.parent.mkdir(parents=True)
    header.write_text(
        "#define DNNL_VERSION_MAJOR 2\n#define DNNL_VERSION_MINOR 6\n#define DNNL_VERSION_PATCH 3\n"
    )
    with pytest.raises(RuntimeError, match="oneDNN 2.6.3, estimax needs 3 or later"):
        native.build(output=tmp_path / "lib.so")
    assert not (tmp_path / "lib.so").exists()


def test_native_build_compiler_failure_leaves_no_library(tmp_path, monkeypatch):
    if not isinstance(_onednn_or_reason(), native.OneDnn):
        pytest.skip(f"no oneDNN 3 installed: {_onednn_or_reason()}")
    fake = tmp_path / "fake-c++"
    fake.write_text("#!/bin/sh\necho 'fatal error: something broke' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    with pytest.raises(RuntimeError, match="(?s)build failed.*something broke"):
        native.build(output=tmp_path / "lib.so")
    assert not (tmp_path / "lib.so").exists()
    assert not list(tmp_path.glob("tmp*.so"))  # no half-written library left behind


def _onednn_or_reason() -> native.OneDnn | str:
    try:
        return native.find_onednn()
    except RuntimeError as e:
        return str(e)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=["-".join(s) for s in STRATEGIES])
@pytest.mark.parametrize(
    "case",
    [CONV_CASES[i] for i in (2, 5, 7, 8, 16)],
    ids=[CONV_CASES[i][0] for i in (2, 5, 7, 8, 16)],
)
def test_every_strategy_matches_reference(case, strategy):
    _, xs, ws, strides, padding = case
    fwd, dx, dw = strategy
    x, w, g = _data(xs, ws, strides, padding, seed=1)
    want = _value_and_vjp(functools.partial(_ref, strides=strides, padding=padding), x, w, g)
    mine = functools.partial(
        ops.conv_with_strategy, window_strides=strides, padding=padding, fwd=fwd, dx=dx, dw=dw
    )
    got = _jit(lambda x, w, g: _value_and_vjp(mine, x, w, g))(x, w, g)
    for a, b in zip(got, want, strict=False):
        _close(a, b, FP32_TOL)


@pytest.mark.parametrize(
    "case", [CONV_CASES[2], CONV_CASES[6], CONV_CASES[8]], ids=["stem", "3x3", "3x3_s2"]
)
def test_conv_bf16_within_looser_tolerance(case):
    _, xs, ws, strides, padding = case
    x, w, g = _data(xs, ws, strides, padding, dtype=jnp.bfloat16, seed=2)
    # Reference in fp32 on the same (bf16-rounded) values.
    f32 = lambda a: a.astype(jnp.float32)
    want = _value_and_vjp(
        functools.partial(_ref, strides=strides, padding=padding), f32(x), f32(w), f32(g)
    )
    mine = lambda x, w: ops.conv_general_dilated(x, w, strides, padding, dimension_numbers=NHWC)
    got = _jit(lambda x, w, g: _value_and_vjp(mine, x, w, g))(x, w, g)
    for a, b in zip(got, want, strict=False):
        assert a.dtype == jnp.bfloat16
        _close(a, b, BF16_TOL)


def test_conv_under_vmap_matches_reference():
    # A vmapped batch of independent convolutions (per-example kernels).
    x, w, g = _data((2, 6, 6, 3), (3, 3, 3, 4), (1, 1), "SAME", seed=3)
    xs, ws, gs = jnp.stack([x, 2 * x]), jnp.stack([w, -w]), jnp.stack([g, g])
    ref = jax.vmap(
        lambda x, w, g: _value_and_vjp(
            functools.partial(_ref, strides=(1, 1), padding="SAME"), x, w, g
        )
    )(xs, ws, gs)
    mine = lambda x, w: ops.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC)
    got = _jit(jax.vmap(lambda x, w, g: _value_and_vjp(mine, x, w, g)))(xs, ws, gs)
    for a, b in zip(got, ref, strict=False):
        _close(a, b, FP32_TOL)


def test_flax_conv_takes_the_drop_in_and_gives_reference_param_grads():
    x, _, _ = _data((2, 8, 8, 3), (3, 3, 3, 4), (2, 2), "SAME", seed=4)
    ref_m = nn.Conv(4, (3, 3), strides=(2, 2), padding="SAME")
    mine_m = nn.Conv(
        4, (3, 3), strides=(2, 2), padding="SAME", conv_general_dilated=ops.conv_general_dilated
    )
    params = ref_m.init(jax.random.key(0), x)
    loss = lambda m: lambda p, x: jnp.sum(jnp.sin(m.apply(p, x)))
    want = jax.grad(loss(ref_m), argnums=(0, 1))(params, x)
    got = _jit(jax.grad(loss(mine_m), argnums=(0, 1)))(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=False):
        _close(a, b, FP32_TOL)


@pytest.mark.parametrize(
    "kwargs",
    [dict(feature_group_count=2), dict(rhs_dilation=(2, 2)), dict(lhs_dilation=(2, 1))],
    ids=["grouped", "dilated_kernel", "dilated_input"],
)
def test_unsupported_convs_fall_back_to_lax(kwargs):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 8, 8, 4)), jnp.float32)
    w = jnp.asarray(
        rng.standard_normal((3, 3, 2 if "feature_group_count" in kwargs else 4, 4)), jnp.float32
    )
    pad = ((1, 1), (1, 1))  # lax refuses string padding with lhs_dilation
    ref = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), pad, dimension_numbers=NHWC, **kwargs)
    mine = lambda x, w: ops.conv_general_dilated(
        x, w, (1, 1), pad, dimension_numbers=NHWC, **kwargs
    )
    y = jax.eval_shape(ref, x, w)
    g = jnp.ones(y.shape, x.dtype)
    for a, b in zip(_value_and_vjp(mine, x, w, g), _value_and_vjp(ref, x, w, g), strict=False):
        np.testing.assert_array_equal(a, b)  # same op, so bit-identical
    assert not any(
        eqn.primitive.name == "custom_vjp_call" for eqn in jax.make_jaxpr(mine)(x, w).eqns
    )


def test_conv_strategy_errors_name_the_bad_value():
    x, w, _ = _data((1, 4, 4, 2), (3, 3, 2, 2), (1, 1), "SAME")
    with pytest.raises(ValueError, match="dw='fast'"):
        ops.conv_with_strategy(x, w, (1, 1), "SAME", fwd="xla", dx="matmul", dw="fast")


def _exported_text(fn, *args, platform):
    return jax.export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()


def test_gpu_and_tpu_lowering_keep_the_standard_gradient():
    # Lowered for TPU/CUDA the forward and backward must be XLA's own convolutions
    # (no matmul formulation); for CPU a 1x1 convolution is all dot products.
    x, w, g = _data((2, 8, 8, 4), (1, 1, 4, 4), (2, 2), "SAME")
    grad = lambda x, w: jax.grad(
        lambda x, w: jnp.sum(
            ops.conv_general_dilated(x, w, (2, 2), "SAME", dimension_numbers=NHWC) ** 2
        ),
        argnums=(0, 1),
    )(x, w)
    for platform in ("tpu", "cuda"):
        text = _exported_text(grad, x, w, platform=platform)
        assert "dot_general" not in text, platform
        assert "estimax_onednn" not in text, platform
        assert text.count("stablehlo.convolution") >= 3, platform  # fwd, dx, dw
    with native.native_kernels(False):
        cpu = _exported_text(lambda x, w: grad(x, w), x, w, platform="cpu")
    assert "dot_general" in cpu and "stablehlo.convolution" not in cpu


# ---------------------------------------------------------------------------- max-pool

POOL_CASES = [
    ("mnist_2x2_s2_valid", (2, 8, 8, 3), (2, 2), (2, 2), "VALID"),
    ("mnist_2x2_s2_valid_odd", (2, 7, 9, 3), (2, 2), (2, 2), "VALID"),
    ("resnet_3x3_s2_same", (2, 9, 9, 3), (3, 3), (2, 2), "SAME"),
    ("resnet_3x3_s2_same_even", (2, 8, 8, 3), (3, 3), (2, 2), "SAME"),
    ("inception_3x3_s2_valid", (2, 9, 9, 3), (3, 3), (2, 2), "VALID"),
    ("3x3_s1_same", (2, 6, 6, 3), (3, 3), (1, 1), "SAME"),
    ("explicit_pad", (2, 7, 7, 3), (3, 3), (2, 2), ((1, 1), (0, 2))),
]


@pytest.mark.parametrize("case", POOL_CASES, ids=[c[0] for c in POOL_CASES])
def test_max_pool_value_and_grad_match_flax_including_ties(case):
    _, shape, window, strides, padding = case
    rng = np.random.default_rng(6)
    # relu of coarsely quantised values: many windows tie (e.g. all zeros), and the
    # gradient must go to the first maximum, as select_and_scatter_add does.
    x = jnp.maximum(jnp.round(jnp.asarray(rng.standard_normal(shape), jnp.float32) * 2) / 2, 0)
    ref = lambda x: nn.max_pool(x, window, strides=strides, padding=padding)
    mine = lambda x: ops.max_pool(x, window, strides=strides, padding=padding)
    y, vjp = jax.vjp(ref, x)
    g = jnp.asarray(rng.standard_normal(y.shape), jnp.float32)
    got_y, got_dx = _jit(lambda x, g: (mine(x), jax.vjp(mine, x)[1](g)[0]))(x, g)
    np.testing.assert_array_equal(got_y, y)
    # Each input's gradient is a sum of <= 9 cotangents; only the order may differ.
    np.testing.assert_allclose(got_dx, vjp(g)[0], rtol=1e-6, atol=1e-6)
    assert float(jnp.sum(got_dx != 0)) <= g.size  # ties were not double-counted


def test_max_pool_bf16_and_fallback():
    x = jnp.asarray(np.random.default_rng(7).standard_normal((2, 8, 8, 3)), jnp.bfloat16)
    for fn in (
        lambda x: ops.max_pool(x, (2, 2), (2, 2)),
        lambda x: ops.max_pool(x[0], (2, 2), (2, 2)),
    ):  # unbatched: Flax fallback
        ref = (
            (lambda x: nn.max_pool(x, (2, 2), (2, 2)))
            if fn(x).ndim == 4
            else (lambda x: nn.max_pool(x[0], (2, 2), (2, 2)))
        )
        y, vjp = jax.vjp(ref, x)
        got_y, got_vjp = jax.vjp(fn, x)
        np.testing.assert_array_equal(got_y, y)
        np.testing.assert_array_equal(got_vjp(jnp.ones_like(y))[0], vjp(jnp.ones_like(y))[0])


def test_max_pool_lowering_is_cpu_only():
    x = jnp.ones((2, 8, 8, 3))
    grad = jax.grad(lambda x: jnp.sum(ops.max_pool(x, (3, 3), (2, 2), "SAME")))
    assert "select_and_scatter" in _exported_text(grad, x, platform="tpu")
    assert "select_and_scatter" not in _exported_text(grad, x, platform="cpu")


def test_tune_cpu_allocator_applies_on_linux():
    import sys

    try:
        assert ops.tune_cpu_allocator() is sys.platform.startswith("linux")
    finally:
        ops.restore_cpu_allocator()


@pytest.mark.slow
def test_resnet_with_ops_gives_reference_gradients():
    # The drop-ins through a whole (tiny) model: strided fixed-padding convs, 1x1
    # projections, the stem's 3x3/2 SAME max-pool, batch norm. Tolerance 1e-4 * max:
    # fp32 reordering (FP32_TOL per conv) compounds over the ~10 layers.
    from estimax.models import resnet

    x = jnp.asarray(np.random.default_rng(8).standard_normal((2, 16, 16, 3)), jnp.float32)
    ref_m = resnet.ResNetTinyBottleneck(num_classes=5)
    mine_m = resnet.ResNetTinyBottleneck(
        num_classes=5,
        max_pool=ops.max_pool,
        conv=functools.partial(nn.Conv, conv_general_dilated=ops.conv_general_dilated),
    )
    variables = _jit(lambda x: ref_m.init(jax.random.key(0), x, train=False))(x)
    # The last BN of a block starts at gamma = 0, which would zero every gradient
    # inside the block; set all BN scales to 1 so each conv's gradient is exercised.
    variables = {
        **variables,
        "params": jax.tree_util.tree_map_with_path(
            lambda path, v: jnp.ones_like(v) if "scale" in jax.tree_util.keystr(path) else v,
            variables["params"],
        ),
    }

    def loss(m):
        def f(params):
            out, _ = m.apply(
                {**variables, "params": params}, x, train=True, mutable=["batch_stats"]
            )
            return jnp.sum(jnp.sin(out))

        return f

    want = _jit(jax.grad(loss(ref_m)))(variables["params"])
    got = _jit(jax.grad(loss(mine_m)))(variables["params"])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=False):
        _close(a, b, 1e-4)
