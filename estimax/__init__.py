"""estimax: the TPUEstimator contract, reference models and ImageNet pipeline, on JAX.

The whole user contract (docs/contract.md; runnable: ``examples/contract.py``)::

    import estimax as ex

    def model_fn(features, labels, mode, params):   # traced; create Flax modules inside
        logits = MyNet()(features, train=mode == ex.ModeKeys.TRAIN)
        predictions = {"classes": logits.argmax(-1)}
        if mode == ex.ModeKeys.PREDICT:              # labels are None in PREDICT
            return ex.EstimatorSpec(mode=mode, predictions=predictions)
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(logits, labels),
            optimizer=optax.sgd(0.1),
            eval_metrics={"accuracy": ex.metrics.accuracy(labels, logits)},
            predictions=predictions)

    est = ex.Estimator(model_fn, ex.RunConfig(model_dir="run"), train_batch_size=128,
                       eval_batch_size=128, predict_batch_size=128)   # global batch sizes
    est.train(input_fn, max_steps=1000)
    est.evaluate(eval_input_fn)
    est.predict(predict_input_fn)
"""

import importlib
from typing import TYPE_CHECKING, Any

from estimax.version import __version__ as __version__

# The static mirror of _EXPORTS and _SUBMODULES below, for type checkers, IDEs and help();
# never run. tests/test_public_api.py checks that the two name the same objects.
if TYPE_CHECKING:
    from estimax.estimator import losses, metrics, summary
    from estimax.estimator.estimator import Estimator, NanLossError, TrainState, get_global_step
    from estimax.estimator.export import TensorSpec
    from estimax.estimator.hooks import (
        HookSession,
        LoggingTensorHook,
        ProfilerHook,
        SessionRunContext,
        SessionRunHook,
        SessionRunValues,
        StepCounterHook,
        StopAtStepHook,
        stop_if_no_decrease_hook,
        stop_if_no_increase_hook,
    )
    from estimax.estimator.inputs import numpy_input_fn
    from estimax.estimator.spec import (
        BestCheckpoint,
        EstimatorSpec,
        EvalSpec,
        InputContext,
        ModeKeys,
        RunConfig,
        TrainSpec,
    )
    from estimax.estimator.training import train_and_evaluate
    from estimax.export.exporters import BestExporter, Exporter, FinalExporter, LatestExporter
    from estimax.parallel.replication import REPLICA_AXIS
    from estimax.state.checkpoints import checkpoints_iterator
    from estimax.state.warm_start import WarmStartSettings

# Public name -> module that defines it. Imported on first use, so that `import estimax.data`
# in input worker processes does not pay for importing JAX (1.8 s and ~150 MB each).
_EXPORTS = {
    "Estimator": "estimax.estimator.estimator",
    "NanLossError": "estimax.estimator.estimator",
    "TrainState": "estimax.estimator.estimator",
    "get_global_step": "estimax.estimator.estimator",
    "BestCheckpoint": "estimax.estimator.spec",
    "EstimatorSpec": "estimax.estimator.spec",
    "EvalSpec": "estimax.estimator.spec",
    "InputContext": "estimax.estimator.spec",
    "ModeKeys": "estimax.estimator.spec",
    "RunConfig": "estimax.estimator.spec",
    "TrainSpec": "estimax.estimator.spec",
    "TensorSpec": "estimax.estimator.export",
    "HookSession": "estimax.estimator.hooks",
    "LoggingTensorHook": "estimax.estimator.hooks",
    "ProfilerHook": "estimax.estimator.hooks",
    "SessionRunContext": "estimax.estimator.hooks",
    "SessionRunHook": "estimax.estimator.hooks",
    "SessionRunValues": "estimax.estimator.hooks",
    "StepCounterHook": "estimax.estimator.hooks",
    "StopAtStepHook": "estimax.estimator.hooks",
    "stop_if_no_decrease_hook": "estimax.estimator.hooks",
    "stop_if_no_increase_hook": "estimax.estimator.hooks",
    "numpy_input_fn": "estimax.estimator.inputs",
    "REPLICA_AXIS": "estimax.parallel.replication",
    "checkpoints_iterator": "estimax.state.checkpoints",
    "train_and_evaluate": "estimax.estimator.training",
    "WarmStartSettings": "estimax.state.warm_start",
    "BestExporter": "estimax.export.exporters",
    "Exporter": "estimax.export.exporters",
    "FinalExporter": "estimax.export.exporters",
    "LatestExporter": "estimax.export.exporters",
}
_SUBMODULES = {
    "losses": "estimax.estimator.losses",
    "metrics": "estimax.estimator.metrics",
    "summary": "estimax.estimator.summary",
}

# The public names, as _EXPORTS and _SUBMODULES (tests/test_public_api.py checks that they agree).
__all__ = [
    "BestCheckpoint",
    "BestExporter",
    "Estimator",
    "EstimatorSpec",
    "EvalSpec",
    "Exporter",
    "FinalExporter",
    "HookSession",
    "InputContext",
    "LatestExporter",
    "LoggingTensorHook",
    "ModeKeys",
    "NanLossError",
    "ProfilerHook",
    "REPLICA_AXIS",
    "RunConfig",
    "SessionRunContext",
    "SessionRunHook",
    "SessionRunValues",
    "StepCounterHook",
    "StopAtStepHook",
    "TensorSpec",
    "TrainSpec",
    "TrainState",
    "WarmStartSettings",
    "checkpoints_iterator",
    "get_global_step",
    "losses",
    "metrics",
    "numpy_input_fn",
    "stop_if_no_decrease_hook",
    "stop_if_no_increase_hook",
    "summary",
    "train_and_evaluate",
]


# Hidden from type checkers, which would otherwise take any `estimax.<name>` as valid.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        """Imports a public name's module on first use (PEP 562)."""
        if name in _EXPORTS:
            return getattr(importlib.import_module(_EXPORTS[name]), name)
        if name in _SUBMODULES:
            return importlib.import_module(_SUBMODULES[name])
        raise AttributeError(f"module 'estimax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
