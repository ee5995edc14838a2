"""Image, histogram and text summaries: reduced over replicas on the device, read back by
TensorBoard's own reader."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import estimax as ex
from estimax.estimator import summaries as summaries_lib


def _reduced_over_replicas(batch: dict[str, np.ndarray]) -> dict:
    devices = jax.devices()
    mesh = Mesh(np.asarray(devices), ("r",))

    @partial(jax.shard_map, mesh=mesh, in_specs=P("r"), out_specs=P())
    def step(b):
        return ex.summary.reduce(
            {
                "inputs": ex.summary.image(b["images"], max_outputs=3),
                "logits": ex.summary.histogram(b["logits"], buckets=10),
                "predicted": ex.summary.text(b["classes"], vocabulary=("cat", "dog", "eel")),
            },
            "r",
        )

    return jax.jit(step)(batch), len(devices)


def test_summaries_are_reduced_over_all_replicas_and_read_back_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    rng = np.random.default_rng(0)
    n = 2 * len(jax.devices())
    batch = {
        "images": rng.integers(0, 256, size=(n, 6, 5, 3), dtype=np.uint8),
        "logits": rng.normal(size=(n, 7)).astype(np.float32),
        "classes": np.arange(n, dtype=np.int32) % 3,
    }
    reduced, replicas = _reduced_over_replicas(batch)
    hist = reduced["logits"]
    counts, _ = np.histogram(
        batch["logits"], bins=10, range=(batch["logits"].min(), batch["logits"].max())
    )
    np.testing.assert_array_equal(np.asarray(hist.counts), counts)  # every replica's values
    assert float(hist.totals[0]) == batch["logits"].size
    np.testing.assert_array_equal(np.asarray(reduced["inputs"].images), batch["images"][:3])

    writer = summaries_lib.Summaries(str(tmp_path))
    writer.summaries(7, reduced)
    writer.close()
    acc = event_accumulator.EventAccumulator(
        str(tmp_path), size_guidance={"images": 0, "histograms": 0, "tensors": 0}
    )
    acc.Reload()
    tags = acc.Tags()
    assert sorted(tags["images"]) == ["inputs/0", "inputs/1", "inputs/2"]
    image = acc.Images("inputs/1")[0]
    assert (image.step, image.width, image.height) == (7, 5, 6)
    (histo,) = acc.Histograms("logits")
    assert histo.step == 7 and histo.histogram_value.num == batch["logits"].size
    assert histo.histogram_value.min == pytest.approx(batch["logits"].min())
    text = acc.Tensors("predicted/text_summary")[0]  # tensorboardX's tag for text
    assert text.step == 7
    assert b"cat\n\ndog\n\neel\n\ncat" in text.tensor_proto.string_val[0]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ex.summary.image(jnp.zeros((2, 4, 4, 2))), r"C in \(1, 3, 4\)"),
        (lambda: ex.summary.histogram(jnp.zeros(3), buckets=0), "at least one bucket"),
    ],
)
def test_bad_summaries_are_one_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_non_summary_in_summaries_names_the_key():
    from estimax.estimator import summary

    with pytest.raises(TypeError, match=r"summaries=\{'lr': \.\.\.\}.*scalars="):
        summary.check({"lr": jnp.float32(0.1)})


def test_the_estimator_writes_spec_summaries_at_their_true_steps(tmp_path):
    import flax.linen as nn
    import optax
    from tensorboard.backend.event_processing import event_accumulator

    def model_fn(features, labels, mode, params):
        logits = nn.Dense(3)(features.reshape(features.shape[0], -1))
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(logits, labels),
            optimizer=optax.sgd(0.1),
            predictions=logits,
            summaries={
                "inputs": ex.summary.image(features, max_outputs=2),
                "logits": ex.summary.histogram(logits),
                "predicted": ex.summary.text(logits.argmax(-1), vocabulary=("a", "b", "c")),
            },
        )

    rng = np.random.default_rng(0)
    x = rng.random((32, 4, 4, 1)).astype(np.float32)
    y = rng.integers(0, 3, 32).astype(np.int32)
    config = ex.RunConfig(
        model_dir=str(tmp_path),
        iterations_per_loop=5,
        save_summary_steps=3,
        save_checkpoints_steps=5,
    )
    est = ex.Estimator(model_fn, config, train_batch_size=8)
    est.train(ex.numpy_input_fn(x, y), max_steps=10)
    acc = event_accumulator.EventAccumulator(
        str(tmp_path), size_guidance={"images": 0, "histograms": 0, "tensors": 0}
    )
    acc.Reload()
    # The first step and every third, as the scalars; loops of 5 do not change which.
    assert [e.step for e in acc.Images("inputs/0")] == [1, 3, 6, 9]
    assert [e.step for e in acc.Histograms("logits")] == [1, 3, 6, 9]
    assert [e.step for e in acc.Histograms("logits")] == [e.step for e in acc.Scalars("loss")]
    assert all(h.histogram_value.num == 8 * 3 for h in acc.Histograms("logits"))
    assert [e.step for e in acc.Tensors("predicted/text_summary")] == [1, 3, 6, 9]
