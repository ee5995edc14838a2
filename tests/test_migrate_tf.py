"""A ResNet-18 written by real TensorFlow -> ``estimax-convert`` -> ``resnet --mode=eval``.

Needs TensorFlow: `make test` runs this file in .venv-tf (the ``estimax[tf]`` extra); in the
default venv it is skipped. The TensorFlow model is the original ``resnet_model.py`` (in
scripts/make_tf_checkpoints.py, ``tf.layers`` at the root scope).
"""

import io
import os
import sys

import numpy as np
import pytest

# tf.compat.v1.layers (the original's tf.layers) need tf_keras's Keras 2.
os.environ["TF_USE_LEGACY_KERAS"] = "1"
if os.environ.get("ESTIMAX_REQUIRE_TF"):  # `make test` runs this in .venv-tf
    import tensorflow  # noqa: F401
tf = pytest.importorskip(
    "tensorflow", reason="TensorFlow runs in its own venv (`make test` builds .venv-tf)"
)

from absl import flags  # noqa: E402

from estimax import migrate  # noqa: E402
from estimax.data import example, imagenet, preprocessing, tfrecord  # noqa: E402
from estimax.programs import resnet  # noqa: E402
from estimax.state import checkpoints  # noqa: E402
from estimax.tools import convert  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import make_tf_checkpoints as original  # noqa: E402

tf1 = tf.compat.v1
SIZE, CLASSES, N = 64, 10, 16


def _jpegs(rng):
    from PIL import Image

    out = []
    for _ in range(N):
        # Smooth images (a gradient plus noise), so JPEG keeps them close to what was drawn.
        base = rng.integers(0, 256, (3,)) * np.linspace(0, 1, 80)[:, None, None]
        pixels = np.clip(base + rng.normal(0, 20, (80, 80, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=95)
        out.append(buf.getvalue())
    return out


def _write(data_dir, jpegs, labels):
    os.makedirs(data_dir, exist_ok=True)
    for split in ("train", "validation"):
        with tfrecord.TFRecordWriter(f"{data_dir}/{split}-00000-of-00001") as w:
            for jpeg, label in zip(jpegs, labels, strict=True):
                w.write(
                    example.encode_example(
                        {"image/encoded": [jpeg], "image/class/label": [int(label) + 1]}
                    )
                )


def _eval_images(data_dir):
    """The uint8 images ``resnet --mode=eval`` feeds its model (estimax's eval pipeline)."""
    fn = imagenet.input_fn(
        data_dir, False, image_size=SIZE, preprocessing="resnet", num_classes=CLASSES
    )
    images = []
    for batch in fn({"batch_size": N}):
        images.append(np.asarray(batch[0]))
        break
    return np.concatenate(images)[:N]


def test_tf_resnet18_converts_evaluates_to_tfs_accuracy_and_trains_on(tmp_path):
    rng = np.random.default_rng(7)
    data_dir = str(tmp_path / "data")
    jpegs = _jpegs(rng)
    _write(data_dir, jpegs, np.zeros(N, np.int64))
    images = _eval_images(data_dir)
    assert images.shape == (N, SIZE, SIZE, 3) and images.dtype == np.uint8

    tf_dir = str(tmp_path / "tf_model")
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, SIZE, SIZE, 3])
        y = tf1.placeholder(tf.int32, [None])
        # The original normalises in model_fn: (x - MEAN_RGB) / STDDEV_RGB, in [0, 255] units.
        normed = (x - np.array(preprocessing.MEAN_RGB, np.float32)) / np.array(
            preprocessing.STDDEV_RGB, np.float32
        )
        logits = original.resnet_v1(
            normed, original.residual_block, [2, 2, 2, 2], CLASSES, is_training=False
        )
        step = tf1.train.get_or_create_global_step()
        loss = tf1.losses.sparse_softmax_cross_entropy(y, logits)
        train = tf1.train.MomentumOptimizer(0.01, 0.9, use_nesterov=True).minimize(
            loss, global_step=step
        )
        with tf1.Session(graph=graph) as sess:
            sess.run(tf1.global_variables_initializer())
            sess.run(train, {x: images.astype(np.float32), y: np.zeros(N, np.int32)})
            original._randomize(sess, rng, tf1.global_variables())
            step.load(7, sess)
            original._save(sess, tf_dir, None, step)
            predicted = sess.run(logits, {x: images.astype(np.float32)}).argmax(1)
    # Labels that TensorFlow gets 12 of 16 right: its accuracy is 0.75.
    labels = predicted.copy()
    labels[:4] = (labels[:4] + 1) % CLASSES
    tf_accuracy = float(np.mean(predicted == labels))
    _write(data_dir, jpegs, labels)

    model_dir = str(tmp_path / "estimax_model")
    model_flags = ["--resnet_depth=18", f"--num_label_classes={CLASSES}", f"--image_size={SIZE}"]
    assert (
        convert.main(
            [
                "tf-checkpoint",
                f"--checkpoint={tf_dir}",
                f"--model_dir={model_dir}",
                "--model=resnet",
                *model_flags,
            ]
        )
        == 0
    )

    # Into a model_dir that has checkpoints: refused, in one line.
    again = ["tf-checkpoint", f"--checkpoint={tf_dir}", f"--model_dir={model_dir}"]
    assert convert.main([*again, "--model=resnet", *model_flags]) == 2

    def run(*argv):
        fv = flags.FlagValues()
        resnet.define_flags(fv)
        fv(
            [
                "resnet",
                f"--model_dir={model_dir}",
                f"--data_dir={data_dir}",
                "--precision=float32",
                "--num_cores=1",
                f"--num_eval_images={N}",
                "--eval_batch_size=8",
                *model_flags,
                *argv,
            ]
        )
        return resnet.run_from_flags(fv)

    results = run("--mode=eval", "--train_steps=7", "--eval_timeout=0")
    assert results["global_step"] == 7
    print(f"TensorFlow top-1 {tf_accuracy:.4f}, estimax after conversion {results}")
    assert abs(results["top_1_accuracy"] - tf_accuracy) <= 0.005, (results, tf_accuracy)

    run("--mode=train", "--train_steps=9", "--train_batch_size=8", "--iterations_per_loop=2")
    assert checkpoints.Checkpointer(model_dir, read_only=True).latest_step() == 9

    # Fine-tuning on another label set: --warm_start_from the TensorFlow checkpoint, 5 classes.
    tuned_dir = str(tmp_path / "tuned")
    tuned_data = str(tmp_path / "data5")
    _write(tuned_data, jpegs, labels % 5)
    fv = flags.FlagValues()
    resnet.define_flags(fv)
    fv(
        [
            "resnet",
            f"--model_dir={tuned_dir}",
            f"--data_dir={tuned_data}",
            f"--warm_start_from={tf_dir}",
            "--resnet_depth=18",
            "--num_label_classes=5",
            f"--image_size={SIZE}",
            "--precision=float32",
            "--num_cores=1",
            "--mode=train",
            "--train_steps=2",
            "--train_batch_size=8",
            "--iterations_per_loop=1",
            "--base_learning_rate=0.0",
        ]
    )
    resnet.run_from_flags(fv)
    tuned = checkpoints.Checkpointer(tuned_dir, read_only=True)
    assert tuned.latest_step() == 2
    params = tuned.restore_numpy(2)["params"]["ResNet_0"]
    reader = migrate.CheckpointReader(tf_dir)
    # A zero learning rate: the trunk is TensorFlow's (batch statistics aside); the head is new.
    np.testing.assert_array_equal(
        params["initial_conv"]["kernel"], reader.get_tensor("conv2d/kernel")
    )
    assert params["final_dense"]["kernel"].shape == (512, 5)


# The SavedModel writer (every export kind): tests/test_savedmodel_tf.py.
