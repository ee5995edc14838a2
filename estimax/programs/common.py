"""The run every program ends in: ``run(job)``, its layout check and ``--compile_for``.

Each program is a model family (``estimax.programs.family``; listed in ``families``): it maps its
flags (``shared_flags``, its own) to a ``Job`` (``job``; ``Job.for_family`` takes the model, the
recorded flags and the export from the family), its configs (``configs``) and its input
(``inputs``), and calls ``run(job)``, the tail they share: take the writer lock of ``model_dir``
(``estimax.programs.lock``), compare and record the model-shaping flags (``model_dir/flags.json``),
keep fake-data warnings in TensorBoard, build the Estimator, run the mode (``modes``), export
(``exports``), close, print the result line. The checks that need no Estimator (locations, data,
splits) run before it, in ``shared_flags.check_locations`` and ``inputs.check_data``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import tempfile
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from absl import flags

import estimax as ex
from estimax.estimator import compile as compile_lib
from estimax.estimator import gpu_compile, layouts
from estimax.programs import cli, lock
from estimax.programs.cli import UsageError
from estimax.programs.configs import check_accumulation, resnet_style_configs
from estimax.programs.exports import export, image_export
from estimax.programs.family import Family
from estimax.programs.job import Job
from estimax.programs.modes import for_cluster_role, run_mode, write_run_description
from estimax.programs.shared_flags import check_locations, log_unused_tpu_flags


def check_layout(job: Job) -> None:
    """The layout's checks that need the devices and the image size, before anything runs:
    ``--num_cores_per_replica`` dividing the devices, each split image side dividing by its
    entry (the served image; training batches are checked again when the first arrives).

    Raises:
      UsageError: one line naming the flag.
    """
    config = job.config
    if config.num_cores_per_replica == 1 and config.input_partition_dims is None:
        return
    try:
        layout = layouts.Layout.from_config(config)
        layout.make_mesh(config.num_shards)
        features, _ = compile_inputs(job)
        shaped = jax.tree.map(
            lambda t: jax.ShapeDtypeStruct((1, *t.shape[1:]), t.dtype),
            features,
            is_leaf=lambda x: isinstance(x, ex.TensorSpec),
        )
        layout.input_specs(shaped, None)
    except ValueError as e:
        raise UsageError(str(e)) from None


def run(job: Job) -> dict[str, Any] | None:
    """The tail every program shares: model_dir checks and lock, the mode, export, print, close.

    Returns:
      the last evaluation's results, or None when there was no evaluation.
    """
    if job.compile_for:
        return {"compile_for": [r.as_dict() for r in compile_job(job)]}
    check_layout(job)
    check_accumulation(
        job.config,
        job.batch_sizes[0],
        job.config.num_shards or jax.device_count() // job.config.num_cores_per_replica,
    )
    job = dataclasses.replace(job, loop=for_cluster_role(job.loop))
    model_dir = job.config.model_dir
    training = job.loop.mode != "eval"
    if training and job.loop.export_dir and jax.process_count() > 1:
        # Each host predicts only its own shard, so the export's parity check (and the single
        # version directory every host would publish) needs one process. Said before training.
        raise UsageError(
            f"--export_dir with {jax.process_count()} processes: export from one process once "
            "training is done: run the same command as a single process (without "
            "--coordinator_address/--num_processes/--process_id) with --export_dir; it finds "
            "training finished and exports the latest checkpoint."
        )
    # Eval mode only reads model_dir: no writer lock. A multi-host job is one trainer: its
    # first process holds the lock and records the flags for all.
    writer = training and jax.process_index() == 0
    with lock.WriterLock(model_dir) if writer else contextlib.nullcontext():
        cli.check_model_dir(model_dir, job.program, job.model_flags, write=writer)
        if job.notes and jax.process_index() == 0:
            write_run_description(model_dir, job.notes)
        est = ex.Estimator(
            job.model_fn,
            job.config,
            params=job.params,
            train_batch_size=job.batch_sizes[0],
            eval_batch_size=job.batch_sizes[1],
            predict_batch_size=job.batch_sizes[1],
            warm_start_from=job.warm_start_from,
        )
        try:
            results = run_mode(
                est, job.input_fn(is_training=True), job.input_fn(is_training=False), job.loop
            )
            if training and job.loop.export_dir:
                export(est, job)
        finally:
            est.close()
    if results is not None:
        names, examples = job.metrics
        values = ", ".join(f"{name} = {results[name]:.4f}" for name in names)
        # An evaluation rebuilt from the event files (a damaged evaluations.json) has no count.
        counted = results.get("num_examples")
        print(
            f"Eval results at step {results['global_step']}: {values}"
            + (f" on {counted} {examples}" if counted is not None else "")
        )
    print(f"TensorBoard logs: tensorboard --logdir={est.model_dir}", flush=True)
    return results


def compile_inputs(job: Job) -> tuple[Any, Any]:
    """The (features, labels) a program's steps are compiled with: what it serves, int32 labels.

    The one place that says what a program's input batches look like to ``--compile_for``.
    """
    return job.serving, ex.TensorSpec((None,), np.int32)


class DoesNotFit(UsageError):
    """``--compile_for``: a step does not fit; the message names the largest batch that does."""

    def __init__(self, message: str, reports: list[Any]):
        super().__init__(message)
        self.reports = reports


def compile_job(job: Job) -> list[Any]:
    """``--compile_for``: compiles the job's train and eval steps for a TPU slice or GPUs, one
    line each.

    Nothing is read or written: no data, no ``model_dir`` (a temporary one if none is given).

    Returns:
      the ``estimax.estimator.compile.StepReport`` of each step.

    Raises:
      UsageError: an unknown topology, no libtpu, a batch that does not divide over the slice.
      DoesNotFit: a step does not fit (after searching for the largest batch that does).
    """
    config, topology = job.config, job.compile_for
    assert topology is not None  # run() calls this for --compile_for only
    if gpu_compile.is_gpu_target(topology):
        gpu_compile.use_cpu_backend()  # nothing runs here: no CUDA start, no traceback
    # The slice's devices replace this host's: the local Estimator holds no layout (this host
    # may have fewer devices than a replica's cores), the steps are built under the run's.
    local = dataclasses.replace(
        config,
        num_shards=1,
        num_cores_per_replica=1,
        input_partition_dims=None,
        shard_parameters=None,
    )
    with contextlib.ExitStack() as stack:
        if config.model_dir is None:
            local = dataclasses.replace(
                local, model_dir=stack.enter_context(tempfile.TemporaryDirectory())
            )
        est = ex.Estimator(
            job.model_fn,
            local,
            params=job.params,
            train_batch_size=job.batch_sizes[0],
            eval_batch_size=job.batch_sizes[1],
        )
        try:
            reports = est.compile_for(
                topology,
                *compile_inputs(job),
                num_shards=config.num_shards,
                search=True,
                layout_config=config,
            )
        except compile_lib.CompileForError as e:
            raise UsageError(f"--compile_for={topology}: {e}") from None
    for report in reports:
        print(report.line(), flush=True)
    failed = [r for r in reports if not r.fits]
    if failed:
        message = " ".join(compile_lib.describe_failure(r) for r in failed)
        train = next((r for r in failed if r.step == "train"), None)
        if train is not None:
            message += other_layouts(job, local, topology, train)
        raise DoesNotFit(message, reports)
    return reports


# FSDP's threshold that --compile_for tries (big_vision's and kauldron's usual 4 MiB).
TRY_FSDP_MIN_SIZE_MB = 4.0


class LayoutTry(NamedTuple):
    """One layout ``--compile_for`` tries: its flags, its RunConfig, the global batch, and the
    model_fn (None: the job's)."""

    flags: str
    config: Any
    batch: int
    model_fn: Callable | None
    # Tried only when none of the tries before it fits (the pair of two that do not fit alone).
    unless_one_fits: bool = False


def layout_alternatives(job: Job, train: Any) -> list[LayoutTry]:
    """The other layouts ``--compile_for`` tries for a train step that does not fit, in turn.

    Recomputing activations (``--remat=full``) and FSDP, at the batch asked for, then both
    together where neither fits alone (FSDP under ``--remat`` gathers one block's parameters at
    a time: ViT-L/16 with Adam at a large batch fits only so). Spatial partitioning does not
    lower a device's memory at the same global batch (each device still holds its share of the
    batch's activations, and a replica's cores hold whole weights), so it is tried only where
    no batch fits under data parallelism (``search.fits`` None): at a global batch of half the
    devices, each image split over 2 cores, a batch smaller than data parallelism can run.
    """
    config, batch, devices = job.config, train.global_batch, train.num_devices
    tries: list[LayoutTry] = []
    remat = None
    if job.remat is not None and job.remat[0] != "full":
        remat = LayoutTry("--remat=full", config, batch, job.remat[1]("full"))
        tries.append(remat)
    if config.shard_parameters is None and devices // config.num_cores_per_replica > 1:
        fsdp_flag = f"--fsdp_min_size_mb={TRY_FSDP_MIN_SIZE_MB:g}"
        fsdp = dataclasses.replace(config, shard_parameters=TRY_FSDP_MIN_SIZE_MB)
        tries.append(LayoutTry(fsdp_flag, fsdp, batch, None))
        if remat is not None:
            tries.append(LayoutTry(f"{remat.flags} {fsdp_flag}", fsdp, batch, remat.model_fn, True))
    features = job.serving
    if (
        train.search is not None
        and train.search.fits is None
        and config.num_cores_per_replica == 1
        and isinstance(features, ex.TensorSpec)
        and len(features.shape) == 4
        and features.shape[1] is not None
        and features.shape[1] % 2 == 0
        and devices % 2 == 0
    ):
        tries.append(
            LayoutTry(
                "--num_cores_per_replica=2 --input_partition_dims=1,2,1,1",
                dataclasses.replace(
                    config,
                    num_shards=devices // 2,
                    num_cores_per_replica=2,
                    input_partition_dims=[[1, 2, 1, 1], None],
                ),
                devices // 2,
                None,
            )
        )
    return tries


def other_layouts(job: Job, local: Any, topology: str, train: Any) -> str:
    """The tail of ``--compile_for``'s message for a train step that does not fit: each of
    ``layout_alternatives`` compiled (no search) and whether it fits, with its memory."""
    parts, one_fits = [], False
    for flags_text, config, batch, model_fn, unless_one_fits in layout_alternatives(job, train):
        if unless_one_fits and one_fits:
            continue
        est = ex.Estimator(
            model_fn or job.model_fn, local, params=job.params, train_batch_size=batch
        )
        try:
            (report,) = est.compile_for(
                topology,
                *compile_inputs(job),
                num_shards=config.num_shards,
                search=False,
                layout_config=config,
            )
        except compile_lib.CompileForError as e:
            parts.append(f"with {flags_text}: not tried ({e})")
            continue
        needed = compile_lib.needed_bytes(report)
        size = f"{compile_lib.size_text(needed)} per device" if needed else "its size unknown"
        at = f"{batch:,}"
        if report.fits:
            one_fits = True
            parts.append(f"{at} fits with {flags_text} ({size})")
        else:
            parts.append(f"{at} does not fit with {flags_text} either ({size})")
        print(f"with {flags_text}: {report.line()}", flush=True)
    return f" Other layouts: {'; '.join(parts)}." if parts else ""


def run_resnet_style_family(
    fv: flags.FlagValues,
    family: Family,
    make_inputs: Callable[[flags.FlagValues], tuple[Any, str | None, list[str]]],
    image_size: Callable[[flags.FlagValues], int],
) -> dict[str, Any] | None:
    """Flags -> config -> Estimator -> the mode loop, for a program whose input, eval crop and
    export are ResNet's (``efficientnet``, ``vit``). Returns the last eval results, if any."""
    from estimax.data import preprocessing
    from estimax.programs import logs

    logs.setup()
    cfg = family.config_from_flags(fv)
    log_unused_tpu_flags(fv)
    check_locations(fv)
    inputs, data_dir, notes = make_inputs(fv)
    config, loop = resnet_style_configs(fv, num_shards=None)
    return run(
        Job.for_family(
            family,
            fv,
            cfg,
            input_fn=inputs,
            notes=tuple(notes),
            batch_sizes=(fv.train_batch_size, fv.eval_batch_size),
            config=config,
            loop=loop,
            # The export is refused if its declared preprocessing differs from the input's.
            eval_preprocess=functools.partial(
                preprocessing.resnet_preprocess, is_training=False, image_size=image_size(fv)
            ),
            # The input hands the model the file's label - 1.
            **image_export(data_dir, 1, cfg.num_label_classes, cfg.precision),
        )
    )
