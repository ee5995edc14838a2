"""One process of a test job that predicts: ``python tests/multihost_predict_worker.py PORT
NUM_PROCESSES PROCESS_ID MODEL_DIR OUT``.

Predicts two inputs (11 examples, then 9) with a global batch of 4 and writes what this process
yielded to ``OUT`` as JSON: ``{"examples": [...], "batches": [...]}`` per input.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import estimax as ex  # noqa: E402


def model_fn(features, labels, mode, params):
    dense = nn.Dense(2)(features["x"])
    return ex.EstimatorSpec(
        mode=mode, predictions={"i": features["i"], "y": features["x"][:, 0] * 2, "d": dense}
    )


def main() -> None:
    port, num_processes, process_id, model_dir, out = sys.argv[1:]
    if int(num_processes) > 1:
        jax.distributed.initialize(f"localhost:{port}", int(num_processes), int(process_id))
    est = ex.Estimator(model_fn, ex.RunConfig(model_dir), predict_batch_size=4)
    results = {}
    for n in (11, 9):
        x = np.arange(n, dtype=np.float32)[:, None] * np.ones([1, 3], np.float32)
        input_fn = ex.numpy_input_fn(
            {"i": np.arange(n, dtype=np.int32), "x": x}, shuffle=False, num_epochs=1
        )
        examples = [{"i": int(p["i"]), "y": float(p["y"])} for p in est.predict(input_fn)]
        batches = [
            b["i"].tolist()
            for b in est.predict(input_fn, predict_keys=["i"], yield_single_examples=False)
        ]
        results[str(n)] = {"examples": examples, "batches": batches}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
