"""Evaluation as a run of its own: one ``Estimator.evaluate`` call's loop over the batches.

Every batch's metrics accumulate on the devices (the running totals donated to the next batch's
step); with at most one batch queued behind the running one, memory does not grow with the
input. Every ``iterations_per_loop`` batches the label check reads its count and the user's hooks
see the metrics so far. With many hosts every process runs the same number of batches (each is
one collective computation): a host whose input has ended runs a fully masked batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from estimax.estimator import feeding, label_check
from estimax.estimator import loop as loop_lib
from estimax.estimator import steps as steps_lib
from estimax.estimator import summaries as summaries_lib
from estimax.estimator.spec import RunConfig
from estimax.estimator.step_builder import Steps
from estimax.parallel import distributed, replication


class EvaluationRun:
    """Runs one ``Estimator.evaluate`` call: the first batches read, the checkpoint restored,
    every batch's metrics accumulated, the results written and the hooks' ``end`` called."""

    def __init__(
        self,
        steps: Steps,
        mesh: Mesh,
        config: RunConfig,
        clock: Callable[[], float],
        global_batch: int,
        summaries: Callable[[], summaries_lib.Summaries] | None,
    ):
        """An evaluation with ``steps`` on ``mesh``.

        Args:
          steps: the Estimator's steps (``eval_first``, ``eval``).
          mesh, config, clock: the Estimator's.
          global_batch: ``eval_batch_size``.
          summaries: the writer of this evaluation's results (None on processes other than the
            chief); called once the results are known.
        """
        self.steps = steps
        self.mesh = mesh
        self.config = config
        self.clock = clock
        self.global_batch = global_batch
        self.summaries = summaries

    def run(
        self,
        feeder: feeding.DevicePrefetcher,
        sample: list[Any],
        run: loop_lib.Hooks,
        load: Callable[[Any], tuple[Any, int]],
    ) -> dict[str, Any]:
        """Evaluates ``feeder``'s batches with the variables ``load(sample rows)`` returns;
        the results (``Estimator.evaluate``'s)."""
        feeder.fill()  # the first batches: the model's shapes, and whether there is any
        empty = [i for i, has in enumerate(distributed.any_process(feeder.num_read > 0)) if not has]
        if empty:
            raise ValueError(
                "The eval input_fn produced no examples"
                + (
                    f" on process(es) {empty}: every host needs at least one."
                    if jax.process_count() > 1
                    else "."
                )
            )
        variables, step = load(sample[0])
        run.session.global_step = step
        run.started()
        totals, num_examples, invalid = self._eval_loop(feeder, variables, step, sample[0], run)
        results: dict[str, Any] = _metric_values(totals)
        results["global_step"] = int(step or 0)
        # Examples counted on every host, not only this one.
        results["num_examples"] = int(_sum_over_hosts(num_examples))
        if invalid is not None:
            results["invalid_labels"] = invalid  # left out of the loss and metrics above
        self._write_eval(results)
        run.session.results = results
        run.end()
        return results

    def _write_eval(self, results: dict[str, Any]) -> None:
        """Logs the results as the original did and writes them to TensorBoard (durably)."""
        global_step = results["global_step"]
        logging.info(
            "Saving dict for global step %d: %s",
            global_step,
            ", ".join(
                f"{k} = {v.tolist() if isinstance(v, np.ndarray) else v}"
                for k, v in sorted(results.items())
            ),
        )
        if self.summaries is not None:
            writer = self.summaries()
            values = {
                # The training run's tag is train/invalid_labels; this one's says eval.
                ("eval/invalid_labels" if k == "invalid_labels" else k): v
                for k, v in results.items()
                if k not in ("global_step", "num_examples")
            }
            writer.scalars(global_step, {k: v for k, v in values.items() if np.ndim(v) == 0})
            writer.tables(global_step, {k: v for k, v in values.items() if np.ndim(v) == 2})
            writer.flush()

    def _eval_loop(
        self,
        feeder: feeding.DevicePrefetcher,
        variables: Any,
        step: int,
        sample: Any,
        run: loop_lib.Hooks,
    ) -> tuple[steps_lib.EvalOutput, int, int | None]:
        """Accumulates the metrics of every batch; (totals on the devices, examples counted,
        examples with invalid labels left out, with ``allow_invalid_labels``; else None).
        Every ``iterations_per_loop`` batches the label check reads its count (it raises
        ``InvalidLabelError`` without the opt-in).

        With many hosts every process must run the same number of batches (each is one
        collective computation), though the hosts' shards may hold different numbers of
        examples: a host whose input has ended runs a batch again, fully masked.
        """
        step_array = jnp.asarray(step, jnp.int32)
        first_fn, accumulate = self.steps.eval_first, self.steps.eval
        per_loop, hooks = self.config.iterations_per_loop, bool(run.hooks)
        allow = self.config.allow_invalid_labels
        labels = label_check.EvalLabelCheck(allow)
        run.before_run(0)
        first = feeder.next()
        assert first is not None  # run() checked that the input has a batch
        totals, previous = first_fn(None, variables, step_array, *first.value)
        num_examples, batches, masked = first.info, 1, None
        del first
        endless = (
            None
            if feeder.limited
            else feeding.EndlessEvalInput(feeder.expected_batches, self.clock)
        )
        while True:
            if endless is not None:
                endless.check(batches, num_examples)
            fed = feeder.next()
            more = any(distributed.any_process(fed is not None))
            if batches % per_loop == 0:  # a loop's end: the label check's and the hooks' turn
                labels.check(loop_lib.to_host(totals.signals), batches)
                if hooks:
                    values = _metric_values(totals)
                    if run.after_run(batches - per_loop, batches, values) or not more:
                        break
                    run.before_run(batches)
            if not more:
                break
            if fed is None:  # this host's shard has ended; others still have examples
                masked = masked or self._masked_batch(sample)
                value = masked
            else:
                value, num_examples = fed.value, num_examples + fed.info
            totals, batch = accumulate(totals, variables, step_array, *value)
            fed = value = None
            jax.block_until_ready(previous)  # at most one batch queued behind the running one
            previous, batches = batch, batches + 1
        if hooks and batches % per_loop:
            run.after_run(batches - batches % per_loop, batches, _metric_values(totals))
        invalid = labels.check(loop_lib.to_host(totals.signals), batches, final=True)
        return totals, num_examples, invalid if allow else None

    def _masked_batch(self, sample: Any) -> Any:
        """A whole eval batch on the devices that counts nothing (its mask is all zeros)."""
        per_host = replication.per_host_batch(self.global_batch)
        host, mask, _ = replication.pad_batch(sample, per_host)
        return replication.to_device(
            (*host, np.zeros_like(mask)), self.mesh, P(replication.data_axes(self.mesh))
        )


def _metric_values(totals: steps_lib.EvalOutput) -> dict[str, Any]:
    """The values of accumulated eval metrics (a host sync): numbers, or arrays (a confusion
    matrix)."""
    values = {}
    for name, metric in loop_lib.to_host(totals.metrics).items():
        value = np.asarray(metric.compute())
        values[name] = float(value) if value.ndim == 0 else value
    return values


def _sum_over_hosts(value: int) -> int:
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.sum(multihost_utils.process_allgather(np.int64(value))))
