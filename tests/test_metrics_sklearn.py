"""The original's metrics, exact over the whole eval set: equal to scikit-learn's.

The demo's digits (``estimax.tools.mnist_data``: 1,000 held-out digits) are evaluated with a
batch size that does not divide them (96 on 8 devices: the last batch is padded and masked).
AUC is streamed over thresholds (see ``metrics.auc``): it equals scikit-learn's on the scores
bucketed by those thresholds, and approaches scikit-learn's on the raw scores as they grow.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import estimax as ex
from estimax.estimator import metrics

sklearn_metrics = pytest.importorskip("sklearn.metrics")
mnist_data = pytest.importorskip("estimax.tools.mnist_data")

BATCH = 96  # 1,000 % 96 = 40: the last batch is partial
CLASS = 3  # the class of the one-vs-rest (binary) metrics


def model_fn(features, labels, mode, params):
    logits = nn.Dense(10)(features.astype(np.float32) / 255.0)
    probabilities = jax.nn.softmax(logits)
    if mode == ex.ModeKeys.PREDICT:
        return ex.EstimatorSpec(mode=mode, predictions={"probabilities": probabilities})
    is_class, score = labels == CLASS, probabilities[:, CLASS]
    weights = (labels % 3 + 1).astype(np.float32)
    m = ex.metrics
    return ex.EstimatorSpec(
        mode=mode,
        loss=ex.losses.softmax_cross_entropy(logits, labels),
        optimizer=optax.sgd(0.5),
        eval_metrics={
            "precision": m.precision(labels, logits),
            "precision_3": m.precision(labels, logits, class_id=CLASS),
            "precision_weighted": m.precision(labels, logits, weights),
            "recall": m.recall(labels, logits),
            "recall_3": m.recall(labels, logits, class_id=CLASS),
            "f1": m.f1_score(labels, logits),
            "f1_3": m.f1_score(labels, logits, class_id=CLASS),
            "f1_binary": m.f1_score(is_class, logits.argmax(-1) == CLASS),
            "mean_per_class_accuracy": m.mean_per_class_accuracy(labels, logits),
            "mean_iou": m.mean_iou(labels, logits.argmax(-1), num_classes=10),
            "confusion_matrix": m.confusion_matrix(labels, logits),
            "auc": m.auc(is_class, score),
            "auc_pr": m.auc(is_class, score, curve="PR"),
            "auc_10k": m.auc(is_class, score, num_thresholds=10_001),
            "auc_weighted": m.auc(is_class, score, weights),
        },
    )


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    (train_x, train_y), (eval_x, eval_y) = mnist_data.split(*mnist_data.load_mnist_5k())
    est = ex.Estimator(
        model_fn,
        ex.RunConfig(model_dir=str(tmp_path_factory.mktemp("run")), iterations_per_loop=10),
        train_batch_size=64,
        eval_batch_size=BATCH,
        predict_batch_size=BATCH,
    )
    est.train(ex.numpy_input_fn(train_x, train_y.astype(np.int32), seed=1), max_steps=30)
    results = est.evaluate(
        ex.numpy_input_fn(eval_x, eval_y.astype(np.int32), shuffle=False, num_epochs=1)
    )
    predicted = est.predict(ex.numpy_input_fn(eval_x, None, shuffle=False, num_epochs=1))
    probabilities = np.stack([p["probabilities"] for p in predicted])
    return results, eval_y, probabilities


def test_confusion_matrix_metrics_equal_scikit_learn_on_the_whole_eval_set(evaluated):
    results, y, probabilities = evaluated
    assert results["num_examples"] == len(y) == 1000
    pred = probabilities.argmax(-1)
    sk = sklearn_metrics
    w = (y % 3 + 1).astype(np.float64)
    expected = {
        "precision": sk.precision_score(y, pred, average="macro", zero_division=0),
        "precision_3": sk.precision_score(y == CLASS, pred == CLASS),
        "precision_weighted": sk.precision_score(
            y, pred, average="macro", sample_weight=w, zero_division=0
        ),
        "recall": sk.recall_score(y, pred, average="macro", zero_division=0),
        "recall_3": sk.recall_score(y == CLASS, pred == CLASS),
        "f1": sk.f1_score(y, pred, average="macro", zero_division=0),
        "f1_3": sk.f1_score(y == CLASS, pred == CLASS),
        "f1_binary": sk.f1_score(y == CLASS, pred == CLASS),
        "mean_per_class_accuracy": sk.balanced_accuracy_score(y, pred),
        "mean_iou": sk.jaccard_score(y, pred, average="macro", zero_division=0),
    }
    for name, value in expected.items():
        assert results[name] == pytest.approx(value, abs=1e-6), name
    np.testing.assert_array_equal(
        results["confusion_matrix"], sk.confusion_matrix(y, pred, labels=range(10))
    )
    # Not a trivial model: the metrics have something to tell apart.
    assert 0.5 < results["mean_per_class_accuracy"] < 1.0


def test_auc_equals_scikit_learn_on_the_thresholded_scores(evaluated):
    results, y, probabilities = evaluated
    score, positive = probabilities[:, CLASS], y == CLASS
    w = (y % 3 + 1).astype(np.float64)

    def bucketed(n: int) -> np.ndarray:
        # What the streamed AUC sees of a score: how many of its thresholds lie below it.
        return np.searchsorted(metrics.auc_thresholds(n), score.astype(np.float32), side="left")

    sk = sklearn_metrics
    assert results["auc"] == pytest.approx(sk.roc_auc_score(positive, bucketed(200)), abs=1e-6)
    assert results["auc_pr"] == pytest.approx(
        sk.average_precision_score(positive, bucketed(200)), abs=1e-6
    )
    assert results["auc_weighted"] == pytest.approx(
        sk.roc_auc_score(positive, bucketed(200), sample_weight=w), abs=1e-6
    )
    assert results["auc_10k"] == pytest.approx(
        sk.roc_auc_score(positive, bucketed(10_001)), abs=1e-6
    )
    # Against the raw scores (scikit-learn keeps every one): 200 thresholds merge nearby
    # scores, 10,001 thresholds much fewer.
    exact = sk.roc_auc_score(positive, score)
    assert abs(results["auc_10k"] - exact) <= abs(results["auc"] - exact) + 1e-9
    assert results["auc_10k"] == pytest.approx(exact, abs=1e-3)


def test_metrics_refuse_what_they_cannot_count():
    labels = np.array([0, 1, 2])
    with pytest.raises(ValueError, match="give num_classes="):
        metrics.precision(labels, labels)
    with pytest.raises(ValueError, match=r"class_id=5 is not in \[0, 3\)"):
        metrics.recall(labels, np.eye(3), class_id=5)
    with pytest.raises(ValueError, match="curve must be 'ROC' or 'PR'"):
        metrics.auc(labels == 1, np.zeros(3), curve="pr")
    with pytest.raises(ValueError, match="the positive class's probability"):
        metrics.auc(labels == 1, np.eye(3))
