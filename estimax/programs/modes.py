"""The modes a program runs (the original ``resnet_main.py``'s): ``train`` trains to
``train_steps``; ``eval`` follows the checkpoints a training job writes until the one at
``train_steps`` is evaluated; ``train_and_eval`` alternates ``steps_per_eval`` training steps and
a full evaluation, resuming where a previous run stopped. Also the mode of a cluster task and the
run description kept in TensorBoard."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import fsspec
from absl import logging

import estimax as ex
from estimax import storage
from estimax.programs.configs import LoopConfig


def checkpoint_path(model_dir: str, step: int) -> str:
    """The path ``Estimator.evaluate(checkpoint_path=...)`` takes for ``step`` in ``model_dir``."""
    from estimax.state import checkpoints

    return checkpoints.step_path(model_dir, step)


def evaluate_checkpoints(
    est: Any, eval_input_fn: Callable, loop: LoopConfig, clock: Callable[[], float] = time.monotonic
) -> dict[str, Any] | None:
    """``--mode=eval``: evaluates each new checkpoint until the one at ``train_steps``.

    As the original: ``for ckpt in checkpoints_iterator(model_dir, timeout=eval_timeout)``;
    a checkpoint removed (``keep_checkpoint_max``) before it is read is skipped.

    Returns:
      the last evaluation's results (None if no checkpoint appeared before the timeout).
    """
    from estimax.estimator import training
    from estimax.state import checkpoints

    where = checkpoints.checkpoint_dir(est.model_dir)
    fs, fs_path = fsspec.core.url_to_fs(est.model_dir)
    logging.info(
        "Waiting for checkpoints in %s (a training job's --model_dir=%s%s) and "
        "evaluating each new one until step %d; %s.",
        where,
        est.model_dir,
        "" if fs.exists(fs_path) else ", which does not exist yet",
        loop.train_steps,
        "no --eval_timeout: waiting as long as it takes"
        if loop.eval_timeout is None
        else f"giving up after --eval_timeout={loop.eval_timeout:g} s without a new one",
    )
    results = None
    for step in ex.checkpoints_iterator(est.model_dir, timeout=loop.eval_timeout):
        start = clock()
        try:
            # Recorded durably once its summaries are written: a restarted evaluator redoes an
            # evaluation that was cut off, and never repeats a recorded one.
            results = training.evaluate_once(
                est,
                step,
                functools.partial(
                    est.evaluate,
                    eval_input_fn,
                    steps=loop.eval_steps,
                    checkpoint_path=checkpoint_path(est.model_dir, step),
                ),
            )
        except FileNotFoundError:
            logging.info(
                "Checkpoint %s no longer exists, skipping checkpoint",
                checkpoint_path(est.model_dir, step),
            )
            continue
        logging.info("Eval results: %s. Elapsed seconds: %d", results, clock() - start)
        if step >= loop.train_steps:
            logging.info("Evaluation finished after training step %d", step)
            break
    return results


def run_mode(
    est: Any,
    train_input_fn: Callable,
    eval_input_fn: Callable,
    loop: LoopConfig,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any] | None:
    """Runs ``loop.mode`` (the original's main after the estimator is built).

    Returns:
      the last evaluation's results, or None when there was no evaluation.
    """
    if loop.mode == "eval":
        return evaluate_checkpoints(est, eval_input_fn, loop, clock)
    start = clock()
    results = None
    logging.info(
        "Training for %d steps (%.2f epochs in total). Current step %d.",
        loop.train_steps,
        loop.train_steps * loop.epochs_per_step,
        est.get_global_step(),
    )
    if loop.mode == "train":
        est.train(train_input_fn, max_steps=loop.train_steps)
    else:
        # Train to the next multiple of steps_per_eval, evaluate, repeat: by absolute step, so a
        # restarted job resumes the same schedule (the original's train(max_steps=next) loop).
        results, _ = ex.train_and_evaluate(
            est,
            ex.TrainSpec(train_input_fn, max_steps=loop.train_steps),
            ex.EvalSpec(eval_input_fn, steps=loop.eval_steps, every_steps=loop.steps_per_eval),
        )
    logging.info(
        "Finished training up to step %d. Elapsed seconds %d.",
        est.get_global_step(),
        clock() - start,
    )
    return results


def write_run_description(model_dir: str, notes: list[str] | tuple[str, ...]) -> None:
    """Keeps ``notes`` as a text summary (``run_description``) in TensorBoard's run."""
    storage.register_summary_writers()  # before tensorboardX: its clients stay out
    from tensorboardX import SummaryWriter

    writer = SummaryWriter(model_dir, filename_suffix=".description")
    writer.add_text("run_description", "\n\n".join(f"**WARNING** {n}" for n in notes), 0)
    writer.close()


def for_cluster_role(loop: LoopConfig) -> LoopConfig:
    """The mode for this process's task in a cluster spec (``$TF_CONFIG``, ``$CLUSTER_SPEC``).

    An evaluator task evaluates each checkpoint the training tasks write (``eval``); with an
    evaluator in the job, the training tasks only train, as TF's ``train_and_evaluate`` did.
    """
    from estimax.parallel import launch

    evaluator = launch.evaluator_task()
    if evaluator is not None:
        logging.info("%s: this process is the job's evaluator (mode eval).", evaluator)
        return dataclasses.replace(loop, mode="eval")
    if loop.mode == "train_and_eval" and launch.has_evaluator():
        logging.info(
            "The cluster spec has an evaluator task, which evaluates each checkpoint: this "
            "process only trains (mode train)."
        )
        return dataclasses.replace(loop, mode="train")
    return loop
