"""The flags every program shares: the original's TPU/cloud flags, the layout flags and the run
flags, with one wording.

The programs keep the original's flag names and defaults; the flags below are the ones the
originals had for the TPU or the cloud. estimax accepts them so a user's command line runs as
written, and maps or explains each:

| original flag                         | in estimax                                              |
|---------------------------------------|---------------------------------------------------------|
| ``--num_cores`` / ``--num_shards``    | ``RunConfig.num_shards`` (replicas) when it is <= the   |
|                                       | number of JAX devices; else all devices, with a warning |
| ``--tpu``, ``--master``               | unused: JAX finds its devices; multi-host jobs call     |
|                                       | ``jax.distributed.initialize()``                        |
| ``--gcp_project``, ``--tpu_zone``     | unused (they located the TPU)                           |
| ``--use_tpu``                         | unused: the same code runs on TPU, GPU or CPU           |
| ``--transpose_input``, ``--data_format`` | unused: XLA picks layouts; models are NHWC           |
| ``--export_to_tpu``                   | unused: an export is lowered for cpu, cuda and tpu      |
"""

from __future__ import annotations

import jax
from absl import flags, logging

from estimax.compile.topologies import known_topologies
from estimax.models.layers import REMAT_CHOICES
from estimax.programs import cli, flagspec
from estimax.programs.cli import UsageError

MODES = ("train", "eval", "train_and_eval")


UNUSED_HELP = "Accepted for compatibility with the original's command lines; unused by estimax"


# The original's TPU/cloud flags (same names, defaults None/True), accepted and explained.
TPU_FLAGS = (
    flagspec.Bool(
        "use_tpu",
        True,
        f"{UNUSED_HELP}: the same code runs on whatever JAX backend is present (TPU, GPU or CPU).",
    ),
    flagspec.Str(
        "tpu",
        None,
        f"{UNUSED_HELP}: the Cloud TPU name (e.g. $TPU_NAME). JAX "
        "finds local TPU chips itself; multi-host jobs use jax.distributed.",
    ),
    flagspec.Str("gcp_project", None, f"{UNUSED_HELP} (it located the Cloud TPU)."),
    flagspec.Str("tpu_zone", None, f"{UNUSED_HELP} (it located the Cloud TPU)."),
)
# Compile the steps for a TPU slice instead of running them (estimax.compile.compile).
COMPILE_FOR_FLAG = flagspec.Str(
    "compile_for",
    None,
    "Compile this run's train and eval steps for a Cloud TPU slice or NVIDIA GPUs instead of "
    "running them (no TPU, GPU, network or data needed; needs libtpu: pip install -e '.[tpu]', "
    "or for GPUs JAX's CUDA plugin: pip install -e '.[gpu-compile]') and print per step "
    "whether it fits, its memory, work and roofline speed per device; if a step does not fit, "
    f"exit 2 naming the largest global batch that does. Topologies: "
    f"{known_topologies()}.",
)
# TPUConfig's model parallelism and FSDP (estimax.parallel.layouts; docs/layouts.md).
LAYOUT_FLAGS = (
    flagspec.Int(
        "num_cores_per_replica",
        1,
        "TPUConfig's num_cores_per_replica: the devices one model replica runs on (1, 2, 4, ..., "
        "128); the replicas are the devices (--num_cores/--num_shards, the total) divided by "
        "it. Each replica's cores hold the same weights; --input_partition_dims says how its "
        "images are split over them.",
        lower=1,
    ),
    flagspec.Str(
        "input_partition_dims",
        None,
        "TPUConfig's input_partition_dims for the images (NHWC; labels are not split): e.g. "
        "1,2,2,1 splits each image in 2 x 2 tiles over 4 cores per replica (spatial "
        "partitioning, for images too large for one device's memory). The entries multiply to "
        "--num_cores_per_replica and each split side must divide by its entry.",
    ),
    flagspec.Float(
        "fsdp_min_size_mb",
        None,
        "FSDP (big_vision's fsdp(min_size_to_shard_mb=...)): split every parameter of at least "
        "this many MiB, with its gradient, optimizer state and moving average, over the "
        "replicas (on its largest dimension that divides by their number); gathered whole "
        "for each step. Checkpoints restore under any layout. Default: off.",
        lower=0.0,
    ),
    flagspec.Int(
        "num_slices",
        None,
        "Multi-slice data parallelism (MaxText's dcn_data_parallelism, xpk --num-slices): the "
        "TPU slices the replicas are spread over, a leading 'dcn' mesh axis; gradients are "
        "reduced inside each slice before they cross the data-center network, and "
        "--num_cores_per_replica and FSDP stay inside a slice. Default: $MEGASCALE_NUM_SLICES "
        "where the job sets it, else 1. Must divide the processes and the devices. With "
        "--compile_for: compile for this many slices of that topology.",
        lower=1,
    ),
)
# The older programs' way to name the TPU.
MASTER_FLAG = flagspec.Str(
    "master", None, f"{UNUSED_HELP}: the TPU's gRPC address (e.g. $TPU_GRPC_URL)."
)


def define_tpu_flags(fv: flags.FlagValues, *, master: bool = True) -> None:
    """Defines the original's TPU/cloud flags and the many-hosts flags on ``fv``.

    Args:
      fv: the flag registry (``flags.FLAGS`` for a program, a fresh one in tests).
      master: also define ``--master`` (the older programs' way to name the TPU).
    """
    flagspec.define(
        fv, (*TPU_FLAGS, COMPILE_FOR_FLAG, *LAYOUT_FLAGS), (MASTER_FLAG,) if master else ()
    )
    cli.define_cluster_flags(fv)


def log_unused_tpu_flags(fv: flags.FlagValues) -> None:
    """Says, once, that the TPU-locating flags given on the command line are not needed."""
    given = [
        f"--{name}={fv[name].value}"
        for name in ("tpu", "master", "gcp_project", "tpu_zone")
        if name in fv and fv[name].present and fv[name].value
    ]
    if given:
        logging.info(
            "%s: not needed by estimax, which runs on the local JAX devices %s.",
            " ".join(given),
            jax.devices(),
        )


def resolve_num_shards(
    requested: int | None, flag_name: str, *, compile_only: bool = False
) -> int | None:
    """Maps ``--num_cores``/``--num_shards`` to ``RunConfig.num_shards``.

    Args:
      requested: the flag's value (the original's default 8 is the cores of one Cloud TPU).
      flag_name: for the message.
      compile_only: ``--compile_for``: the slice's devices, not this host's, are what
        ``requested`` is checked against (when the steps are compiled).

    Returns:
      ``requested`` if this job has that many devices (or with ``compile_only``); else None
      (every device), after a warning that names the flag, the value and the devices found.
    """
    available = jax.device_count()
    if requested is None:
        return None
    if requested < 1:
        raise UsageError(f"--{flag_name}={requested}: must be >= 1.")
    if requested > available and not compile_only:
        logging.warning(
            "--%s=%d but this job has %d %s device(s); using all %d. (The original's default "
            "8 was the cores of one Cloud TPU; set --%s to at most %d to silence this.)",
            flag_name,
            requested,
            available,
            jax.default_backend(),
            available,
            flag_name,
            available,
        )
        return None
    return requested


def run_flags(
    *,
    data_dir_default: str | None,
    data_dir_help: str,
    steps_per_eval_flag: str,
    precision_default: str,
) -> tuple[flagspec.Flag, ...]:
    """The flags every ImageNet program has, with one wording.

    Args:
      data_dir_default, data_dir_help: the program's ``--data_dir`` (the originals differ).
      steps_per_eval_flag: the name of the program's steps-between-evaluations flag.
      precision_default: the program's compute dtype.
    """
    return (
        flagspec.Str("data_dir", data_dir_default, data_dir_help),
        flagspec.Str(
            "model_dir",
            None,
            "Directory for checkpoints and TensorBoard summaries "
            "(local, gs:// or s3://; default $TPU_MODEL_DIR when a job runner sets "
            "it). One trainer at a time: a second one on the same directory stops.",
        ),
        flagspec.Enum(
            "mode",
            "train_and_eval",
            MODES,
            "train: train to --train_steps; eval: evaluate each new checkpoint in "
            "--model_dir until the one at --train_steps (another job trains); "
            f"train_and_eval: alternate --{steps_per_eval_flag} training steps and an "
            "evaluation.",
        ),
        flagspec.Int(
            "eval_timeout",
            None,
            "In eval mode, stop after this many seconds "
            "without a new checkpoint (default: wait for the one at --train_steps).",
            lower=0,
        ),
        flagspec.Str(
            "export_dir",
            None,
            "After training, publish the model for serving as "
            "the next numbered version under this directory (export_dir/1, 2, ...: "
            "`estimax serve --model_base_path=DIR` serves it; clients send JPEG/PNG "
            "bytes); with a moving average of the weights, the averaged weights are "
            "exported.",
        ),
        *COMMON_RUN_FLAGS,
        flagspec.Enum("precision", precision_default, ["bfloat16", "float32"], PRECISION_HELP),
    )


PRECISION_HELP = (
    "Compute dtype of the network (parameters and loss stay float32). On a "
    "CPU, bfloat16 convolutions run natively only where the CPU has bf16 "
    "instructions (AVX-512 bf16 or AMX); elsewhere (AVX2-only CPUs such as "
    "AMD Zen 2) they run as float32 kernels on bf16 values, one rounding back "
    "to bf16 each (`python -m estimax.ops.native status` says which), so "
    "float32 is as fast there."
)


# The part of the run flags that is the same, default included, in every ImageNet program.
COMMON_RUN_FLAGS = (
    flagspec.Bool(
        "skip_bad_records",
        False,
        "Skip (and count, with a warning) records "
        "that cannot be read or decoded instead of stopping.",
    ),
    # Issue #51: TensorFlow jobs glob the same data folder (train-*); a job writes the indexes it
    # builds into <model_dir>/shard_indexes unless this says otherwise.
    flagspec.Bool(
        "index_beside_data",
        False,
        "Write the index files of --data_dir shards that have none into the hidden folder "
        "<data_dir>/.estimax-index/ (which no train-* glob matches), for every later job, instead "
        "of <model_dir>/shard_indexes. Default: a job never writes into the data folder it reads.",
    ),
    flagspec.Bool(
        "skip_nonfinite_steps",
        False,
        "Skip (make no update for, and count in TensorBoard's "
        "train/nonfinite_skipped_steps and a warning) training steps whose loss or gradients "
        "are NaN/Inf, instead of stopping at the first one with the last good checkpoint kept.",
    ),
    flagspec.Int("keep_checkpoint_max", 5, "Number of recent checkpoints kept.", lower=1),
    # tf.estimator's warm_start_from (estimax.state.warm_start).
    flagspec.Str(
        "warm_start_from",
        None,
        "When --model_dir has no checkpoint yet, initialise the variables from this checkpoint: "
        "a TensorFlow checkpoint of the original ResNet/Inception (its model_dir, or "
        "model.ckpt-N) or an estimax model_dir. Variables of another shape (a new head: "
        "another number of classes) start fresh; the log lists what was loaded.",
    ),
    flagspec.Bool(
        "cpu_fast_ops",
        True,
        "Use estimax.ops' convolution and max-pool, whose "
        "gradients XLA:CPU runs several times faster; identical ops on GPU/TPU.",
    ),
    # Rematerialisation per block (estimax.parallel.remat.remat_block): not a model-shaping flag
    # (the parameters are the same), so a run may resume under another policy.
    flagspec.Enum(
        "remat",
        "none",
        REMAT_CHOICES,
        "Recompute each block's activations (residual, MBConv, Inception or encoder block) in "
        "the backward pass instead of keeping them: less memory, about one more forward pass "
        "of compute. none: keep all; full: keep only each block's input; or a "
        "jax.checkpoint_policies name (dots_saveable: keep convolution and matmul outputs). "
        "--compile_for reports the memory under the policy given.",
    ),
)


def define_run_flags(
    fv: flags.FlagValues,
    *,
    data_dir_default: str | None,
    data_dir_help: str,
    steps_per_eval_flag: str,
    precision_default: str,
) -> None:
    """Defines ``run_flags(...)`` on ``fv`` (see there for the arguments)."""
    flagspec.define(
        fv,
        run_flags(
            data_dir_default=data_dir_default,
            data_dir_help=data_dir_help,
            steps_per_eval_flag=steps_per_eval_flag,
            precision_default=precision_default,
        ),
    )


def check_locations(fv: flags.FlagValues) -> None:
    """Checks ``--model_dir`` (required unless ``--compile_for``) and ``--export_dir`` before any
    work (see cli)."""
    cli.check_location("model_dir", fv.model_dir, required=not fv.compile_for)
    cli.check_location("export_dir", fv.export_dir)
