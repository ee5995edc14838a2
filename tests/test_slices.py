"""Multi-slice data parallelism (``RunConfig.num_slices`` / ``--num_slices``, issue #50).

In-process on the suite's 8 forced CPU devices (conftest): the hybrid mesh's shapes, the
two-stage gradient reduction in the compiled step (inside a slice, then across ``dcn``), and
two slices giving the one-slice step and run. The slices are simulated: CPU devices have no
``slice_index``, so a slice is a contiguous share of the processes (here: of one process's
devices).

Equality: the loss and every metric are reduced over all replicas at once (one all-reduce, the
same order as one slice): equal bitwise. The gradient's mean is summed per slice first, then
across slices, so its float32 additions are grouped differently from one all-reduce over 8
replicas ((a0+..+a3)+(a4+..+a7)): measured here, a step's parameters differed by at most
3e-8 (data parallel, FSDP and spatial alike; FSDP's loss by one ulp, its weight decay summed per
slice); the tolerance below allows that and nothing more (a mean off by the slice count is off
by ~1e-1).
"""

from __future__ import annotations

import functools
import os
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimax as ex
from estimax.estimator import batches, step_builder
from estimax.estimator.spec import ModeKeys
from estimax.parallel import layouts, replication
from estimax.state import restoring

BATCH = 16
ATOL = 1e-6
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1)))
        return nn.Dense(4)(nn.Dropout(0.25, deterministic=not train)(x))


def model_fn(features, labels, mode, params):
    logits = Mlp()(features, mode == ModeKeys.TRAIN)
    return ex.EstimatorSpec(
        mode=mode,
        loss=ex.losses.softmax_cross_entropy(logits, labels),
        optimizer=optax.sgd(1.0),
        predictions=logits,
        eval_metrics={"accuracy": ex.metrics.accuracy(labels, logits)},
        gradient_clip_norm=0.5,
        weight_decay=1e-3,
    )


def data(seed=0, n=BATCH):
    rs = np.random.RandomState(seed)
    return rs.randn(n, 8, 6).astype(np.float32), rs.randint(0, 4, n).astype(np.int32)


def one_step(**fields):
    """(loss, parameters after one SGD step, the compiled step's HLO) under ``fields``."""
    x, y = data()
    config = ex.RunConfig(model_dir="/tmp/unused", **fields)
    builder = step_builder.StepBuilder(model_fn, {}, config)
    mesh = builder.make_mesh()
    steps = builder.build(mesh, {ModeKeys.TRAIN: BATCH})
    rows = BATCH // layouts.num_replicas(mesh)
    state = restoring.train_state(steps, mesh, None, 0, (x[:rows], y[:rows]), None, "/tmp")
    features, labels = batches._transfer(mesh, steps.layout, ModeKeys.TRAIN, False)((x, y))
    rng = jax.device_put(steps.rng, replication.replicated(mesh))
    compiled = steps.train.lower(state, rng, features, labels).compile(FAST_COMPILE)
    state, out = compiled(state, rng, features, labels)
    return float(out.loss), jax.device_get(state.params), compiled.as_text()


@functools.cache
def one_slice() -> tuple[float, object, str]:
    """The plain data-parallel step over 8 replicas: what every layout over slices must give
    (FSDP and spatial partitioning give it too: tests/test_layouts.py)."""
    return one_step()


# ------------------------------------------------------------------ the mesh


def test_two_slices_make_a_hybrid_mesh_with_a_leading_dcn_axis():
    devices = jax.devices()
    mesh = ex.RunConfig(num_slices=2).layout.make_mesh(None)
    assert mesh.axis_names == ("dcn", "data")
    assert mesh.devices.shape == (2, 4)
    # Slice-major: a slice's replicas are neighbours, so one slice's rows of the batch are too.
    assert list(mesh.devices.flat) == devices
    assert layouts.num_replicas(mesh) == 8 and layouts.replicas_per_slice(mesh) == 4
    # Cores per replica stay inside a slice: (slices, replicas per slice, cores).
    spatial = ex.RunConfig(num_slices=2, num_cores_per_replica=2).layout.make_mesh(None)
    assert spatial.axis_names == ("dcn", "data", "model0")
    assert spatial.devices.shape == (2, 2, 2)
    assert {d.id for d in spatial.devices[0].flat} == {d.id for d in devices[:4]}
    # num_shards takes the same number of replicas from each slice.
    assert ex.RunConfig(num_slices=2, num_shards=4).layout.make_mesh(4).devices.shape == (2, 2)
    # One slice is the mesh it always was.
    assert ex.RunConfig().layout.make_mesh(None).axis_names == ("data",)


def test_the_batch_is_split_over_both_axes_and_fsdp_over_a_slice_only():
    layout = ex.RunConfig(num_slices=2, shard_parameters=1.0).layout
    assert layout.data_axes == ("dcn", "data")
    assert layout.describe() == "--num_slices=2 --fsdp_min_size_mb=1"
    x, y = data()
    assert layout.input_specs(x, y) == (
        jax.sharding.PartitionSpec(("dcn", "data")),
        jax.sharding.PartitionSpec(("dcn", "data")),
    )
    spatial = ex.RunConfig(
        num_slices=2, num_cores_per_replica=2, input_partition_dims=[[1, 2, 1, 1], None]
    ).layout
    assert spatial.input_specs(np.zeros((8, 4, 4, 3)), None)[0] == jax.sharding.PartitionSpec(
        ("dcn", "data"), "model0", None, None
    )
    # FSDP's split spec names "data" only: parameters are never split over the slices.
    state_leaf = {"w": np.zeros((1024, 512), np.float32)}
    assert layouts._split_spec(layout.param_dims(state_leaf, 4)["w"]) == (
        jax.sharding.PartitionSpec("data")
    )


# ------------------------------------------------------------------ the step


def _all_reduce_groups(hlo: str) -> list[str]:
    return [
        line.split("replica_groups=")[1].split("}}")[0] + "}}"
        for line in hlo.splitlines()
        if " all-reduce(" in line and "replica_groups={{" in line
    ]


def test_two_slices_give_the_one_slice_step_with_gradients_reduced_inside_a_slice_first():
    loss1, params1, hlo1 = one_slice()
    loss2, params2, hlo2 = one_step(num_slices=2)
    assert loss2 == loss1  # one all-reduce over every replica: the same order, bitwise
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params1), strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
    groups = _all_reduce_groups(hlo2)
    # The gradient's two stages: the 4 replicas of each slice, then each replica with its
    # counterpart in the other slice (what crosses DCN is one slice-reduced gradient).
    assert "{{0,1,2,3},{4,5,6,7}}" in groups
    assert "{{0,4},{1,5},{2,6},{3,7}}" in groups
    assert "{{0,4},{1,5},{2,6},{3,7}}" not in _all_reduce_groups(hlo1)


@pytest.mark.parametrize(
    "fields",
    [
        {"shard_parameters": 0.0005},
        {"num_cores_per_replica": 2, "input_partition_dims": [[1, 2, 1], None]},
    ],
    ids=["fsdp", "spatial"],
)
def test_fsdp_and_spatial_partitioning_inside_slices_give_the_one_slice_step(fields):
    # FSDP: the 8 replicas' plain step; spatial: its own 4 replicas of 2 cores on one slice.
    loss1, params1, _ = one_slice() if "shard_parameters" in fields else one_step(**fields)
    loss2, params2, hlo2 = one_step(num_slices=2, **fields)
    np.testing.assert_allclose(loss2, loss1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params1), strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
    # No all-gather crosses the slices: the parameters are whole within each slice.
    for line in hlo2.splitlines():
        if " all-gather(" in line and "replica_groups=" in line:
            assert "{0,4}" not in line and "4,5" not in line.split("{{")[1].split("}")[0]


def test_a_run_over_two_slices_equals_one_slice(tmp_path):
    x, y = data(1, 64)

    def input_fn(params):
        n = params["batch_size"]
        return ((x[i : i + n], y[i : i + n]) for i in range(0, len(x), n))

    results = []
    for slices in (1, 2):
        config = ex.RunConfig(
            model_dir=str(tmp_path / f"s{slices}"), num_slices=slices, iterations_per_loop=2
        )
        est = ex.Estimator(model_fn, config=config, train_batch_size=BATCH, eval_batch_size=BATCH)
        est.train(input_fn, max_steps=4)
        results.append(est.evaluate(input_fn))
    one, two = results
    assert two["global_step"] == one["global_step"] == 4
    assert two["accuracy"] == one["accuracy"]
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-6)


# ------------------------------------------------------------------ bad input


def test_slices_that_do_not_divide_the_devices_are_one_line():
    with pytest.raises(ValueError, match=r"^--num_slices=3 \(RunConfig.num_slices\) does not") as e:
        ex.RunConfig(num_slices=3).layout.make_mesh(None)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^--num_slices=0 .* must be a count"):
        ex.RunConfig(num_slices=0)


def test_megascale_variables_are_read_and_checked_against_the_flag(monkeypatch):
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "1")
    assert ex.RunConfig().num_slices == 2  # a TPU job's own count, with no flag
    assert ex.RunConfig(num_slices=2).layout.num_slices == 2
    with pytest.raises(ValueError, match=r"^--num_slices=4 .* disagrees with .*SLICES=2") as e:
        ex.RunConfig(num_slices=4)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "2")
    with pytest.raises(ValueError, match=r"^\$MEGASCALE_SLICE_ID=2 is not a slice of"):
        ex.RunConfig()
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "two")
    with pytest.raises(ValueError, match=r"^\$MEGASCALE_NUM_SLICES='two' is not a whole number"):
        ex.RunConfig()


def test_the_num_slices_flag_reaches_the_run_config_and_bad_values_are_usage_errors(monkeypatch):
    from absl import flags

    from estimax.programs import cli, configs, shared_flags

    fv = flags.FlagValues()
    shared_flags.define_tpu_flags(fv)
    fv(["program", "--num_slices=2"])
    assert configs.layout_fields(fv, None)["num_slices"] == 2
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "4")
    with pytest.raises(cli.UsageError, match=r"^--num_slices=2 .* disagrees with"):
        configs.layout_fields(fv, None)


def test_slices_that_do_not_divide_the_processes_are_one_line():
    # The devices of an 8-process job, one each (a process is a host of a slice): 3 slices
    # would split a host's share unevenly; 2 slices are 4 hosts each.
    devices = [types.SimpleNamespace(process_index=i, id=i, platform="cpu") for i in range(8)]
    with pytest.raises(ValueError, match=r"^--num_slices=3 .* does not divide this job's 8 proc"):
        replication.hybrid_devices(3, (), devices)
    grid = replication.hybrid_devices(2, (), devices)
    assert [[d.process_index for d in row] for row in grid] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize(
    "flags,env,line",
    [
        (["--num_slices=3"], {}, "FATAL: --num_slices=3 (RunConfig.num_slices) does not divide"),
        (
            ["--num_slices=2"],
            {"MEGASCALE_NUM_SLICES": "4", "MEGASCALE_SLICE_ID": "0"},
            "FATAL: --num_slices=2 (RunConfig.num_slices) disagrees with",
        ),
    ],
)
def test_the_program_says_bad_slices_in_one_line_and_exits_2(
    flags, env, line, tmp_path_factory, tmp_path, monkeypatch, capsys
):
    # The MNIST program on this process's 8 devices, stopped before anything is built.
    import multihost_helpers as mh
    from absl import flags as absl_flags

    from estimax.programs import cli, mnist

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    data_dir = mh.write_data(str(tmp_path_factory.getbasetemp() / "multihost_data"))
    fv = absl_flags.FlagValues()
    mnist.define_flags(fv)
    fv(["mnist", f"--data_dir={data_dir}", f"--model_dir={tmp_path / 'm'}", *flags])
    with pytest.raises(SystemExit) as e:
        cli._run(mnist.run_from_flags, fv, [], None, ["mnist"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    fatal = [x for x in err.splitlines() if x.startswith("FATAL:")]
    assert len(fatal) == 1 and fatal[0].startswith(line), err
    assert not (tmp_path / "m").exists()  # refused before the model_dir was touched


def test_mean_of_two_stages_is_the_mean_over_every_replica():
    # The strategy's reduction alone, on values whose sums are exact in float32.
    from jax.sharding import PartitionSpec as P

    from estimax.parallel import strategies

    mesh = ex.RunConfig(num_slices=2).layout.make_mesh(None)
    values = jnp.arange(8.0)
    reduce = jax.jit(
        jax.shard_map(
            lambda v: strategies.Replicated(("dcn", "data")).mean_gradients(v),
            mesh=mesh,
            in_specs=P(("dcn", "data")),
            out_specs=P(),
        )
    )
    assert float(reduce(values)[0]) == 3.5


# ------------------------------------------------------------------ 8 processes


@pytest.mark.slow
def test_two_slices_over_eight_processes_equal_one_slice(tmp_path, monkeypatch):
    """The MNIST program over 8 processes x 1 CPU device (a process is a host of a slice): 2
    slices of 4 hosts, told by the flag and by a TPU job's MEGASCALE_* variables, train and
    evaluate as 1 slice of 8. The pod-scale check of #50, run once, on 64 digits and 6 steps."""
    import multihost_helpers as mh

    # Fast XLA compiles in the children (tiny model: the machine code's speed is not tested).
    job_env = mh._job_env
    monkeypatch.setattr(
        mh,
        "_job_env",
        lambda data_dir, devices: {
            **job_env(data_dir, devices),
            # The session's cache (conftest): the 8 processes and any rerun compile once.
            **{k: os.environ[k] for k in ("JAX_COMPILATION_CACHE_DIR",) if k in os.environ},
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} "
            "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
        },
    )
    data_dir = mh.write_data(str(tmp_path / "data"))

    def kubeflow(slices):
        def env(process, port):
            found = {
                "JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
                "JAX_NUM_PROCESSES": "8",
                "JAX_PROCESS_ID": str(process),
            }
            if slices > 1:
                found.update(MEGASCALE_NUM_SLICES=str(slices), MEGASCALE_SLICE_ID=str(process // 4))
            return found

        return env

    results = {}
    for slices in (1, 2):
        procs = mh.run_job(
            8,
            data_dir,
            str(tmp_path / f"slices{slices}"),
            f"--num_slices={slices}",
            devices=8,
            cluster_env=kubeflow(slices),
            timeout=600,
        )
        mh.assert_ok(procs)
        results[slices] = mh.eval_results(procs[0].stderr)
    one, two = results[1], results[2]
    assert two["num_examples"] == one["num_examples"] == mh.NUM_EVAL
    assert two["accuracy"] == one["accuracy"]
    # The gradient's two-stage sum groups float32 additions differently (module docstring).
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    mh.assert_same_params(
        mh.params(str(tmp_path / "slices2")), mh.params(str(tmp_path / "slices1"))
    )
