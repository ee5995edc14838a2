"""A checkpoint written by N processes resumes on M (estimax's global input order at pod scale).

One job of the MNIST program (tests/pod_helpers.py: 1 CPU device per process, loopback) trains
on 8 processes to step 3, resumes on 16 to step 5, on 8 again to step 7, on 32 to step 9 and
on 4 to step 11: 8 -> 16, 16 -> 8 and 32 -> 4 in one chain of five launches (the fewest that
hold the three), against one process resumed the same way with as many devices, on the same
global batches. Each leg evaluates every held-out digit once; each resumed leg then predicts
them (the same processes' Estimator.predict): every row once, in the data's order.
"""

from __future__ import annotations

import json
import os

import multihost_helpers as mh
import pod_helpers as ph
import pytest

# A global batch of 32 splits over every host count of the chain (1 to 32 replicas).
FLAGS = (
    "--batch_size=32",
    "--iterations=2",
    "--save_checkpoints_steps=2",
    "--eval_steps=-1",
    "--dense_units=8",
    "--learning_rate=0.1",
)
# (processes, the step the leg trains to). An epoch of the 64 training digits is 2 steps: the
# 8 -> 16, 16 -> 8 and 32 -> 4 resumes start at an odd step, in the middle of an epoch.
CHAIN = ((8, 3), (16, 5), (8, 7), (32, 9), (4, 11))


def predicted_rows(out_dir: str, processes: int) -> list[list]:
    """Each process's predicted rows ``[id, label, class]`` (tests/multihost_worker.py)."""
    rows = []
    for i in range(processes):
        with open(os.path.join(out_dir, f"predict_{i}.json")) as f:
            rows.append(json.load(f))
    return rows


@pytest.mark.slow
def test_host_counts_8_16_8_32_4_continue_one_run(tmp_path_factory, tmp_path):
    from estimax.programs import mnist

    data_dir = mh.write_data(str(tmp_path_factory.getbasetemp() / "multihost_data"))
    labels = mnist.load_tfrecords(os.path.join(data_dir, "validation.tfrecords"))[1].tolist()
    reference_dir, model_dir = str(tmp_path / "one"), str(tmp_path / "pod")
    previous = 0
    for leg, (processes, steps) in enumerate(CHAIN):
        predict_dir = str(tmp_path / f"predict{leg}")
        os.makedirs(predict_dir)
        job = ph.start(
            processes,
            data_dir,
            model_dir,
            str(tmp_path / f"logs{leg}"),
            *FLAGS,
            f"--train_steps={steps}",
            # The first leg has nothing resumed to predict with.
            env={"ESTIMAX_TEST_PREDICT": predict_dir} if previous else None,
        )
        results = ph.finish(job, timeout=900)
        ph.assert_ok(results)
        chief = results[0].stderr
        if previous:
            # Resumed where the other host count stopped, at the saved global input position.
            assert f"Restored checkpoint at step {previous}" in chief, chief[-3000:]
            assert "input restarts" not in chief
            # Every held-out digit predicted once, in the data's order, on process 0 (the
            # others yield nothing: their rows went to process 0).
            rows = predicted_rows(predict_dir, processes)
            assert [r[:2] for r in rows[0]] == [[i, labels[i]] for i in range(mh.NUM_EVAL)]
            assert all(r == [] for r in rows[1:])
        assert mh.params(model_dir)["step"] == steps
        for proc in results:
            # Every held-out digit evaluated once, on every host count.
            assert mh.eval_results(proc.stderr)["num_examples"] == mh.NUM_EVAL
        # The reference: one process with as many devices (the same replicas, so the same
        # dropout masks: the model's dropout is keyed by replica), resumed the same way.
        reference = ph.run(
            1,
            data_dir,
            reference_dir,
            str(tmp_path / f"logs_one{leg}"),
            *FLAGS,
            f"--train_steps={steps}",
            devices=processes,
        )
        ph.assert_ok(reference)
        previous = steps
    # The chain trained on the batches the one process did, in its order: the same parameters
    # (up to the order of the cross-replica gradient sum: across processes against inside one).
    mh.assert_same_params(mh.params(model_dir), mh.params(reference_dir), rtol=1e-4, atol=1e-5)
    one = mh.eval_results(reference[0].stderr)
    pod = mh.eval_results(results[0].stderr)
    assert pod["accuracy"] == pytest.approx(one["accuracy"], abs=1e-6)
    assert pod["loss"] == pytest.approx(one["loss"], rel=1e-4)
    # The last leg's predicted classes are the model's: as accurate as its evaluation says.
    classes = [r[2] for r in rows[0]]
    correct = sum(c == y for c, y in zip(classes, labels, strict=True))
    assert correct / mh.NUM_EVAL == pytest.approx(pod["accuracy"], abs=1e-6)


def test_a_checkpoint_this_host_count_cannot_resume_is_one_line(tmp_path_factory, tmp_path, capsys):
    # The test process has 8 CPU devices (tests/conftest.py). A run on 4 of them with a global
    # batch of 12 writes a checkpoint; resumed on all 8, the batch does not split over 8
    # replicas (as a run of 4 or 12 hosts resumed on 8): one line, and the checkpoint is kept.
    from absl import flags

    from estimax.programs import cli, mnist

    data_dir = mh.write_data(str(tmp_path_factory.getbasetemp() / "multihost_data"))
    model_dir = str(tmp_path / "m")
    small = ("--batch_size=12", "--dense_units=8", "--iterations=1")

    def mnist_flags(*args: str) -> flags.FlagValues:
        fv = flags.FlagValues()
        mnist.define_flags(fv)
        fv(["mnist", f"--data_dir={data_dir}", f"--model_dir={model_dir}", *small, *args])
        return fv

    cli._run(
        mnist.run_from_flags, mnist_flags("--num_shards=4", "--train_steps=1"), [], None, ["mnist"]
    )
    assert mh.params(model_dir)["step"] == 1
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli._run(mnist.run_from_flags, mnist_flags("--train_steps=2"), [], None, ["mnist"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("FATAL:")]
    assert len(lines) == 1, err
    assert "train_batch_size=12 is not divisible by the number of replicas (8)" in lines[0]
    assert "This job: 1 process(es), 8 device(s)" in lines[0]
    assert mh.params(model_dir)["step"] == 1
