"""What the ImageNet programs (resnet, inception_v3, inception_v4) share: TPU flags, data_dir, modes.

The three programs keep the original's flag names and defaults; the flags below are the ones the
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

The modes are the original ``resnet_main.py``'s (ORIGINAL_SYSTEM.md §2.6): ``train`` trains to
``train_steps``; ``eval`` follows the checkpoints a training job writes until the one at
``train_steps`` is evaluated; ``train_and_eval`` alternates ``steps_per_eval`` training steps and a
full evaluation, resuming where a previous run stopped.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import jax
from absl import flags, logging

import estimax as ex

# resnet_main.py's default --data_dir (2018-12): a public bucket of fake ImageNet records. It
# cannot be reached here (no network), so it means local fake data (see resolve_data_dir).
FAKE_DATA_DIR = "gs://cloud-tpu-test-datasets/fake_imagenet"

MODES = ("train", "eval", "train_and_eval")

UNUSED_HELP = "Accepted for compatibility with the original's command lines; unused by estimax"


def define_tpu_flags(fv: flags.FlagValues, *, master: bool = True) -> None:
    """Defines the original's TPU/cloud flags (same names, defaults None/True) on ``fv``.

    Args:
      fv: the flag registry (``flags.FLAGS`` for a program, a fresh one in tests).
      master: also define ``--master`` (the older programs' way to name the TPU).
    """
    flags.DEFINE_bool("use_tpu", True, f"{UNUSED_HELP}: the same code runs on whatever JAX backend "
                      "is present (TPU, GPU or CPU).", flag_values=fv)
    flags.DEFINE_string("tpu", None, f"{UNUSED_HELP}: the Cloud TPU name. JAX finds local TPU chips "
                        "itself; multi-host jobs use jax.distributed.", flag_values=fv)
    flags.DEFINE_string("gcp_project", None, f"{UNUSED_HELP} (it located the Cloud TPU).",
                        flag_values=fv)
    flags.DEFINE_string("tpu_zone", None, f"{UNUSED_HELP} (it located the Cloud TPU).",
                        flag_values=fv)
    if master:
        flags.DEFINE_string("master", None, f"{UNUSED_HELP}: the TPU's gRPC address (e.g. "
                            "$TPU_GRPC_URL).", flag_values=fv)


def log_unused_tpu_flags(fv: flags.FlagValues) -> None:
    """Says, once, that the TPU-locating flags given on the command line are not needed."""
    given = [f"--{name}={fv[name].value}" for name in ("tpu", "master", "gcp_project", "tpu_zone")
             if name in fv and fv[name].present and fv[name].value]
    if given:
        logging.info("%s: not needed by estimax, which runs on the local JAX devices %s.",
                     " ".join(given), jax.devices())


def resolve_num_shards(requested: int | None, flag_name: str) -> int | None:
    """Maps ``--num_cores``/``--num_shards`` to ``RunConfig.num_shards``.

    Args:
      requested: the flag's value (the original's default 8 is the cores of one Cloud TPU).
      flag_name: for the message.

    Returns:
      ``requested`` if this job has that many devices; else None (every device), after a warning
      that names the flag, the value and the devices found.
    """
    available = jax.device_count()
    if requested is None:
        return None
    if requested < 1:
        raise ValueError(f"--{flag_name}={requested}: must be >= 1.")
    if requested > available:
        logging.warning(
            "--%s=%d but this job has %d %s device(s); using all %d. (The original's default "
            "8 was the cores of one Cloud TPU; set --%s to at most %d to silence this.)",
            flag_name, requested, available, jax.default_backend(), available, flag_name,
            available)
        return None
    return requested


def resolve_data_dir(data_dir: str | None, *, use_fake: bool = False) -> tuple[str | None, str]:
    """Returns ``(data_dir, fake_kind)`` for ``estimax.data.imagenet.input_fn``.

    * ``None``/``''``/``'null'``: the original's null input (zero images, label 0).
    * ``gs://cloud-tpu-test-datasets/fake_imagenet`` (resnet's default) or ``use_fake``: local
      random fake data; the public bucket is not reachable from here, and what it held (random
      images in the real format) is what local random data stands in for.
    * anything else: the real TFRecord files there.
    """
    if use_fake:
        return None, "random"
    if data_dir in (None, "", "null"):
        return None, "zeros"
    if data_dir.rstrip("/") == FAKE_DATA_DIR:
        logging.info("--data_dir=%s is the original's public fake ImageNet, which cannot be read "
                     "from here; using local random fake data of the same shapes instead.",
                     data_dir)
        return None, "random"
    return data_dir, "random"


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
            raise ValueError(f"--mode={self.mode!r}: must be one of {', '.join(MODES)}.")
        if self.train_steps < 1:
            raise ValueError(f"--train_steps={self.train_steps}: must be >= 1.")
        if self.steps_per_eval < 1:
            raise ValueError(f"the steps between evaluations must be >= 1, got "
                             f"{self.steps_per_eval}.")


def checkpoint_path(model_dir: str, step: int) -> str:
    """The path ``Estimator.evaluate(checkpoint_path=...)`` takes for ``step`` in ``model_dir``."""
    from estimax.estimator import checkpoints
    return os.path.join(checkpoints.checkpoint_dir(model_dir), str(step))


def evaluate_checkpoints(est: Any, eval_input_fn: Callable, loop: LoopConfig,
                         clock: Callable[[], float] = time.monotonic
                         ) -> dict[str, Any] | None:
    """``--mode=eval``: evaluates each new checkpoint until the one at ``train_steps``.

    As the original: ``for ckpt in checkpoints_iterator(model_dir, timeout=eval_timeout)``;
    a checkpoint removed (``keep_checkpoint_max``) before it is read is skipped.

    Returns:
      the last evaluation's results (None if no checkpoint appeared before the timeout).
    """
    results = None
    for step in ex.checkpoints_iterator(est.model_dir, timeout=loop.eval_timeout):
        start = clock()
        try:
            results = est.evaluate(eval_input_fn, steps=loop.eval_steps,
                                   checkpoint_path=checkpoint_path(est.model_dir, step))
        except FileNotFoundError:
            logging.info("Checkpoint %s no longer exists, skipping checkpoint",
                         checkpoint_path(est.model_dir, step))
            continue
        logging.info("Eval results: %s. Elapsed seconds: %d", results, clock() - start)
        if step >= loop.train_steps:
            logging.info("Evaluation finished after training step %d", step)
            break
    return results


def run(est: Any, train_input_fn: Callable, eval_input_fn: Callable, loop: LoopConfig,
        serving_input_fn: Callable[[], Any] | None = None,
        clock: Callable[[], float] = time.monotonic) -> dict[str, Any] | None:
    """Runs ``loop.mode`` (the original's main after the estimator is built), then exports.

    Args:
      est: the Estimator.
      train_input_fn, eval_input_fn: the input functions.
      loop: mode, steps, export settings.
      serving_input_fn: the features' spec for ``export_saved_model`` (``--export_dir``).
      clock: time source for the elapsed-seconds log lines.

    Returns:
      the last evaluation's results, or None when there was no evaluation.
    """
    start = clock()
    results = None
    if loop.mode == "eval":
        return evaluate_checkpoints(est, eval_input_fn, loop, clock)
    current = est.get_global_step()
    logging.info("Training for %d steps (%.2f epochs in total). Current step %d.",
                 loop.train_steps, loop.train_steps * loop.epochs_per_step, current)
    if loop.mode == "train":
        est.train(train_input_fn, max_steps=loop.train_steps)
    else:
        # Train to the next multiple of steps_per_eval, evaluate, repeat: by absolute step, so a
        # restarted job resumes the same schedule (the original's train(max_steps=next) loop).
        results, _ = ex.train_and_evaluate(
            est, ex.TrainSpec(train_input_fn, max_steps=loop.train_steps),
            ex.EvalSpec(eval_input_fn, steps=loop.eval_steps, every_steps=loop.steps_per_eval))
    logging.info("Finished training up to step %d. Elapsed seconds %d.", est.get_global_step(),
                 clock() - start)
    if loop.export_dir:
        if serving_input_fn is None:
            raise ValueError("--export_dir is set but the program has no serving input.")
        logging.info("Starting to export model.")
        path = est.export_saved_model(loop.export_dir, serving_input_fn)
        logging.info("Exported the model to %s", path)
    return results
