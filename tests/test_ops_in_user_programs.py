"""estimax's models and ops inside a user's own programs: ``jax.shard_map`` (its default
``check_vma=True``), ``jax.jit`` over ``NamedSharding``s and ``jax.grad``, on this CPU and lowered
for CUDA and TPU (``jax.export``, no GPU or TPU needed; compiled for a TPU slice by
tests/test_tpu_compile.py, which ``make test`` runs where libtpu is).

Each gives the values of the same model built with Flax's own ``nn.Conv``/``nn.max_pool``. Inside
``shard_map`` JAX's transpose sums a replicated weight's gradient over the batch's axis, so a
sum-of-losses gradient there equals the whole batch's, the reference here.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from estimax import ops
from estimax.compile import compile as compile_lib
from estimax.models.mnist import MnistCNN
from estimax.models.resnet import ResNetTiny
from estimax.models.vit import ViTTiny
from estimax.ops import native

CPU_ONLY = "estimax_onednn"

# name -> (model with estimax's ops, the same with Flax's, a batch of 4)
MODELS = {
    "mnist": (
        MnistCNN(num_classes=3, dense_units=8),
        MnistCNN(num_classes=3, dense_units=8, **ops.standard_layers()),
        (4, 28, 28, 1),
    ),
    "resnet": (
        ResNetTiny(num_classes=3),
        ResNetTiny(num_classes=3, **ops.standard_layers()),
        (4, 16, 16, 3),
    ),
    "vit": (ViTTiny(num_classes=3), ViTTiny(num_classes=3, conv=nn.Conv), (4, 32, 32, 3)),
}


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:2]), ("data",))


# Inputs from numpy and initial variables from one compile at XLA:CPU's optimisation level 0 (as
# estimax's replication.run_init compiles initialisers): run eagerly, every jax.random call of a
# new shape compiles its own threefry hashing, seconds of LLVM each at the default level.
def _normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _init(model: nn.Module, x: np.ndarray) -> Any:
    key = jax.random.key(0)
    init = jax.jit(lambda key, x: model.init(key, x, train=False)).lower(key, x)
    return init.compile(compiler_options={"xla_backend_optimization_level": "0"})(key, x)


# What these tests compare is values, not optimised code: their jitted programs compile at
# XLA:CPU's optimisation level 0 too (the ResNet's gradient took seconds of LLVM at the default).
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _run_fast(f, *args):
    """``jax.jit(f)(*args)``, compiled at optimisation level 0."""
    return jax.jit(f).lower(*args).compile(compiler_options=FAST)(*args)


@functools.cache
def _setup(name: str):
    """(model, the same with Flax's layers, params, a batch, loss), once per model."""
    model, standard, shape = MODELS[name]
    x = _normal(1, shape)
    variables = _init(model, x[:1])

    def loss(m, params, x):
        y = m.apply({**variables, "params": params}, x, train=False)
        return jnp.sum(jnp.sin(y))

    return model, standard, variables["params"], x, loss


def _shard_map_step(model, loss, mesh):
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
    def step(params, x):
        value, grads = jax.value_and_grad(functools.partial(loss, model))(params, x)
        return jax.lax.psum(value, "data"), grads  # grads: already summed (invariant)

    return step


def _close(a, b):
    # fp32 sums in another order (oneDNN's kernels against XLA's, per CPU kind): on AMD Zen 2
    # (AVX2) a weight gradient summed over the batch differed by up to 1.7e-4 (2.6e-4 of it);
    # a wrong gradient (a missing psum, a transposed kernel) is off by its own size.
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-3, atol=1e-4), a, b)


@pytest.mark.parametrize("name", ["mnist", "resnet"])
def test_models_in_shard_map_jit_and_grad_give_flax_values(name):
    model, standard, params, x, loss = _setup(name)
    mesh = _mesh()
    ref_value, ref_grads = _run_fast(
        jax.value_and_grad(functools.partial(loss, standard)), params, x
    )
    # jax.grad alone, and jit over NamedShardings (the batch split over 2 devices).
    _close(jax.value_and_grad(functools.partial(loss, model))(params, x), (ref_value, ref_grads))
    sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
    replicated = jax.device_put(params, NamedSharding(mesh, P()))
    in_jit = _run_fast(jax.value_and_grad(functools.partial(loss, model)), replicated, sharded)
    _close(in_jit, (ref_value, ref_grads))
    # shard_map with check_vma=True (its default): traces, and gives the whole batch's values.
    _close(_run_fast(_shard_map_step(model, loss, mesh), params, x), (ref_value, ref_grads))
    # The forward pass alone too.
    variables = {**_init(model, x[:1]), "params": params}
    forward = jax.shard_map(
        lambda v, x: model.apply(v, x, train=False),
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=P("data"),
    )
    reference = _run_fast(functools.partial(standard.apply, train=False), variables, x)
    _close(_run_fast(forward, variables, x), reference)


def test_vit_in_shard_map_gives_flax_values():
    # shard_map alone (ViT's patch embedding is Flax's nn.Conv; the attention, LayerNorm and
    # GELU trace with check_vma=True). EfficientNet's own op, the depthwise convolution, is in
    # the ops test below (the whole tiny EfficientNet compiles for ~20 s here).
    model, standard, params, x, loss = _setup("vit")
    ref = _run_fast(jax.value_and_grad(functools.partial(loss, standard)), params, x)
    _close(_run_fast(_shard_map_step(model, loss, _mesh()), params, x), ref)


class ConvBnPool(nn.Module):
    """estimax's ops with a train-mode batch norm between them."""

    conv: Any
    max_pool: Any

    @nn.compact
    def __call__(self, x, train):
        x = self.conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return jnp.sum(self.max_pool(nn.relu(x), (2, 2), strides=(2, 2)), axis=(1, 2, 3))


def test_train_mode_batch_norm_in_shard_map_gives_flax_values():
    # Batch statistics of each replica's rows (the user's shard_map does not sync them), the
    # moving averages updated from them, returned as the replicas' mean.
    ours = ConvBnPool(ops.FastConv, ops.max_pool)
    theirs = ConvBnPool(nn.Conv, nn.max_pool)
    x = _normal(1, (4, 8, 8, 3))
    variables = _init(ours, x[:1])

    def step(model):
        @functools.partial(
            jax.shard_map, mesh=_mesh(), in_specs=(P(), P("data")), out_specs=(P(), P(), P())
        )
        def run(variables, x):
            def loss(params):
                y, new = model.apply(
                    {**variables, "params": params}, x, train=True, mutable=["batch_stats"]
                )
                return jnp.sum(jnp.sin(y)), new["batch_stats"]

            (value, new), grads = jax.value_and_grad(loss, has_aux=True)(variables["params"])
            return jax.lax.psum(value, "data"), grads, jax.lax.pmean(new, "data")

        return _run_fast(run, variables, x)

    got, want = step(ours), step(theirs)
    _close(got, want)
    # Train mode: the moving mean moved from its initial zeros.
    assert np.abs(got[2]["BatchNorm_0"]["mean"]).max() > 1e-3


def test_ops_gradients_in_shard_map_sum_a_replicated_weight_over_the_batch():
    # The ops alone, with every combination of what varies: a sharded batch with replicated
    # filters, and filters that vary too (a per-device weight, e.g. a local update).
    mesh = _mesh()
    x = _normal(0, (4, 8, 8, 3))
    w = _normal(1, (3, 3, 3, 5))

    depthwise = _normal(2, (3, 3, 1, 5))  # EfficientNet's

    def f(conv, pool, x, w):
        y = conv(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        d = depthwise.astype(y.dtype)
        y = conv(
            y, d, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=5
        )
        return jnp.sum(jnp.sin(pool(y, (2, 2), strides=(2, 2))))

    ours = functools.partial(f, ops.conv_general_dilated, ops.max_pool)
    theirs = functools.partial(f, jax.lax.conv_general_dilated, nn.max_pool)
    for w_spec in (P(), P("data")):
        ws = w if w_spec == P() else jnp.stack([w, 2 * w])

        def grads(fn, w_spec=w_spec, ws=ws):
            @functools.partial(
                jax.shard_map,
                mesh=mesh,
                in_specs=(P("data"), w_spec),
                out_specs=(P("data"), w_spec),
            )
            def step(x, w):
                w1 = w if w_spec == P() else w[0]
                dx, dw = jax.grad(fn, argnums=(0, 1))(x, w1)
                return dx, (dw if w_spec == P() else dw[None])

            return _run_fast(step, x, ws)

        _close(grads(ours), grads(theirs))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_shard_map_step_lowers_for_gpu_and_tpu_without_cpu_only_calls(name, platform):
    model, _, params, x, loss = _setup(name)
    step = jax.jit(_shard_map_step(model, loss, _mesh()))
    exported = jax.export.export(step, platforms=(platform,))(params, x)
    assert CPU_ONLY not in exported.mlir_module()
    lowered = step.trace(params, x).lower(lowering_platforms=(platform,))
    assert not [t for t in compile_lib.custom_call_targets(lowered.as_text()) if CPU_ONLY in t]
    if native.available() and name == "mnist":
        # Lowered for this CPU the same step does call oneDNN: the checks above can see it.
        assert CPU_ONLY in step.lower(params, x).as_text()
