"""estimax: the TPUEstimator contract, reference models and ImageNet pipeline, on JAX.

The whole user contract::

    import estimax as ex

    def model_fn(features, labels, mode, params):   # traced; create Flax modules inside
        logits = MyNet()(features, train=mode == ex.ModeKeys.TRAIN)
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(logits, labels),
            optimizer=optax.sgd(0.1),
            eval_metrics={"accuracy": ex.metrics.accuracy(labels, logits)},
            predictions={"classes": logits.argmax(-1)})

    est = ex.Estimator(model_fn, ex.RunConfig(model_dir="run"), train_batch_size=128,
                       eval_batch_size=128)
    est.train(input_fn, max_steps=1000)
    est.evaluate(eval_input_fn)
"""

import importlib
from typing import Any

# Public name -> module that defines it. Imported on first use, so that `import estimax.data`
# in input worker processes does not pay for importing JAX (1.8 s and ~150 MB each).
_EXPORTS = {
    "Estimator": "estimax.estimator.estimator",
    "NanLossError": "estimax.estimator.estimator",
    "TrainState": "estimax.estimator.estimator",
    "get_global_step": "estimax.estimator.estimator",
    "EstimatorSpec": "estimax.estimator.spec",
    "EvalSpec": "estimax.estimator.spec",
    "InputContext": "estimax.estimator.spec",
    "ModeKeys": "estimax.estimator.spec",
    "RunConfig": "estimax.estimator.spec",
    "TrainSpec": "estimax.estimator.spec",
    "TensorSpec": "estimax.estimator.export",
    "numpy_input_fn": "estimax.estimator.inputs",
    "REPLICA_AXIS": "estimax.estimator.replication",
    "checkpoints_iterator": "estimax.estimator.checkpoints",
    "train_and_evaluate": "estimax.estimator.training",
}
_SUBMODULES = {"losses": "estimax.estimator.losses", "metrics": "estimax.estimator.metrics"}

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    raise AttributeError(f"module 'estimax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
