"""A program's ``RunConfig`` and ``LoopConfig`` from its flags, and the checks on them that need
no Estimator (the layout flags, gradient accumulation)."""

from __future__ import annotations

import dataclasses
from typing import Any

from absl import flags

import estimax as ex
from estimax.estimator import spec as spec_lib
from estimax.parallel import replication
from estimax.programs import cli
from estimax.programs.cli import UsageError
from estimax.programs.shared_flags import MODES


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """How a program drives its Estimator (the original's mode flags, gathered).

    Attributes:
      mode: ``train``, ``eval`` or ``train_and_eval``.
      train_steps: the global step training ends at (absolute; resumed runs continue to it).
      steps_per_eval: training steps between evaluations in ``train_and_eval``.
      eval_steps: eval batches per evaluation; None evaluates every eval example once.
      eval_timeout: ``eval`` mode stops after this many seconds without a new checkpoint
        (None: waits for the checkpoint at ``train_steps``).
      export_dir: after training, export the model for serving under this directory.
      epochs_per_step: for the 'Training for N steps (E epochs in total)' log line.
    """

    mode: str
    train_steps: int
    steps_per_eval: int
    eval_steps: int | None = None
    eval_timeout: float | None = None
    export_dir: str | None = None
    epochs_per_step: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"--mode={self.mode!r}: must be one of {', '.join(MODES)}.")
        if self.train_steps < 1:
            raise UsageError(f"--train_steps={self.train_steps}: must be >= 1.")
        if self.steps_per_eval < 1:
            raise UsageError(
                f"the steps between evaluations must be >= 1, got {self.steps_per_eval}."
            )

    @classmethod
    def from_flags(
        cls, fv: flags.FlagValues, *, steps_per_eval: int, eval_examples: int, train_examples: int
    ) -> LoopConfig:
        """The loop of an ImageNet program's flags (``define_run_flags`` and the batch sizes).

        Args:
          fv: parsed flags with ``mode``, ``train_steps``, ``train_batch_size``,
            ``eval_batch_size``, ``eval_timeout``, ``export_dir``.
          steps_per_eval: the program's steps-between-evaluations flag's value.
          eval_examples: evaluation examples (every one evaluated once).
          train_examples: examples per epoch (for the log line).
        """
        return cls(
            mode=fv.mode,
            train_steps=fv.train_steps,
            steps_per_eval=steps_per_eval,
            eval_steps=-(-eval_examples // fv.eval_batch_size),
            eval_timeout=fv.eval_timeout,
            export_dir=fv.export_dir,
            epochs_per_step=fv.train_batch_size / train_examples,
        )


def run_config(fv: flags.FlagValues, iterations_flag: str, **fields: Any) -> ex.RunConfig:
    """The ``RunConfig`` of the flags every program has, with the program's ``fields``.

    Args:
      fv: the parsed flags (``--model_dir``, ``--watchdog_timeout``, ``--profile_steps``,
        ``--steps_per_device_call``, ``--gradient_accumulation_steps`` and the program's
        ``iterations_flag``).
      iterations_flag: the name of the program's iterations-per-loop flag.
      **fields: the program's other ``RunConfig`` fields.

    Raises:
      UsageError: ``--steps_per_device_call`` above the steps per loop.
    """
    iterations = int(fv[iterations_flag].value or 1)  # never None: the flag has a default
    if fv.steps_per_device_call > iterations:
        raise UsageError(
            f"--steps_per_device_call={fv.steps_per_device_call} is more than "
            f"--{iterations_flag}={iterations}: a device call never crosses a loop's end."
        )
    fields.update(layout_fields(fv, fields.get("num_shards")))
    return ex.RunConfig(
        model_dir=fv.model_dir,
        iterations_per_loop=iterations,
        watchdog_timeout_secs=fv.watchdog_timeout,
        peer_timeout_secs=fv.peer_timeout if "peer_timeout" in fv else None,
        profile_steps=cli.profile_steps(fv),
        steps_per_device_call=fv.steps_per_device_call,
        gradient_accumulation_steps=fv.gradient_accumulation_steps,
        **fields,
    )


def layout_fields(fv: flags.FlagValues, num_cores: int | None) -> dict[str, Any]:
    """``RunConfig``'s layout fields from ``--num_cores_per_replica``, ``--input_partition_dims``
    and ``--fsdp_min_size_mb``, with ``num_shards`` as replicas: the original's ``--num_cores``
    (``num_cores``, resolved) counts every core, so it is divided by the cores per replica.

    Raises:
      UsageError: one line naming the flag (TPUConfig's checks, ``spec.check_layout``).
    """
    cores = fv.num_cores_per_replica
    dims: list[Any] | None = None
    if fv.input_partition_dims:
        try:
            dims = [[int(d) for d in fv.input_partition_dims.split(",")], None]
        except ValueError:
            raise UsageError(
                f"--input_partition_dims={fv.input_partition_dims}: give integers separated by "
                "commas, one per image dimension (NHWC), e.g. 1,2,2,1."
            ) from None
    try:
        spec_lib.check_layout(cores, dims, fv.fsdp_min_size_mb)
        # --num_slices against $MEGASCALE_*: one line before anything starts.
        slices = replication.num_slices_from(fv.num_slices)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if num_cores is not None and num_cores % cores:
        raise UsageError(
            f"--num_cores_per_replica={cores} does not divide the {num_cores} cores asked for "
            f"(--num_cores/--num_shards): use a multiple of {cores}."
        )
    return {
        "num_shards": None if num_cores is None else num_cores // cores,
        "num_cores_per_replica": cores,
        "input_partition_dims": dims,
        "shard_parameters": fv.fsdp_min_size_mb,
        "num_slices": slices,
    }


def resnet_style_configs(
    fv: flags.FlagValues, num_shards: int | None
) -> tuple[ex.RunConfig, LoopConfig]:
    """The RunConfig and loop of the flags resnet_main.py and EfficientNet's main.py share.

    ``--iterations_per_loop``, ``--save_checkpoints_steps`` (default max(100,
    iterations_per_loop), as both originals), ``--log_step_count_steps``, ``--steps_per_eval``,
    ``--num_eval_images``, ``--num_train_images`` and ``run_flags``' flags.
    """
    config = run_config(
        fv,
        "iterations_per_loop",
        num_shards=num_shards,
        save_checkpoints_steps=fv.save_checkpoints_steps or max(100, fv.iterations_per_loop),
        keep_checkpoint_max=fv.keep_checkpoint_max,
        log_step_count_steps=fv.log_step_count_steps,
        skip_nonfinite_steps=fv.skip_nonfinite_steps,
    )
    loop = LoopConfig.from_flags(
        fv,
        steps_per_eval=fv.steps_per_eval,
        eval_examples=fv.num_eval_images,
        train_examples=fv.num_train_images,
    )
    return config, loop


def check_accumulation(config: ex.RunConfig, train_batch: int, replicas: int) -> None:
    """A ``UsageError`` line when ``--gradient_accumulation_steps`` does not divide each
    replica's train batch (naming the flag and the values that do)."""
    # Here, not at the top: a program's flags (its --help, a bad flag's one line) need no step
    # builder (tests/test_import_cost.py).
    from estimax.estimator import step_builder

    try:
        step_builder.micro_batch(train_batch, replicas, config.gradient_accumulation_steps)
    except ValueError as e:
        raise UsageError(str(e)) from None
