"""``--compile_for``'s layout search: a train step that does not fit, compiled under other
layouts (``--remat=full``, FSDP, both, spatial partitioning), each a ``RunConfig`` whose layout
the step builder builds the steps under.

It takes a ``StepBuilder`` (what a run builds its steps with) and layout specs, not an
Estimator: nothing is read or written, no ``model_dir`` is needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from estimax.compile.compile import (
    CompileForError,
    StepReport,
    compile_for,
    needed_bytes,
    size_text,
)
from estimax.estimator.export import TensorSpec
from estimax.estimator.spec import ModeKeys
from estimax.estimator.step_builder import StepBuilder, Steps

# FSDP's threshold that --compile_for tries (big_vision's and kauldron's usual 4 MiB).
TRY_FSDP_MIN_SIZE_MB = 4.0


class LayoutTry(NamedTuple):
    """One layout ``--compile_for`` tries: its flags, its RunConfig (the layout spec), the
    global batch, and the model_fn (None: the builder's)."""

    flags: str
    config: Any
    batch: int
    model_fn: Callable | None
    # Tried only when none of the tries before it fits (the pair of two that do not fit alone).
    unless_one_fits: bool = False


def compile_steps(
    builder: StepBuilder,
    topology: str,
    io: tuple[Any, Any],
    batch_sizes: Mapping[str, int | None],
    search: bool = False,
) -> list[StepReport]:
    """Compiles the train and eval steps ``builder`` builds (under its config's layout,
    replicas and micro-batches) for ``topology``: ``compile.compile_for`` of each mode whose
    global batch in ``batch_sizes`` is not None.

    Args:
      builder: the steps' builder; its config's layout need not fit this host's devices.
      topology: e.g. ``v5e:2x4`` or ``h100:8``.
      io: ``(features, labels)``, ``TensorSpec`` pytrees of a batch (batch dimension None).
      batch_sizes: each mode's global batch (``ModeKeys``; None or absent: not compiled).
      search: for a step that does not fit, look for the largest batch that does.

    Raises:
      CompileForError: as ``compile.compile_for``.
    """
    config = builder.config
    sizes = {m: batch_sizes.get(m) for m in (ModeKeys.TRAIN, ModeKeys.EVAL, ModeKeys.PREDICT)}
    batches = {m: size for m, size in sizes.items() if m != ModeKeys.PREDICT and size is not None}

    def build(mesh: Any, mode: str, batch: int, accumulation_steps: int | None = None) -> Steps:
        return builder.build(mesh, {**sizes, mode: batch}, accumulation_steps)

    return compile_for(
        build,
        topology,
        io,
        batches,
        num_shards=config.num_shards,
        search=search,
        accumulation_steps=config.gradient_accumulation_steps,
        layout=builder.layout,
    )


def layout_alternatives(
    config: Any,
    train: StepReport,
    features: Any,
    remat: tuple[str, Callable[[str], Callable]] | None = None,
) -> list[LayoutTry]:
    """The other layouts ``--compile_for`` tries for a train step that does not fit, in turn.

    Recomputing activations (``--remat=full``) and FSDP, at the batch asked for, then both
    together where neither fits alone (FSDP under ``--remat`` gathers one block's parameters at
    a time: ViT-L/16 with Adam at a large batch fits only so). Spatial partitioning does not
    lower a device's memory at the same global batch (each device still holds its share of the
    batch's activations, and a replica's cores hold whole weights), so it is tried only where
    no batch fits under data parallelism (``search.fits`` None): at a global batch of half the
    devices, each image split over 2 cores, a batch smaller than data parallelism can run.

    Args:
      config: the run's RunConfig (its layout is the one that did not fit).
      train: the train step's report.
      features: the ``TensorSpec`` of the features (spatial splits need an NHWC image).
      remat: ``(the current --remat, model_fn under another --remat)``; None: no --remat.
    """
    batch, devices = train.global_batch, train.num_devices
    tries: list[LayoutTry] = []
    full = None
    if remat is not None and remat[0] != "full":
        full = LayoutTry("--remat=full", config, batch, remat[1]("full"))
        tries.append(full)
    if config.shard_parameters is None and devices // config.num_cores_per_replica > 1:
        fsdp_flag = f"--fsdp_min_size_mb={TRY_FSDP_MIN_SIZE_MB:g}"
        fsdp = dataclasses.replace(config, shard_parameters=TRY_FSDP_MIN_SIZE_MB)
        tries.append(LayoutTry(fsdp_flag, fsdp, batch, None))
        if full is not None:
            tries.append(LayoutTry(f"{full.flags} {fsdp_flag}", fsdp, batch, full.model_fn, True))
    if (
        train.search is not None
        and train.search.fits is None
        and config.num_cores_per_replica == 1
        and isinstance(features, TensorSpec)
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


def other_layouts(
    builder: StepBuilder, topology: str, io: tuple[Any, Any], tries: list[LayoutTry]
) -> str:
    """The tail of ``--compile_for``'s message for a train step that does not fit: each of
    ``tries`` (``layout_alternatives``) compiled (no search) and whether it fits, with its
    memory; each compiled one's report line printed."""
    parts, one_fits = [], False
    for flags_text, config, batch, model_fn, unless_one_fits in tries:
        if unless_one_fits and one_fits:
            continue
        tried = StepBuilder(model_fn or builder.model_fn, builder.params, config)
        try:
            (report,) = compile_steps(tried, topology, io, {ModeKeys.TRAIN: batch})
        except CompileForError as e:
            parts.append(f"with {flags_text}: not tried ({e})")
            continue
        needed = needed_bytes(report)
        size = f"{size_text(needed)} per device" if needed else "its size unknown"
        at = f"{batch:,}"
        if report.fits:
            one_fits = True
            parts.append(f"{at} fits with {flags_text} ({size})")
        else:
            parts.append(f"{at} does not fit with {flags_text} either ({size})")
        print(f"with {flags_text}: {report.line()}", flush=True)
    return f" Other layouts: {'; '.join(parts)}." if parts else ""
