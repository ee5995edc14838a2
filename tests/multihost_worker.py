"""One process of a test job: the MNIST program, with a fault injected into its training input.

The tests start it once per process (``python tests/multihost_worker.py --flags...``). The fault
is the test's, not the program's: ``ESTIMAX_TEST_FAULT=KIND:N`` makes this process's training
iterator, when it reads its N-th batch, send itself SIGTERM (``sigterm``: the preemption
notice), SIGKILL (``kill``: a host dying), block forever (``hang``: a host that stops
stepping) or hand over to the test (``wait``: print ``FAULT_READY`` and read a line from stdin,
while the test sends signals). ``kill:N:S`` first waits until the checkpoint of step S is
complete (saves are asynchronous: without it the kill could come before any checkpoint exists).
Without a fault this is ``python -m estimax.programs.mnist``.

``ESTIMAX_TEST_PREDICT=DIR``: once the program's run (train, evaluate) is done, the same
Estimator predicts every held-out digit (``Estimator.predict``, every process taking part) and
this process writes the rows it yielded to ``DIR/predict_<process>.json`` as
``[[row id, label, class], ...]``: the model's predictions carry each row's id and label through
(``features`` then hold them beside the image; training and evaluation are unchanged).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import job_cache  # noqa: E402

from estimax.programs import common, mnist  # noqa: E402


class FaultyIterator:
    """Forwards batches and the input position; injects the fault at the ``at``-th batch."""

    def __init__(self, iterator: Any, kind: str, at: int, after_step: int | None = None):
        self._iterator, self._kind, self._at, self._read = iterator, kind, at, 0
        self._after_step = after_step

    def get_state(self) -> dict:
        return self._iterator.get_state()

    def set_state(self, state: dict) -> None:
        self._iterator.set_state(state)

    def __iter__(self) -> FaultyIterator:
        return self

    def __next__(self) -> Any:
        self._read += 1
        if self._read == self._at:
            if self._kind == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            elif self._kind == "kill":
                if self._after_step is not None:
                    wait_for_checkpoint(self._after_step)
                os.kill(os.getpid(), signal.SIGKILL)
            elif self._kind == "hang":
                blocked_reading_input()
            elif self._kind == "wait":
                print("FAULT_READY", flush=True)
                sys.stdin.readline()
        return next(self._iterator)


def blocked_reading_input() -> None:
    """Never returns: the watchdog's stack dump shows this frame."""
    threading.Event().wait()


def wait_for_checkpoint(step: int) -> None:
    """Waits (at most 2 minutes) until ``--model_dir``'s checkpoint of ``step`` is complete."""
    model_dir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--model_dir="))
    # Orbax renames a local checkpoint to its step's name once it is complete.
    done = os.path.join(os.path.abspath(model_dir), "checkpoints", str(step))
    finished = threading.Event()
    for _ in range(2400):
        if os.path.isdir(done):
            return
        finished.wait(0.05)
    raise RuntimeError(f"checkpoint {done} never appeared")


def with_row_ids(make_model_fn: Any) -> Any:
    """``make_model_fn`` whose model also predicts each row's ``id`` and ``label`` when its
    features are ``{"image", "id", "label"}`` (the prediction's input); arrays as before."""

    def make(cfg: Any) -> Any:
        model_fn = make_model_fn(cfg)

        def wrapped(features: Any, labels: Any, mode: str, params: Any) -> Any:
            if not isinstance(features, dict):
                return model_fn(features, labels, mode, params)
            spec = model_fn(features["image"], labels, mode, params)
            rows = {"id": features["id"], "label": features["label"]}
            return dataclasses.replace(spec, predictions={**spec.predictions, **rows})

        return wrapped

    return make


def predict_after_run(out_dir: str) -> None:
    """Makes the program's run end with a prediction of every held-out digit, written to
    ``out_dir/predict_<process>.json`` (the rows this process yielded, in order)."""
    import jax
    import numpy as np

    import estimax as ex

    mnist.FAMILY = dataclasses.replace(
        mnist.FAMILY, make_model_fn=with_row_ids(mnist.FAMILY.make_model_fn)
    )
    run_mode = common.run_mode

    def run_then_predict(est: Any, train_input_fn: Any, eval_input_fn: Any, *a: Any) -> Any:
        results = run_mode(est, train_input_fn, eval_input_fn, *a)
        data_dir = next(f.split("=", 1)[1] for f in sys.argv if f.startswith("--data_dir="))
        images, labels = mnist.load_tfrecords(os.path.join(data_dir, "validation.tfrecords"))
        rows = ex.numpy_input_fn(
            {"image": images, "id": np.arange(len(labels), dtype=np.int32), "label": labels},
            shuffle=False,
            num_epochs=1,
        )
        yielded = [[int(p["id"]), int(p["label"]), int(p["classes"])] for p in est.predict(rows)]
        with open(os.path.join(out_dir, f"predict_{jax.process_index()}.json"), "w") as f:
            json.dump(yielded, f)
        return results

    common.run_mode = run_then_predict


def main() -> None:
    job_cache.share_compiled_programs()  # tests/job_cache.py says why
    if os.environ.get("ESTIMAX_TEST_PREDICT"):
        predict_after_run(os.environ["ESTIMAX_TEST_PREDICT"])
    fault = os.environ.get("ESTIMAX_TEST_FAULT")
    if fault:
        kind, at, *after = fault.split(":")
        program_input_fn = mnist.input_fn

        def input_fn(path: str, is_training: bool, skip_bad_records: bool) -> Any:
            fn = program_input_fn(path, is_training, skip_bad_records)
            if not is_training:
                return fn
            return lambda params: FaultyIterator(
                fn(params), kind, int(at), int(after[0]) if after else None
            )

        mnist.input_fn = input_fn
    mnist.run()


if __name__ == "__main__":
    main()
