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

from estimax.estimator import losses, metrics
from estimax.estimator.checkpoints import checkpoints_iterator
from estimax.estimator.estimator import Estimator, NanLossError, TrainState, get_global_step
from estimax.estimator.export import TensorSpec
from estimax.estimator.inputs import numpy_input_fn
from estimax.estimator.replication import REPLICA_AXIS
from estimax.estimator.spec import (EstimatorSpec, EvalSpec, InputContext, ModeKeys, RunConfig,
                                    TrainSpec)
from estimax.estimator.training import train_and_evaluate

__all__ = [
    "Estimator", "EstimatorSpec", "EvalSpec", "InputContext", "ModeKeys", "NanLossError",
    "REPLICA_AXIS", "RunConfig", "TensorSpec", "TrainSpec", "TrainState", "checkpoints_iterator",
    "get_global_step", "losses", "metrics", "numpy_input_fn", "train_and_evaluate",
]
