"""The original's spatial partitioning and FSDP (``estimax.parallel.layouts``, issue #40).

Parity: on the 8 forced CPU devices (conftest), one train step under each layout gives the
1-D data-parallel step's loss and gradients (SGD at learning rate 1 after one step: the
parameters' change is the gradient) for a small ResNet-style conv net with batch norm and a
small transformer-style block; a run trained under one layout resumes under another.
"""

from __future__ import annotations

import functools
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import estimax as ex
from estimax.estimator import batches, step_builder
from estimax.estimator import steps as steps_lib
from estimax.estimator.spec import ModeKeys
from estimax.models.resnet import ResNetTiny
from estimax.models.vit import ViTTiny
from estimax.parallel import layouts, replication, strategies
from estimax.state import restoring

# Measured here (8 CPU devices, float32): the largest difference of a gradient between a layout
# and the 1-D step was 1.2e-7 (spatial, conv net), 0 (FSDP, conv net) and 3e-8 (FSDP,
# transformer block); the losses were equal. The tolerance allows another reduction order, not
# another computation: a gradient mean off by the replica count (the FSDP pitfall) is off by
# ~1e-1 here.
GRAD_ATOL = 1e-6
LOSS_RTOL = 1e-6
BATCH = 16
# LLVM at level 0 (as tests/test_models.py) for the steps compared here: XLA's HLO passes (the
# partitioning, the collectives, buffer assignment) are the default's, and both sides of a
# comparison are compiled alike; the machine code is compiled several times faster.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


class ConvNet(nn.Module):
    """ResNet-style: conv, batch norm, a residual block, global pool, dense."""

    @nn.compact
    def __call__(self, x, train):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(8, (3, 3))(x)))
        y = nn.BatchNorm(use_running_average=not train)(nn.Conv(8, (3, 3))(x))
        return nn.Dense(4)(jnp.mean(nn.relu(x + y), axis=(1, 2)))


class Block(nn.Module):
    """Transformer-style: self-attention and an MLP, each behind a layer norm, residual."""

    @nn.compact
    def __call__(self, x, train):
        x = nn.Dense(32)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(nn.LayerNorm()(x))
        x = x + nn.Dense(32)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(x))))
        return nn.Dense(4)(jnp.mean(x, axis=1))


class Mlp(nn.Module):
    """Quick to compile: for the runs across layouts, which compile each layout's steps."""

    @nn.compact
    def __call__(self, x, train):
        return nn.Dense(4)(nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1))))


# estimax's own families at their tiny sizes (a ViT's head not zero-initialised: with a zero
# head, step one's gradients below it are zero and would compare nothing).
MODELS = {
    "conv": ConvNet,
    "transformer": Block,
    "mlp": Mlp,
    "resnet": functools.partial(ResNetTiny, num_classes=4),
    "vit": functools.partial(ViTTiny, num_classes=4, head_zeroinit=False),
    # Under --remat and FSDP the blocks gather their own parameters (parallel.remat.remat_block).
    "resnet_remat": functools.partial(ResNetTiny, num_classes=4, remat="full"),
    "vit_remat": functools.partial(
        ViTTiny, num_classes=4, head_zeroinit=False, remat="dots_saveable"
    ),
}
IMAGES = {
    "conv": (8, 8, 3),
    "resnet": (32, 32, 3),
    "vit": (32, 32, 3),
    "resnet_remat": (32, 32, 3),
    "vit_remat": (32, 32, 3),
}


def make_model_fn(net, ema_decay=None):
    def model_fn(features, labels, mode, params):
        logits = net()(features, mode == ModeKeys.TRAIN)
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(logits, labels),
            optimizer=optax.sgd(1.0),
            predictions=logits,
            eval_metrics={"accuracy": ex.metrics.accuracy(labels, logits)},
            gradient_clip_norm=0.5,  # the global norm must span every replica's slices
            weight_decay=1e-3,
            ema_decay=ema_decay,
        )

    return model_fn


def batch(model, seed=0):
    rs = np.random.RandomState(seed)
    shape = (BATCH, *IMAGES.get(model, (8, 6)))  # images; 8 tokens of 6
    return rs.randn(*shape).astype(np.float32), rs.randint(0, 4, BATCH).astype(np.int32)


def ready_step(net, x, y, **layout):
    """(the train step, its arguments: state, rng, features, labels) of ``net`` under a
    layout, on the batch ``(x, y)``, placed as a run places them."""
    config = ex.RunConfig(model_dir="/tmp/unused", **layout)
    builder = step_builder.StepBuilder(make_model_fn(net), {}, config)
    mesh = builder.make_mesh()
    steps = builder.build(mesh, {ModeKeys.TRAIN: BATCH})
    rows = BATCH // layouts.num_replicas(mesh)
    state = restoring.train_state(steps, mesh, None, 0, (x[:rows], y[:rows]), None, "/tmp")
    features, labels = batches._transfer(mesh, steps.layout, ModeKeys.TRAIN, False)((x, y))
    rng = jax.device_put(steps.rng, replication.replicated(mesh))
    return steps.train, (state, rng, features, labels)


def one_step(model: str, **layout):
    """(loss, gradients, batch statistics, state) of one train step on ``model``'s batch."""
    train, (state, *inputs) = ready_step(MODELS[model], *batch(model), **layout)
    before = jax.device_get(state.params)
    state, out = train.lower(state, *inputs).compile(FAST_COMPILE)(state, *inputs)
    grads = jax.tree.map(lambda b, a: b - np.asarray(a), before, jax.device_get(state.params))
    return float(out.loss), grads, jax.device_get(state.model_state), state


@functools.cache
def data_parallel(model: str, replicas: int):
    return one_step(model, num_shards=replicas)[:3]


def assert_same_step(got, want):
    loss, grads, stats = got[:3]
    np.testing.assert_allclose(loss, want[0], rtol=LOSS_RTOL)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=GRAD_ATOL, rtol=0)
    for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(want[2]), strict=True):
        np.testing.assert_allclose(a, b, atol=GRAD_ATOL, rtol=0)


def test_spatial_partitioning_gives_the_data_parallel_step():
    # 4 replicas of 2 cores, images split in height, against 4 replicas of one device: batch
    # norm's statistics are the replica's (its cores' tiles together), as the original's.
    got = one_step(
        "conv", num_cores_per_replica=2, input_partition_dims=[[1, 2, 1, 1], None], num_shards=4
    )
    assert_same_step(got, data_parallel("conv", 4))
    state = got[3]
    assert jax.tree.leaves(state.params)[0].sharding.mesh.axis_names == ("data", "model0")


@pytest.mark.parametrize("model", ["resnet", "vit"])
def test_spatial_partitioning_gives_estimax_models_data_parallel_step(model):
    got = one_step(
        model, num_cores_per_replica=2, input_partition_dims=[[1, 2, 1, 1], None], num_shards=4
    )
    assert_same_step(got, data_parallel(model, 4))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_fsdp_gives_the_data_parallel_step(model):
    got = one_step(model, shard_parameters=0.001)  # ~1 KiB: the kernels are split
    # Under --remat, against the plain model's data-parallel step: remat recomputes the same
    # values (tests/test_remat.py), so one reference step serves both and compiles once.
    assert_same_step(got, data_parallel(model.removesuffix("_remat"), 8))
    state = got[3]
    specs = [leaf.sharding.spec for leaf in jax.tree.leaves(state.params)]
    assert P() in specs and any("data" in tuple(s) for s in specs)
    # The split parameters hold an eighth of themselves per device.
    whole = sum(leaf.nbytes for leaf in jax.tree.leaves(state.params))
    per_device = sum(
        leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state.params)
    )
    assert per_device < whole / 2, (per_device, whole)


def test_the_default_step_is_the_plain_data_parallel_one():
    """N = 1 and no FSDP: the train step lowers to the same program as a bare shard_map of
    ``steps.train_step`` over the 1-D mesh (no constraint, no gather, no extra op)."""
    config = ex.RunConfig(model_dir="/tmp/unused")
    builder = step_builder.StepBuilder(make_model_fn(Block), {}, config)
    mesh = builder.make_mesh()
    assert mesh.axis_names == ("data",)
    steps = builder.build(mesh, {ModeKeys.TRAIN: BATCH})
    x, y = batch("transformer")
    state = jax.eval_shape(steps.init, steps.rng, x[:2], y[:2])
    module = steps_lib.ModelFnModule(
        call=functools.partial(builder._call_model_fn, batch_size=2), mode=ModeKeys.TRAIN
    )

    def per_replica(state, rng, features, labels):
        return steps_lib.train_step(
            module, state, (features, labels), rng, axis_name="data", unroll_accumulation=True
        )

    bare = jax.jit(
        jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data")),
            out_specs=(P(), P()),
        ),
        donate_argnums=(0,),
    )
    args = (state, steps.rng, x, y)
    assert steps.train.lower(*args).as_text() == bare.lower(*args).as_text()


# ------------------------------------------------------------------ across layouts


def train(model_dir, layout, steps, model="mlp"):
    x, y = batch(model, seed=1)
    est = ex.Estimator(
        make_model_fn(MODELS[model], ema_decay=0.9),
        ex.RunConfig(model_dir=str(model_dir), save_checkpoints_steps=2, **layout),
        train_batch_size=BATCH,
        eval_batch_size=BATCH,
    )
    est.train(ex.numpy_input_fn(x, y, shuffle=False), max_steps=steps)
    return est


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """4 steps under the default layout, uninterrupted."""
    return train(tmp_path_factory.mktemp("straight"), {}, 4)


@pytest.mark.parametrize(
    "first,then",
    [
        ({"shard_parameters": 0.001}, {"num_shards": 4}),
        ({"num_shards": 8}, {"shard_parameters": 0.001, "num_shards": 4}),
    ],
    ids=["fsdp_then_data_parallel", "data_parallel_then_fsdp"],
)
def test_a_run_resumes_under_another_layout_and_device_count(tmp_path, straight, first, then):
    train(tmp_path / "resumed", first, 2)
    assert_same_run(train(tmp_path / "resumed", then, 4), straight, "mlp")


def assert_same_run(resumed, straight, model):
    """``resumed`` (4 steps, under two layouts) ended where ``straight`` (4 under one) did."""
    assert resumed.get_global_step() == 4
    want, got = straight.get_variables(), resumed.get_variables()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=GRAD_ATOL, rtol=0)
    # The moving average (what evaluation uses) came through the change too.
    x, y = batch(model, seed=1)
    eval_input = ex.numpy_input_fn(x, y, shuffle=False, num_epochs=1)
    np.testing.assert_allclose(
        resumed.evaluate(eval_input)["loss"], straight.evaluate(eval_input)["loss"], rtol=1e-5
    )


SPATIAL = {"num_cores_per_replica": 2, "input_partition_dims": [[1, 2, 1, 1], None]}


@pytest.fixture(scope="module")
def straight_conv(tmp_path_factory):
    """4 steps of a conv net with batch norm as 4 data-parallel replicas of 1 core, uninterrupted:
    on 8 devices, the runs below use 4 replicas of 2 cores each (statistics reduced over a
    replica's cores, as the original), so the batch statistics are the same replicas' too."""
    return train(tmp_path_factory.mktemp("straight_conv"), {"num_shards": 4}, 4, model="conv")


@pytest.mark.parametrize(
    "first,then",
    [(SPATIAL, {"num_shards": 4}), ({"num_shards": 4}, SPATIAL)],
    ids=["spatial_then_data_parallel", "data_parallel_then_spatial"],
)
def test_a_run_resumes_into_and_out_of_spatial_partitioning(tmp_path, straight_conv, first, then):
    train(tmp_path / "resumed", first, 2, model="conv")
    assert_same_run(train(tmp_path / "resumed", then, 4, model="conv"), straight_conv, "conv")


def test_warm_start_under_fsdp(tmp_path, straight):
    source = straight  # a default-layout run's model_dir, trained once for the module
    x, y = batch("mlp", seed=1)
    est = ex.Estimator(
        make_model_fn(Mlp),
        ex.RunConfig(model_dir=str(tmp_path / "warm"), shard_parameters=0.001),
        train_batch_size=BATCH,
        warm_start_from=source.model_dir,
    )
    steps = est._steps
    state = restoring.train_state(
        steps, est.mesh, None, 0, (x[:2], y[:2]), source.model_dir, est.model_dir
    )
    split = [leaf for leaf in jax.tree.leaves(state.params) if "data" in tuple(leaf.sharding.spec)]
    assert split  # the warm-started state keeps FSDP's placement
    want = source.get_variables()["params"]
    got = jax.tree.leaves(jax.device_get(state.params))
    for a, b in zip(got, jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ one line per mistake


@pytest.mark.parametrize(
    "fields,expected",
    [
        ({"num_cores_per_replica": 3}, r"^--num_cores_per_replica=3 \(RunConfig.num_cores_per_"),
        (
            {"num_cores_per_replica": 4, "input_partition_dims": [[1, 2, 1, 1], None]},
            r"^--input_partition_dims=1,2,1,1 .*multiply to 2, not to --num_cores_per_replica=4",
        ),
        (
            {"input_partition_dims": [[1, 2, 1, 1]]},
            r"^--input_partition_dims=1,2,1,1 .*multiply to 2, not to --num_cores_per_replica=1",
        ),
        ({"shard_parameters": 0}, r"^--fsdp_min_size_mb=0 \(RunConfig.shard_parameters\)"),
    ],
    ids=["cores_not_a_power_of_two", "dims_not_the_cores", "dims_without_cores", "fsdp_size"],
)
def test_bad_layouts_are_one_line(fields, expected):
    with pytest.raises(ValueError, match=expected) as e:
        ex.RunConfig(**fields)
    assert "\n" not in str(e.value)


def test_cores_that_do_not_divide_the_devices_are_one_line():
    config = ex.RunConfig(model_dir="/tmp/unused", num_cores_per_replica=16)
    with pytest.raises(ValueError, match=r"^--num_cores_per_replica=16 .* does not divide this"):
        step_builder.StepBuilder(make_model_fn(Block), {}, config).make_mesh()


def test_a_side_the_split_does_not_divide_is_one_line():
    layout = layouts.Layout.from_config(
        ex.RunConfig(num_cores_per_replica=4, input_partition_dims=[[1, 4, 1, 1], None])
    )
    with pytest.raises(ValueError, match=r"^--input_partition_dims=1,4,1,1 .*dimension 1 of the "):
        layout.input_specs(np.zeros((8, 6, 6, 3)), np.zeros(8))
    assert layout.input_specs(np.zeros((8, 8, 6, 3)), None) == (
        P("data", "model0", None, None),
        None,
    )


def test_fsdp_that_splits_nothing_is_one_line_and_an_undividable_leaf_a_warning(caplog):
    layout = layouts.Layout.from_config(ex.RunConfig(shard_parameters=1.0))
    # 1.2 MiB, and its one dimension (odd) does not divide by 8 replicas.
    params = {"small": np.zeros((4, 4), np.float32), "odd": np.zeros((315105,), np.float32)}
    with pytest.raises(ValueError, match=r"^--fsdp_min_size_mb=1 .*splits no parameter") as e:
        layout.check_fsdp(params, 8)
    assert "\n" not in str(e.value)
    params["big"] = np.zeros((1024, 512), np.float32)  # 2 MiB, splits on its first dimension
    with caplog.at_level(logging.WARNING):
        layout.check_fsdp(params, 8)
    assert "['odd'] [315105] stays whole" in caplog.text
    assert layout.param_dims(params, 8) == {"small": -1, "odd": -1, "big": 0}
    assert layout.param_dims(params, 1) == {"small": -1, "odd": -1, "big": -1}


def test_a_run_config_holds_its_layout_and_the_step_picks_its_strategy_from_it():
    # RunConfig builds its layout once; what reads it (step builder, transfer) gets that one.
    config = ex.RunConfig(shard_parameters=1.0)
    assert config.layout == layouts.Layout(fsdp_min_bytes=2**20)

    def model_fn(features, labels, mode, params):
        raise AssertionError("not called: only the builder's layout is read")

    assert step_builder.StepBuilder(model_fn, {}, config).layout is config.layout
    assert ex.RunConfig().layout.is_default
    # Split leaves over a replica axis: the sharded strategy; anything else: replicated.
    assert isinstance(strategies.for_params({"w": 0, "b": -1}, "data"), strategies.Sharded)
    for dims, axis in (({"w": -1}, "data"), (None, "data"), ({"w": 0}, None)):
        assert isinstance(strategies.for_params(dims, axis), strategies.Replicated)


# ------------------------------------------------------------------ the programs' flags


@pytest.mark.parametrize("program", ["resnet", "efficientnet", "inception_v3", "vit", "mnist"])
def test_the_layout_flags_reach_every_programs_run_config(tmp_path, monkeypatch, program):
    import importlib

    from absl import flags

    from estimax.programs import common
    from estimax.programs.job import Job

    module = importlib.import_module(f"estimax.programs.{program}")
    jobs: list[Job] = []
    monkeypatch.setattr(common, "run", jobs.append)
    fv = flags.FlagValues()
    module.define_flags(fv)
    fv(
        ["program", f"--model_dir={tmp_path}", "--compile_for=v5e:2x2"]
        + ["--num_cores_per_replica=2", "--input_partition_dims=1,2,1,1"]
        + ["--fsdp_min_size_mb=4"]
    )
    module.run_from_flags(fv)
    config = jobs[0].config
    assert config.num_cores_per_replica == 2
    assert config.input_partition_dims == [[1, 2, 1, 1], None]
    assert config.shard_parameters == 4.0
    # --num_cores/--num_shards count every core, as the original's: replicas are half of them.
    assert config.num_shards in (None, 4)


def test_a_bad_layout_flag_is_a_usage_error():
    from absl import flags

    from estimax.programs import cli, configs, shared_flags

    fv = flags.FlagValues()
    shared_flags.define_tpu_flags(fv)
    fv(["program", "--num_cores_per_replica=2", "--input_partition_dims=1,2,2,1"])
    with pytest.raises(cli.UsageError, match=r"^--input_partition_dims=1,2,2,1 .*multiply to 4"):
        configs.layout_fields(fv, 8)
    fv(["program", "--num_cores_per_replica=2", "--input_partition_dims=1,x,1,1"])
    with pytest.raises(cli.UsageError, match=r"^--input_partition_dims=1,x,1,1: give integers"):
        configs.layout_fields(fv, 8)
    fv(["program", "--num_cores_per_replica=4", "--input_partition_dims=1,2,2,1"])
    with pytest.raises(cli.UsageError, match=r"^--num_cores_per_replica=4 does not divide .* 6"):
        configs.layout_fields(fv, 6)
    assert configs.layout_fields(fv, 8)["num_shards"] == 2


def _train_step_bytes(net, image, **layout):
    """(argument bytes, temporary bytes) per device of ``net``'s compiled train step."""
    x, y = np.zeros((BATCH, *image), np.float32), np.zeros(BATCH, np.int32)
    train, args = ready_step(net, x, y, **layout)
    memory = train.lower(*args).compile(FAST_COMPILE).memory_analysis()
    return memory.argument_size_in_bytes, memory.temp_size_in_bytes


def test_fsdp_blocks_gather_their_parameters_one_block_at_a_time():
    """Under FSDP and --remat the model's remat_block blocks gather their own split parameters
    inside their rematerialised region: a step holds one block's whole parameters (and
    gradient) at a time, not the model's, so its temporaries fall below the data-parallel
    step's (which hold the whole gradient) as its arguments do. Measured here, both with
    --remat=full: arguments 6.56 -> 0.87 MB, temporaries 13.08 -> 9.84 MB; gathering every
    parameter before the forward pass (the way before) held 13.45 MB of temporaries."""
    from estimax.models.vit import ViT

    # Wide and shallow, few tokens: the parameters (6.3 MB) dwarf the activations.
    net = functools.partial(
        ViT,
        num_classes=4,
        width=256,
        depth=2,
        mlp_dim=1024,
        num_heads=4,
        patch_size=8,
        head_zeroinit=False,
        remat="full",
    )
    args, temps = _train_step_bytes(net, (32, 32, 3), num_shards=8)
    split_args, split_temps = _train_step_bytes(net, (32, 32, 3), shard_parameters=0.01)
    params = 4 * (2 * (4 * 256 * 256 + 2 * 256 * 1024))
    assert split_args < args / 4, (split_args, args)
    assert split_temps < temps - params / 4, (split_temps, temps, params)
    # And the step is still the data-parallel one (its parity test is above, on ViTTiny).
