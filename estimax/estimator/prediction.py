"""Prediction as a run of its own: one ``Estimator.predict`` call's loop over the batches.

Streams: each batch's predictions are yielded while the next batches are read and run, with a
bounded number in flight, so memory does not depend on the input's length. The checkpoint is
restored once the first batch is read (its rows give the model's shapes).

With many processes every process runs the same batches (each is one collective computation):
a host whose input has ended runs its last batch again, all of it padding. Each global batch's
predictions are gathered (its real rows from every host, in process order: the hosts' blocks of
the global order, ``estimax.data.order``) and process 0 yields them, every example once, in
input order; the other processes yield nothing. Only one global batch of predictions is held
at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from estimax.estimator import feeding
from estimax.estimator import loop as loop_lib
from estimax.estimator.step_builder import Steps
from estimax.parallel import distributed, replication


class PredictionRun:
    """Runs one ``Estimator.predict`` call: yields every example's predictions (padding rows
    removed), calling the hooks once per batch. With many processes process 0 yields every
    example of the job, in input order, and the others nothing (module docstring)."""

    def __init__(self, steps: Steps, predict_keys: list[str] | None, yield_single_examples: bool):
        """A prediction with ``steps``.

        Args:
          steps: the Estimator's steps (``predict``).
          predict_keys: keep only these keys of a predictions dict.
          yield_single_examples: yield one value per example (else one per batch).
        """
        self.steps = steps
        self.predict_keys = predict_keys
        self.yield_single_examples = yield_single_examples

    def run(
        self,
        feeder: feeding.DevicePrefetcher,
        sample: list[Any],
        run: loop_lib.Hooks,
        load: Callable[[Any], tuple[Any, int]],
    ) -> Iterator[Any]:
        """Yields the predictions of ``feeder``'s batches with the variables ``load(sample
        rows)`` returns."""
        if jax.process_count() > 1:
            yield from self._run_many(feeder, sample, run, load)
            return
        predict_keys, yield_single_examples = self.predict_keys, self.yield_single_examples
        predict_fn = self.steps.predict
        variables = step_array = None
        pending: list[tuple[Any, int]] = []  # dispatched, not yet yielded
        # The next batch runs while this one's results are yielded; with hooks, one at a time
        # (each hook's before_run/after_run pair brackets one batch).
        depth = 1 if run.hooks else 2
        batches = 0
        while (fed := feeder.next()) is not None:
            if variables is None:
                variables, step = load(sample[0])
                step_array = jnp.asarray(step, jnp.int32)
                run.session.global_step = step
                run.started()
            run.before_run(batches)
            pending.append((predict_fn(variables, step_array, fed.value), fed.info))
            fed = None
            feeder.fill()
            if len(pending) >= depth:
                preds = _host_predictions(*pending.pop(0), predict_keys)
                batches += 1
                stop = run.after_run(batches - 1, batches, preds)
                yield from _examples(preds, yield_single_examples)
                if stop:
                    pending.clear()
                    break
        for preds, n in pending:
            yield from _examples(_host_predictions(preds, n, predict_keys), yield_single_examples)
        run.end()

    def _run_many(
        self,
        feeder: feeding.DevicePrefetcher,
        sample: list[Any],
        run: loop_lib.Hooks,
        load: Callable[[Any], tuple[Any, int]],
    ) -> Iterator[Any]:
        """``run`` with many processes: the same collectives in the same order on every process
        (how many real rows each host has, the step, the gather, whether a hook stops), one
        batch at a time. The hooks of every process see each global batch's predictions."""
        feeder.fill()  # the first batches: the model's shapes, and whether there is any
        empty = [i for i, has in enumerate(distributed.any_process(feeder.num_read > 0)) if not has]
        if empty:
            raise ValueError(
                f"The predict input_fn produced no examples on process(es) {empty}: every host "
                "needs at least one (fewer examples than hosts x a per-host batch? give predict "
                "a smaller predict_batch_size)."
            )
        variables, step = load(sample[0])
        step_array = jnp.asarray(step, jnp.int32)
        run.session.global_step = step
        run.started()
        chief = jax.process_index() == 0
        last = None  # this host's last batch on the devices: run again, as padding, once it ends
        batches = 0
        while True:
            fed = feeder.next()
            counts = _rows_over_hosts(0 if fed is None else int(fed.info))
            if not any(counts):
                break
            if fed is not None:
                last = fed.value
            run.before_run(batches)
            preds = self.steps.predict(variables, step_array, last)
            fed = None
            feeder.fill()  # the next batch is read while this one runs
            preds = _gathered(preds, counts, self.predict_keys)
            batches += 1
            stop = run.after_run(batches - 1, batches, preds)
            if chief:
                yield from _examples(preds, self.yield_single_examples)
            if any(distributed.any_process(bool(stop))):
                break
        run.end()


def _rows_over_hosts(n: int) -> list[int]:
    """Every process's real rows in this batch (0: its input has ended), in process order."""
    from jax.experimental import multihost_utils

    return [int(c) for c in np.asarray(multihost_utils.process_allgather(np.int32(n)))]


def _gathered(preds: Any, counts: list[int], predict_keys: list[str] | None) -> Any:
    """A global batch's predictions on every process: each host's real rows, in process order
    (a collective)."""
    from jax.experimental import multihost_utils

    local = _host_predictions(preds, None, predict_keys)  # this host's rows, padding included
    stacked = multihost_utils.process_allgather(local)  # [hosts, per-host rows, ...]
    return jax.tree.map(
        lambda x: np.concatenate([np.asarray(x)[h, :c] for h, c in enumerate(counts)]), stacked
    )


def _host_predictions(preds: Any, n: int | None, predict_keys: list[str] | None) -> Any:
    """A batch's predictions as host numpy, its ``n`` real rows (None: all), the keys asked
    for."""
    preds = jax.tree.map(lambda x: replication.to_local_numpy(x)[:n], preds)
    if isinstance(preds, dict) and predict_keys is not None:
        missing = [k for k in predict_keys if k not in preds]
        if missing:
            raise ValueError(
                f"predict_keys {missing} are not among the predictions {sorted(preds)}."
            )
        preds = {k: preds[k] for k in predict_keys}
    return preds


def _examples(preds: Any, single: bool) -> Iterator[Any]:
    """A batch's predictions, whole or one example at a time."""
    if not single:
        yield preds
        return
    n = int(np.shape(jax.tree.leaves(preds)[0])[0])
    for i in range(n):
        yield jax.tree.map(lambda x, i=i: x[i], preds)
