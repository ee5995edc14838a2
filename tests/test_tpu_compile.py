"""``--compile_for`` / ``Estimator.compile_for``: every program's steps compiled for a TPU slice.

The tests that need XLA's TPU compiler (libtpu, the ``tpu`` extra) run in ``make test``'s
``.venv-tpu`` (``ESTIMAX_REQUIRE_LIBTPU=1``: they fail there instead of skipping); in the default
venv they skip, and the ones that need no libtpu run (the batch search, the messages, the CUDA
lowering, and the line a user without libtpu sees).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from absl import flags

import estimax as ex
from estimax.compile import compile as compile_lib
from estimax.compile import search as search_lib
from estimax.estimator.step_builder import StepBuilder
from estimax.models.inception_v3 import InceptionV3Tiny
from estimax.models.inception_v4 import InceptionV4Tiny
from estimax.models.resnet import ResNetTiny
from estimax.ops import native
from estimax.programs import common, efficientnet, inception_v3, inception_v4, mnist, resnet, vit
from estimax.programs.configs import LoopConfig
from estimax.programs.job import Job

REPO = Path(__file__).resolve().parents[1]
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
if os.environ.get("ESTIMAX_REQUIRE_LIBTPU") and not HAS_LIBTPU:
    raise RuntimeError("ESTIMAX_REQUIRE_LIBTPU is set but libtpu is not installed")
needs_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU, reason="needs libtpu (the tpu extra; make test runs these in .venv-tpu)"
)
# A small slice: 4 chips. Batches below divide by 4 and by the 8 virtual CPU devices.
TOPOLOGY = "v5e:2x2"
# estimax.ops' oneDNN kernels: XLA:CPU custom calls, which no other backend has.
CPU_ONLY = re.compile(r"^estimax_onednn")

# program -> (module, argv, how the test swaps in the tiny network)
TINY = {
    "mnist": (mnist, ["--batch_size=8", "--eval_steps=1"]),
    "resnet": (resnet, ["--train_batch_size=8", "--eval_batch_size=8", "--image_size=32"]),
    "inception_v3": (
        inception_v3,
        ["--train_batch_size=8", "--eval_batch_size=8", "--width=107", "--height=107"],
    ),
    "inception_v4": (
        inception_v4,
        ["--train_batch_size=8", "--eval_batch_size=8", "--width=107", "--height=107"],
    ),
    "efficientnet": (
        efficientnet,
        ["--model_name=efficientnet-tiny", "--train_batch_size=8", "--eval_batch_size=8"],
    ),
    "vit": (vit, ["--model_name=vit-tiny", "--train_batch_size=8", "--eval_batch_size=8"]),
}


def run_program(program: str, argv: list[str], monkeypatch) -> tuple[object, list[Job]]:
    """Runs ``program``'s command line in-process with its tiny network; (result, jobs run)."""
    module, base = TINY[program]
    fv = flags.FlagValues()
    module.define_flags(fv)
    fv([program, *base, *argv])
    jobs: list[Job] = []
    compile_job = common.compile_job
    monkeypatch.setattr(common, "compile_job", lambda job: jobs.append(job) or compile_job(job))
    if program == "resnet":
        monkeypatch.setattr(
            resnet, "resnet_v1", lambda depth, classes, **kw: ResNetTiny(num_classes=classes, **kw)
        )
        return resnet.run_from_flags(fv), jobs
    if program.startswith("inception"):
        variant = inception_v3.V3 if program == "inception_v3" else inception_v4.V4
        tiny = InceptionV3Tiny if program == "inception_v3" else InceptionV4Tiny
        return inception_v3.run_from_flags(fv, dataclasses.replace(variant, model=tiny)), jobs
    return module.run_from_flags(fv), jobs


def steps_on_cpu(job: Job) -> tuple[ex.Estimator, compile_lib.Steps]:
    """The job's Estimator on this host's 8 CPU devices, and its steps at its batch sizes."""
    est = ex.Estimator(
        job.model_fn,
        dataclasses.replace(job.config, num_shards=None),
        params=job.params,
        train_batch_size=job.batch_sizes[0],
        eval_batch_size=job.batch_sizes[1],
    )
    return est, est.step_builder.build(est.mesh, est.batch_sizes)


def lowered_text(job: Job, step: str, platform: str | None) -> str:
    """The job's ``step`` lowered on the CPU mesh (``platform`` None), or exported for it."""
    est, steps = steps_on_cpu(job)
    io = common.compile_inputs(job)
    batch = job.batch_sizes[0 if step == "train" else 1]
    if platform is None:
        return compile_lib.lower(step, steps, est.mesh, io, batch).as_text()
    args = (compile_lib.train_args if step == "train" else compile_lib.eval_args)(
        steps, est.mesh, io, batch
    )
    fn = steps.train if step == "train" else steps.eval
    return jax.export.export(fn, platforms=(platform,))(*args).mlir_module()


@pytest.mark.parametrize("program", sorted(TINY))
def test_steps_lowered_for_cuda_have_no_cpu_only_custom_call(program, monkeypatch, tmp_path):
    monkeypatch.setattr(common, "compile_job", lambda job: jobs.append(job) or [])
    jobs: list[Job] = []
    run_program(program, [f"--compile_for={TOPOLOGY}", f"--model_dir={tmp_path}"], monkeypatch)
    (job,) = jobs
    for step in ("train", "eval"):
        cuda = compile_lib.custom_call_targets(lowered_text(job, step, "cuda"))
        assert not [t for t in cuda if CPU_ONLY.match(t)], (step, cuda)
    if native.available() and program in ("mnist", "resnet"):
        # The same step lowered for this CPU does call them: the check above can see them.
        cpu = compile_lib.custom_call_targets(lowered_text(job, "train", None))
        assert [t for t in cpu if CPU_ONLY.match(t)], cpu


@needs_libtpu
@pytest.mark.parametrize("program", sorted(TINY))
def test_every_program_compiles_for_a_tpu_slice_without_cpu_only_custom_calls(
    program, monkeypatch, capsys
):
    # XLA:TPU at its least optimisation effort: a quarter less compile time (inception_v4's
    # train step: 70 s of CPU down to 52, its eval step 14 down to 8). Which custom calls a step
    # holds comes from the ops its model uses, not from how hard the compiler schedules them.
    # (The layout test below compares layouts' memory: it keeps XLA's default effort.)
    effort = jax.config.jax_exec_time_optimization_effort
    jax.config.update("jax_exec_time_optimization_effort", -1.0)
    try:
        result, _ = run_program(program, [f"--compile_for={TOPOLOGY}"], monkeypatch)
    finally:
        jax.config.update("jax_exec_time_optimization_effort", effort)
    reports = result["compile_for"]
    assert [r["step"] for r in reports] == ["train", "eval"]
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for line, report in zip(lines, reports, strict=True):
        assert line.startswith(f"{report['step']} step on TPU v5 lite x4 ({TOPOLOGY}; global ")
        assert ": fits: " in line and "examples/s" in line
        assert report["fits"] and report["global_batch"] == 8
        assert report["flops"] > 0 and report["bytes_accessed"] > 0
        assert 0 < report["memory_bytes"] < report["hbm_bytes"] == 16 * 2**30
        assert report["roofline_s"] > 0 and report["examples_per_s"] > 0
        assert not [t for t in report["custom_calls"] if CPU_ONLY.match(t)], report
    if program == "resnet":  # the recipe computes in bfloat16
        assert "bf16" in reports[0]["dtypes"]


class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(x)


def dense_model_fn(features, labels, mode, params):
    logits = Dense()(features)
    loss = ex.losses.softmax_cross_entropy(logits, labels)
    import optax

    return ex.EstimatorSpec(
        mode=mode,
        loss=loss,
        optimizer=optax.sgd(0.1),
        eval_metrics={"accuracy": ex.metrics.accuracy(labels, logits)},
    )


@needs_libtpu
def test_a_step_that_does_not_fit_names_the_largest_batch_that_does(tmp_path):
    # 2**25 examples of 784 floats: 25 GiB of input per chip, more than a v5e chip's 16 GiB.
    too_big = 2**25
    job = Job(
        program="dense",
        model_flags={},
        model_fn=dense_model_fn,
        config=ex.RunConfig(model_dir=str(tmp_path), num_shards=None),
        batch_sizes=(too_big, 8),
        input_fn=lambda is_training: None,
        loop=LoopConfig(mode="train", train_steps=1, steps_per_eval=1),
        serving=ex.TensorSpec((None, 784), np.float32),
        metrics=(("accuracy",), "examples"),
        compile_for=TOPOLOGY,
    )
    with pytest.raises(common.DoesNotFit) as raised:
        common.run(job)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(
        f"the train step does not fit on {TOPOLOGY} at global batch {too_big:,}: "
    )
    exact = re.search(
        r"the largest global batch that fits is ([\d,]+) \(([\d,]+) does not", message
    )
    bracket = re.search(r"a global batch of ([\d,]+) fits and ([\d,]+) does not", message)
    fits, fails = (int(g.replace(",", "")) for g in (exact or bracket).groups())
    assert fits % 4 == 0 and fits < fails < too_big and (not exact or fails == fits + 4)
    # The input alone (784 float32 per example, a quarter of the batch per chip) nearly fills
    # the 15.75 GiB XLA may use of a v5e chip: the search went close to the limit.
    assert 0.9 * 15.75 * 2**30 < fits * 784 <= 15.75 * 2**30
    assert len(raised.value.reports) == 2 and not raised.value.reports[0].fits


class DenseLayers(nn.Module):
    """Eight dense layers: a block whose activations rematerialisation recomputes."""

    @nn.compact
    def __call__(self, x):
        for _ in range(8):
            x = nn.relu(nn.Dense(512)(x))
        return x


class DeepDense(nn.Module):
    remat: str = "none"

    @nn.compact
    def __call__(self, x):
        from estimax.parallel.remat import remat_block

        block = remat_block(DenseLayers, self.remat)
        for i in range(4):
            x = block(name=f"block{i}")(x)
        return nn.Dense(10)(x)


def deep_dense_model_fn(policy):
    import optax

    def model_fn(features, labels, mode, params):
        logits = DeepDense(policy)(features)
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(logits, labels),
            optimizer=optax.sgd(0.1),
            eval_metrics={"accuracy": ex.metrics.accuracy(labels, logits)},
        )

    return model_fn


# Activations, not weights (32 MiB) nor input (256 bytes an example), fill a v5e chip at this
# batch: 32 layers of 512 floats an example kept for the backward pass without remat, the 4
# blocks' inputs and one block's recomputation with --remat=full (measured at 1,572,864:
# 14.8 GiB a chip without, 7.7 GiB with).
DEEP_BATCH = 2**21


@needs_libtpu
def test_a_step_that_does_not_fit_says_which_layouts_make_it_fit(tmp_path, monkeypatch):
    # The batch search is the test above's: here it stops after one try and tries no
    # micro-batches (the real search, with its own limits set lower), so the compiles are the
    # ones this test checks, the other layouts; each fitting try at this batch is a full
    # compile (a failing one stops at memory assignment).
    monkeypatch.setattr(
        compile_lib, "largest_batch", functools.partial(compile_lib.largest_batch, max_compiles=1)
    )
    monkeypatch.setattr(
        compile_lib, "accumulated_fit", functools.partial(compile_lib.accumulated_fit, tries=0)
    )
    job = Job(
        program="deep_dense",
        model_flags={},
        model_fn=deep_dense_model_fn("none"),
        config=ex.RunConfig(model_dir=str(tmp_path), num_shards=None),
        batch_sizes=(DEEP_BATCH, 8),
        input_fn=lambda is_training: None,
        loop=LoopConfig(mode="train", train_steps=1, steps_per_eval=1),
        serving=ex.TensorSpec((None, 64), np.float32),
        metrics=(("accuracy",), "examples"),
        compile_for=TOPOLOGY,
        remat=("none", deep_dense_model_fn),
    )
    with pytest.raises(common.DoesNotFit) as raised:
        common.run(job)
    message = str(raised.value)
    assert "\n" not in message
    head, _, tail = message.partition(" Other layouts: ")
    assert head.startswith(f"the train step does not fit on {TOPOLOGY} at global batch ")
    remat = re.search(rf"{DEEP_BATCH:,} fits with --remat=full \(([\d.]+) GiB per device\)", tail)
    fsdp = re.search(
        rf"{DEEP_BATCH:,} does not fit with --fsdp_min_size_mb=4 either "
        r"\(([\d.]+) GiB per device\)",
        tail,
    )
    assert remat and fsdp, tail
    # Recomputing the blocks frees most of the activations; splitting the weights, little.
    assert float(remat.group(1)) < 16 < float(fsdp.group(1)), tail
    assert "input_partition_dims" not in tail  # a batch fits under data parallelism
    assert "--remat=full --fsdp" not in tail  # one alone fits: the pair is not compiled


def _report(batch: int, fits_somewhere: bool) -> compile_lib.StepReport:
    search = compile_lib.BatchSearch(
        fits=8 if fits_somewhere else None, fails=batch, multiple=8, compiles=3
    )
    return compile_lib.StepReport(
        step="train",
        topology="v5e:2x4",
        device_kind="TPU v5 lite",
        num_devices=8,
        devices_per_chip=1,
        global_batch=batch,
        dtypes="f32",
        fits=False,
        compile_s=1.0,
        search=search,
    )


def _image_job(**config) -> Job:
    return Job(
        program="images",
        model_flags={},
        model_fn=dense_model_fn,
        config=ex.RunConfig(model_dir="/tmp/unused", **config),
        batch_sizes=(64, 8),
        input_fn=lambda is_training: None,
        loop=LoopConfig(mode="train", train_steps=1, steps_per_eval=1),
        serving=ex.TensorSpec((None, 224, 224, 3), np.uint8),
        metrics=(("accuracy",), "examples"),
        remat=("none", lambda policy: dense_model_fn),
    )


def alternatives(job: common.Job, train: compile_lib.StepReport) -> list[search_lib.LayoutTry]:
    """The layouts ``--compile_for`` tries for ``job``'s train step that did not fit."""
    return search_lib.layout_alternatives(job.config, train, job.serving, job.remat)


def test_the_layouts_tried_for_a_step_that_does_not_fit():
    tried = alternatives(_image_job(), _report(64, fits_somewhere=True))
    assert [(t.flags, t.batch, t.unless_one_fits) for t in tried] == [
        ("--remat=full", 64, False),
        ("--fsdp_min_size_mb=4", 64, False),
        # Both together, where neither fits alone.
        ("--remat=full --fsdp_min_size_mb=4", 64, True),
    ]
    assert tried[0].model_fn is not None and tried[1].config.shard_parameters == 4
    assert tried[2].model_fn is tried[0].model_fn and tried[2].config.shard_parameters == 4
    # No batch fits as data parallelism runs it: half the devices' batch, each image in two.
    tried = alternatives(_image_job(), _report(8, fits_somewhere=False))
    spatial = tried[-1]
    assert spatial[0] == "--num_cores_per_replica=2 --input_partition_dims=1,2,1,1"
    assert spatial[2] == 4 and spatial[1].num_shards == 4
    assert spatial[1].input_partition_dims == [[1, 2, 1, 1], None]
    # What the run already does is not tried again.
    tried = alternatives(_image_job(shard_parameters=1.0), _report(64, fits_somewhere=True))
    assert [t.flags for t in tried] == ["--remat=full"]


def test_the_pair_of_layouts_is_compiled_only_when_neither_fits_alone(monkeypatch, capsys):
    # What the compiler answers is faked here (a real pair would take a large model and minutes
    # of compiles: bench/results/tpu_compile.md's vit_l16_3584 rows are that case): which tries
    # are compiled and how the message says them is what is tested.
    def remat_fn(features, labels, mode, params):  # the model_fn --remat=full builds
        return dense_model_fn(features, labels, mode, params)

    job = dataclasses.replace(_image_job(), remat=("none", lambda policy: remat_fn))

    def tried(fits):
        """(the tries compiled, the message's tail) when the compiler says ``fits`` fit."""
        compiled = []

        def compile_steps(builder, topology, io, batch_sizes, search=False):
            key = ("remat" if builder.model_fn is remat_fn else "") + (
                "fsdp" if builder.config.shard_parameters else ""
            )
            compiled.append(key)
            sizes = dict(argument_bytes=2**30, temp_bytes=2**30) if key in fits else {}
            report = dataclasses.replace(
                _report(64, True),
                fits=key in fits,
                search=None,
                peak_flops=197e12,
                hbm_bandwidth=819e9,
                hbm_bytes=16 * 2**30,
                error=None if key in fits else "the temporaries (20.00G) exceed HBM (15.75G).",
                **sizes,
            )
            return [report]

        monkeypatch.setattr(search_lib, "compile_steps", compile_steps)
        builder = StepBuilder(job.model_fn, {}, job.config)
        io = common.compile_inputs(job)
        tries = alternatives(job, _report(64, True))
        tail = search_lib.other_layouts(builder, "v5e:2x4", io, tries)
        capsys.readouterr()
        return compiled, tail

    compiled, tail = tried({"remat"})
    assert compiled == ["remat", "fsdp"], compiled
    assert "64 fits with --remat=full (" in tail and "--remat=full --fsdp" not in tail

    compiled, tail = tried({"rematfsdp"})
    assert compiled == ["remat", "fsdp", "rematfsdp"], compiled
    assert "64 does not fit with --remat=full either" in tail, tail
    assert "64 does not fit with --fsdp_min_size_mb=4 either" in tail, tail
    assert "64 fits with --remat=full --fsdp_min_size_mb=4 (" in tail, tail


def _fatal_lines(program: str, *args: str) -> list[str]:
    """The FATAL lines of ``python -m estimax.programs.PROGRAM ARGS``, which must exit 2."""
    proc = subprocess.run(
        [sys.executable, "-m", f"estimax.programs.{program}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    return [line for line in proc.stderr.splitlines() if line.startswith("FATAL")]


def test_unknown_topology_is_one_line_listing_the_known_ones():
    fatal = _fatal_lines("resnet", "--compile_for=v9:2x2")
    assert fatal == [
        "FATAL: --compile_for=v9:2x2: unknown TPU topology 'v9:2x2': known are "
        + compile_lib.known_topologies()
        + "."
    ]
    for name in compile_lib.KNOWN_TOPOLOGIES:
        assert name in fatal[0]


@pytest.mark.skipif(HAS_LIBTPU, reason="shows what a user without libtpu sees")
def test_without_libtpu_one_line_says_how_to_install_it():
    fatal = _fatal_lines("mnist", "--compile_for=v5e:2x4")
    assert fatal == [
        "FATAL: --compile_for=v5e:2x4: compiling for v5e:2x4 needs XLA's TPU compiler "
        f"(libtpu): {compile_lib.INSTALL_HINT}."
    ]


@pytest.mark.parametrize("module", [mnist, resnet, inception_v3, inception_v4, efficientnet])
def test_help_lists_the_known_topologies(module):
    fv = flags.FlagValues()
    module.define_flags(fv)
    for name in compile_lib.KNOWN_TOPOLOGIES:
        assert name in fv["compile_for"].help


def fake_step(
    batch: int, per_example: float, fixed: float, hbm: float, overstated: float = 1.0
) -> compile_lib.StepReport:
    """What compiling a step whose memory is ``fixed + per_example * batch`` reports; an
    out-of-memory error states ``overstated`` times that (XLA's need before rematerialising)."""
    need = fixed + per_example * batch
    report = compile_lib.StepReport(
        "train", "v5e:2x4", "TPU v5 lite", 8, 1, batch, "bf16", need <= hbm, 1.0, hbm
    )
    if report.fits:
        report.temp_bytes = int(need)
    else:
        report.error = oom_error(need * overstated, hbm)
    return report


def oom_error(need: float, hbm: float) -> str:
    """XLA:TPU's words (libtpu 0.0.42.1) for a step that needs ``need`` bytes of ``hbm``."""
    return (
        f"Ran out of memory on HBM, the total memory required for HLO temporaries "
        f"({need / 2**30:.2f}G) exceeds available HBM ({hbm / 2**30:.2f}G)."
    )


@pytest.mark.parametrize("fixed_gib", [0.1, 3.0, 12.0])
def test_the_batch_search_finds_the_largest_fitting_batch_in_few_compiles(fixed_gib):
    hbm, per_example, fixed = 16 * 2**30, 0.6e6, fixed_gib * 2**30
    tried: list[int] = []

    def probe(batch: int) -> compile_lib.StepReport:
        tried.append(batch)
        return fake_step(batch, per_example, fixed, hbm)

    failed = probe(65536)
    # tolerance=0: down to one multiple (8), as the default 2% would stop earlier.
    search = compile_lib.largest_batch(probe, failed, multiple=8, tolerance=0.0)
    largest = int((hbm - fixed) // per_example) // 8 * 8
    assert search.exact and (search.fits, search.fails) == (largest, largest + 8)
    assert search.compiles <= 6 and all(b % 8 == 0 for b in tried)
    failed.search = search
    assert compile_lib.describe_failure(failed) == (
        f"the train step does not fit on v5e:2x4 at global batch 65,536: the largest global "
        f"batch that fits is {largest:,} ({largest + 8:,} does not; found in "
        f"{search.compiles} compiles)."
    )


@pytest.mark.parametrize("largest", [1_024, 7_192, 9_000, 20_000])
def test_the_batch_search_brackets_the_limit_when_out_of_memory_errors_overstate(largest):
    # ResNet-50 on v5e at 65,536: the error said 205.84G needed, 13x what linear memory from a
    # fitting batch predicts; the plain secant crept up 8 compiles and never bracketed the limit.
    hbm = 15.75 * 2**30
    fixed = 0.3 * 2**30
    per_example = (hbm - fixed) / (largest + 4)  # batches up to `largest` fit
    tried: list[int] = []

    def probe(batch: int) -> compile_lib.StepReport:
        tried.append(batch)
        return fake_step(batch, per_example, fixed, hbm, overstated=13.0)

    search = compile_lib.largest_batch(probe, probe(65536), multiple=8)
    assert search.converged and search.fits is not None, tried
    assert search.fits <= largest < search.fails <= 1.02 * search.fits, tried
    assert search.compiles <= 6
    exact = compile_lib.largest_batch(probe, probe(65536), multiple=8, tolerance=0.0)
    assert (exact.fits, exact.fails) == (largest, largest + 8) and exact.compiles <= 8


def creeping_step(batch: int, limit: int, overstated: float = 1.0) -> compile_lib.StepReport:
    """ResNet-18 at 64 px on v5e:2x4 as recorded in issue 40: 14.6 GiB at 266,408 and 15.8 GiB
    at 305,832, more than the 15.75 GiB the out-of-memory error calls available, and batches
    up to ``limit`` fit: the line through two fits near the limit points just past the last."""
    hbm = 15.75 * 2**30
    need = 14.6 * 2**30 + 1.2 * 2**30 * (batch - 266_408) / (305_832 - 266_408)
    report = compile_lib.StepReport(
        "train", "v5e:2x4", "TPU v5 lite", 8, 1, batch, "bf16", batch <= limit, 1.0, hbm
    )
    if report.fits:
        report.temp_bytes = int(need)
    else:
        report.error = oom_error(need * overstated, hbm)
    return report


@pytest.mark.parametrize("overstated", [1.0, 3.0])
@pytest.mark.parametrize("limit", [305_900, 312_000, 330_000])
def test_the_batch_search_does_not_creep_when_the_line_points_just_past_the_last_fit(
    limit, overstated
):
    # Recorded: from 1,048,576 it tried 266,408 and 305,832 (both fit), then 305,840, 305,848,
    # 305,856, 305,864, 8 examples and ~5 min a compile. On these curves the search before
    # issue 40 spent its 12 compiles and stopped 2.9% (up to 245%) from the limit.
    tried: list[int] = []

    def probe(batch: int) -> compile_lib.StepReport:
        tried.append(batch)
        return creeping_step(batch, limit, overstated)

    search = compile_lib.largest_batch(probe, probe(1_048_576), multiple=8)
    assert search.converged and search.fits is not None, tried
    assert search.fits <= limit < search.fails <= 1.02 * search.fits, tried
    assert search.compiles <= 11 and len(set(tried)) == len(tried)
    # The fits, a full compile each (minutes): never one within 1% of another.
    fits = sorted(b for b in tried if b <= limit)
    assert len(fits) <= 6 and all(b > 1.01 * a for a, b in zip(fits, fits[1:], strict=False)), tried


def test_the_batch_search_prints_its_bracket_and_tolerance():
    failed = creeping_step(1_048_576, limit=312_000)
    failed.search = compile_lib.largest_batch(
        lambda b: creeping_step(b, limit=312_000), failed, multiple=8
    )
    # 313,056 / 308,584 = 1.0145: "within 1.5%", rounded up.
    assert compile_lib.describe_failure(failed) == (
        "the train step does not fit on v5e:2x4 at global batch 1,048,576: a global batch of "
        "308,584 fits and 313,056 does not (within 1.5% of the largest that fits; found in "
        "5 compiles)."
    )
    assert failed.as_dict()["search"]["converged"] is True
    failed.search = compile_lib.largest_batch(
        lambda b: creeping_step(b, limit=312_000), failed, multiple=8, max_compiles=2
    )
    assert compile_lib.describe_failure(failed) == (
        "the train step does not fit on v5e:2x4 at global batch 1,048,576: a global batch of "
        "293,720 fits and 421,368 does not (the largest is between them, 43.5% apart: not "
        "narrowed to 2% in 2 compiles)."
    )


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    limit=st.integers(64, 400_000),
    start=st.floats(1.1, 64.0),
    weights=st.floats(0.0, 0.9),
    overstated=st.floats(1.0, 20.0),
    measured=st.floats(0.9, 1.1),
    multiple=st.sampled_from([4, 8, 32]),
)
def test_the_batch_search_converges_within_its_stated_bound(
    limit, start, weights, overstated, measured, multiple
):
    # Memory linear in the batch: the weights' share of the chip, then activations up to the
    # chip's memory at `limit`. Errors overstate the need (XLA's, before rematerialising); a
    # fit measures up to 10% off the line (arguments and code beside the temporaries). On
    # 3,000 such curves from 1.1 to 64 times the limit: 9.8 compiles on average, 5.8 of them
    # fits (with fits measured as the errors say and no overstating: 5.0).
    hbm = 15.75 * 2**30
    fixed = weights * hbm
    per_example = (hbm - fixed) / limit
    limit = limit // multiple * multiple
    hypothesis.assume(limit >= multiple)
    tried: list[tuple[int, bool]] = []

    def probe(batch: int) -> compile_lib.StepReport:
        need = fixed + per_example * batch
        report = fake_step(batch, per_example, fixed, hbm, overstated)
        report.fits = batch <= limit
        report.temp_bytes, report.error = (
            (int(need * measured), None) if report.fits else (0, oom_error(need * overstated, hbm))
        )
        tried.append((batch, report.fits))
        return report

    asked = max(limit + multiple, int(start * limit) // multiple * multiple)
    search = compile_lib.largest_batch(probe, probe(asked), multiple=multiple)
    # Converged, or out of compiles (16) one step short: a fit measured 10% over the line, the
    # line undershooting every time, and a limit of ~60 multiples, where 2% is one multiple.
    assert search.converged or search.compiles == 16, tried
    assert search.fits is not None and search.fits <= limit < search.fails, tried
    assert all(b % multiple == 0 for b, _ in tried) and len(set(tried)) == len(tried)
    # The docstring's bound, from the first fit and the smallest failure before it.
    first = next(i for i, (_, fits) in enumerate(tried) if fits)
    b, big = tried[first][0], min(x for x, fits in tried[:first] if not fits)
    halvings = max(0, math.ceil(math.log2(math.log(big / b) / math.log(1.02))))
    assert len(tried) - 1 - first <= 4 * halvings, tried


def test_the_report_line_says_fit_memory_work_and_roofline():
    report = compile_lib.StepReport(
        "train", "v2:2x2", "TPU v2", 8, 2, 1024, "bf16", True, 268.0,
        hbm_bytes=8 * 2**30, argument_bytes=int(0.25 * 2**30), temp_bytes=int(4.25 * 2**30),
        code_bytes=int(0.5 * 2**30), flops=3.08e12, bytes_accessed=34.1e9,
        peak_flops=23e12, hbm_bandwidth=350e9, collectives={"all-reduce": [161, 218_000_000]},
    )  # fmt: skip
    # 3.08e12 / 23e12 = 134 ms (compute-bound; bytes: 97 ms): 1024 / 0.1339 = 7,647 images/s.
    assert report.line() == (
        "train step on TPU v2 x8 (v2:2x2; global batch 1,024, bf16): fits: 5.0 GiB of 8.0 GiB per "
        "device (args 0.2 GiB, temp 4.2 GiB, code 0.5 GiB); 3.08 TFLOP, 34.1 GB per device per "
        "step; roofline >= 134 ms/step = 7,647 examples/s (956 per device) at a dense bf16 peak "
        "of 23 TFLOP/s per device (v2: 46 per chip / 2 devices, https://cloud.google.com/tpu/docs/"
        "v2); collectives 161 all-reduce (0.2 GiB); compiled in 268 s"
    )
    assert report.as_dict()["bound"] == "compute"
    assert report.as_dict()["peak_tflops_per_device"] == 23
    assert (
        report.as_dict()["peak_source"]
        == "v2: 46 per chip / 2 devices, https://cloud.google.com/tpu/docs/v2"
    )


@needs_libtpu
def test_tpu7x_is_a_tpu_slice_of_two_devices_to_a_chip():
    """libtpu's name for Ironwood is tpu7x (not v7x): 4 chips, 8 TensorCores, each a device with
    half the chip's figures (issue #51: it was not a --compile_for name)."""
    assert compile_lib.check_topology("tpu7x:2x2x1") == "tpu7x"
    devices = compile_lib.slice_devices("tpu7x:2x2x1")
    assert len(devices) == 8 and {d.device_kind for d in devices} == {"TPU7x"}
    assert compile_lib.devices_per_chip(devices) == 2
    assert compile_lib.TPU_CHIPS["tpu7x"].bf16_tflops == 2307


def test_chip_table_has_every_generation_with_its_source():
    for gen in ("v2", "v3", "v4", "v5e", "v5p", "v6e", "tpu7x"):
        chip = compile_lib.TPU_CHIPS[gen]
        assert chip.source == f"https://cloud.google.com/tpu/docs/{gen}"
        assert chip.hbm_gib > 0 and chip.hbm_gbps > 0 and chip.bf16_tflops > 0
    assert compile_lib.check_topology("v5e:2x4") == "v5e"
    with pytest.raises(compile_lib.CompileForError, match="unknown TPU topology 'v5e-8'"):
        compile_lib.check_topology("v5e-8")


# ------------------------------------------------- gradient accumulation


def test_the_batch_search_says_when_the_batch_fits_as_k_micro_batches():
    # Activations per example dominate: the batch asked for fits as k micro-batches once a
    # micro-batch is no larger than the largest batch that fits. 65,536 over 8 devices.
    hbm, per_example, fixed = 16 * 2**30, 0.6e6, 0.5 * 2**30
    tried: list[tuple[int, int]] = []

    def compile_one(batch: int, accumulation_steps: int = 1) -> compile_lib.StepReport:
        tried.append((batch, accumulation_steps))
        micro = batch // accumulation_steps
        # The input batch (3 KB an example) stays whole; the activations are a micro-batch's.
        report = fake_step(micro, per_example + 3e3 * accumulation_steps, fixed, hbm)
        return dataclasses.replace(
            report, global_batch=batch, accumulation_steps=accumulation_steps
        )

    failed = compile_one(65536)
    search = compile_lib.largest_batch(lambda b: compile_one(b), failed, multiple=8)
    search = compile_lib.accumulated_fit(compile_one, failed, search)
    assert search.fits is not None and search.accumulated is not None
    k = search.accumulated
    # The largest batch that fits is ~27,500: k = 2 (micro-batch 32,768) is not tried, k = 4
    # (16,384) is, and fits.
    assert 65536 // k <= search.fits < 65536 // (k // 2)
    assert tried[-1] == (65536, k) and search.accumulated_bytes > 0
    failed.search = search
    assert compile_lib.describe_failure(failed).endswith(
        f"; 65,536 fits as {k} x {65536 // k:,} (--gradient_accumulation_steps={k}: "
        f"{compile_lib.size_text(search.accumulated_bytes)} per device)."
    )


def test_an_accumulated_report_line_names_its_micro_batches():
    report = compile_lib.StepReport(
        "train", "v5e:2x2", "TPU v5 lite", 4, 1, 4096, "f32", True, 3.0, accumulation_steps=8,
        hbm_bytes=16 * 2**30, peak_flops=197e12, hbm_bandwidth=819e9, flops=1e9,
    )  # fmt: skip
    assert report.micro_batch == 512 and report.as_dict()["micro_batch"] == 512
    assert "(v5e:2x2; global batch 4,096 = 8 x 512 accumulated, f32): fits:" in report.line()


def wide_model_fn(features, labels, mode, params):
    import optax

    logits = nn.Dense(10)(nn.relu(nn.Dense(4096)(features)))
    loss = ex.losses.softmax_cross_entropy(logits, labels)
    return ex.EstimatorSpec(mode=mode, loss=loss, optimizer=optax.sgd(0.1), predictions=logits)


@needs_libtpu
def test_compile_for_reports_an_accumulated_step_at_its_micro_batch_on_a_tpu_slice(tmp_path):
    io = (ex.TensorSpec((None, 64), np.float32), ex.TensorSpec((None,), np.int32))

    def train_report(batch: int, k: int) -> compile_lib.StepReport:
        config = ex.RunConfig(model_dir=str(tmp_path), gradient_accumulation_steps=k)
        est = ex.Estimator(wide_model_fn, config, train_batch_size=batch)
        return compile_lib.compile_estimator(est, TOPOLOGY, *io)[0]

    whole, accumulated, micro = (
        train_report(65536, 1),
        train_report(65536, 8),
        train_report(8192, 1),
    )
    assert accumulated.accumulation_steps == 8 and accumulated.micro_batch == 8192
    assert "global batch 65,536 = 8 x 8,192 accumulated" in accumulated.line()
    # Activations of 8,192 rows (2,048 per chip), not 65,536: the micro-batch's temporaries,
    # plus a float32 gradient accumulator the size of the weights (1.1 MiB).
    assert accumulated.temp_bytes < whole.temp_bytes / 4
    assert accumulated.temp_bytes < micro.temp_bytes + 4 * 2**20
    # The work of the whole batch (the loop's body counted k times).
    assert 0.9 < accumulated.flops / whole.flops < 1.1


@needs_libtpu
@pytest.mark.parametrize("name", ["mnist", "resnet"])
def test_a_users_shard_map_step_compiles_for_a_tpu_slice(name):
    # estimax's models inside a user's own jax.shard_map (tests/test_ops_in_user_programs.py),
    # compiled by XLA's TPU compiler: no CPU-only call reaches it.
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, os.path.dirname(__file__))
    from test_ops_in_user_programs import _setup, _shard_map_step

    model, _, params, x, loss = _setup(name)
    mesh = Mesh(np.array(compile_lib.slice_devices("v5e:2x2")[:2]), ("data",))
    step = jax.jit(_shard_map_step(model, loss, mesh))
    args = (
        jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())),
            params,
        ),
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("data"))),
    )
    compiled = step.trace(*args).lower().compile()
    assert not CPU_ONLY.search(compiled.as_text())


@needs_libtpu
@pytest.mark.parametrize("program", ["resnet", "vit"])
def test_each_layout_compiles_for_a_tpu_slice_and_its_report_shows_its_effect(
    program, monkeypatch, capsys
):
    """The slice's steps under the run's layout (mesh replicas x cores, the state placed as
    FSDP places it): spatial partitioning holds halo exchanges and fewer temporaries per
    device, FSDP gathers the parameters and holds fewer argument bytes per device."""
    layouts = {
        "default": [],
        "spatial": ["--num_cores_per_replica=2", "--input_partition_dims=1,2,1,1"],
        "fsdp": ["--fsdp_min_size_mb=0.001"],
    }
    batch = ["--train_batch_size=16", "--eval_batch_size=16"]
    train = {}
    for name, argv in layouts.items():
        result, _ = run_program(program, [f"--compile_for={TOPOLOGY}", *batch, *argv], monkeypatch)
        train[name] = result["compile_for"][0]
        lines = capsys.readouterr().out.strip().splitlines()
        assert len(lines) == 2 and all(": fits: " in line for line in lines), lines
        for flag in argv:  # the layout named in each line
            assert all(flag.split("=")[0] in line for line in lines), (flag, lines)
        assert train[name]["fits"] and train[name]["global_batch"] == 16
    default, spatial, fsdp = train["default"], train["spatial"], train["fsdp"]
    assert "collective-permute" not in default["collectives"]
    assert "all-reduce" in default["collectives"]  # the replicas' gradient mean
    if program == "resnet":  # convolutions over a split side exchange their halos
        assert spatial["collectives"]["collective-permute"][0] > 0, spatial["collectives"]
        assert spatial["temp_bytes"] < default["temp_bytes"]
    assert spatial["argument_bytes"] == pytest.approx(default["argument_bytes"], rel=0.05)
    assert fsdp["collectives"]["all-gather"][0] > 0, fsdp["collectives"]
    assert fsdp["argument_bytes"] < 0.6 * default["argument_bytes"], (fsdp, default)


def test_collectives_are_counted_with_the_bytes_they_produce():
    hlo = "\n".join(
        [
            "  %ar = f32[64,3]{1,0} all-reduce(f32[64,3]{1,0} %p), replica_groups={}",
            "  %ags = (bf16[8]{0}, bf16[32]{0}) all-gather-start(bf16[8]{0} %x), dimensions={0}",
            "  %agd = bf16[32]{0} all-gather-done((bf16[8]{0}, bf16[32]{0}) %ags)",
            "  %cp = f32[2,2]{1,0} collective-permute(f32[2,2]{1,0} %y), source_target_pairs={}",
            "  %add = f32[64,3]{1,0} add(f32[64,3]{1,0} %ar, f32[64,3]{1,0} %ar)",
        ]
    )
    assert compile_lib.collectives(hlo) == {
        "all-reduce": [1, 64 * 3 * 4],
        "all-gather": [1, (8 + 32) * 2],
        "collective-permute": [1, 16],
    }
