"""The run every program ends in: ``run(job)``, its layout check and ``--compile_for``.

Each program is a model family (``estimax.programs.family``; listed in ``families``): it maps its
flags (``shared_flags``, its own) to a ``Job`` (``job``; ``Job.for_family`` takes the model, the
recorded flags and the export from the family), its configs (``configs``) and its input
(``inputs``), and calls ``run(job)``, the tail they share: take the writer lock of ``model_dir``
(``estimax.state.lock``), compare and record the model-shaping flags (``model_dir/flags.json``),
keep fake-data warnings in TensorBoard, build the Estimator, run the mode (``modes``), export
(``exports``), close, print the result line. The checks that need no Estimator (locations, data,
splits) run before it, in ``shared_flags.check_locations`` and ``inputs.check_data``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import flags

import estimax as ex
from estimax.programs import cli
from estimax.programs.cli import UsageError
from estimax.programs.configs import check_accumulation, resnet_style_configs
from estimax.programs.exports import export, image_export
from estimax.programs.family import Family
from estimax.programs.job import Job
from estimax.programs.modes import for_cluster_role, run_mode, write_run_description
from estimax.programs.shared_flags import check_locations, log_unused_tpu_flags
from estimax.state import lock


def check_layout(job: Job) -> None:
    """The layout's checks that need the devices and the image size, before anything runs:
    ``--num_cores_per_replica`` and ``--num_slices`` dividing the devices (and the processes),
    each split image side dividing by its
    entry (the served image; training batches are checked again when the first arrives).

    Raises:
      UsageError: one line naming the flag.
    """
    config = job.config
    if (
        config.num_cores_per_replica == 1
        and config.input_partition_dims is None
        and config.num_slices == 1
    ):
        return
    try:
        layout = config.layout
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
            # --warm_start_from: every variable, each of which the checkpoint must hold; one of
            # another shape (a new head: another --num_label_classes) starts fresh, as the flag
            # says (estimax.state.warm_start).
            warm_start_from=(
                ex.WarmStartSettings(job.warm_start_from, [".*"], allow_shape_mismatch=True)
                if job.warm_start_from
                else None
            ),
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

    Nothing is read or written: no data, no ``model_dir``. The steps are the ones a run's
    ``StepBuilder`` builds; a train step that does not fit is compiled again under other
    layouts (``estimax.compile.search``).

    Returns:
      the ``estimax.compile.compile.StepReport`` of each step.

    Raises:
      UsageError: an unknown topology, no libtpu, a batch that does not divide over the slice.
      DoesNotFit: a step does not fit (after searching for the largest batch that does).
    """
    # Imported here, not at the top: only --compile_for needs the compiler, and every process
    # of every run imports this module (tests/test_import_cost.py keeps it so).
    from estimax.compile import compile as compile_lib
    from estimax.compile import gpu_compile
    from estimax.compile import search as search_lib
    from estimax.estimator import step_builder

    config, topology = job.config, job.compile_for
    assert topology is not None  # run() calls this for --compile_for only
    if gpu_compile.is_gpu_target(topology):
        gpu_compile.use_cpu_backend()  # nothing runs here: no CUDA start, no traceback
    # The steps a run builds, under the run's layout on the slice's devices (this host may
    # have fewer devices than a replica's cores: nothing runs here).
    builder = step_builder.StepBuilder(job.model_fn, dict(job.params or {}), config)
    train_batch, eval_batch = job.batch_sizes
    batch_sizes = {ex.ModeKeys.TRAIN: train_batch, ex.ModeKeys.EVAL: eval_batch}
    try:
        reports = search_lib.compile_steps(
            builder, topology, compile_inputs(job), batch_sizes, search=True
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
            tries = search_lib.layout_alternatives(config, train, job.serving, job.remat)
            message += search_lib.other_layouts(builder, topology, compile_inputs(job), tries)
        raise DoesNotFit(message, reports)
    return reports


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
