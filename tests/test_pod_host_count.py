"""A checkpoint written by N processes resumes on M (estimax's global input order at pod scale).

One job of the MNIST program (tests/pod_helpers.py: 1 CPU device per process, loopback) trains
on 8 processes to step 6, resumes on 16 to step 12, then on 8 again to step 18 (8 -> 16 and
16 -> 8 in one chain), against one process training straight to step 18 on the same global
batches. Each leg evaluates every held-out digit once.
"""

from __future__ import annotations

import multihost_helpers as mh
import pod_helpers as ph
import pytest

FLAGS = (
    "--batch_size=16",
    "--iterations=2",
    "--save_checkpoints_steps=2",
    "--eval_steps=-1",
    "--dense_units=8",
    "--learning_rate=0.1",
)


@pytest.mark.slow
def test_eight_to_sixteen_to_eight_processes_continue_one_run(tmp_path_factory, tmp_path):
    data_dir = mh.write_data(str(tmp_path_factory.getbasetemp() / "multihost_data"))
    reference_dir, model_dir = str(tmp_path / "one"), str(tmp_path / "pod")
    previous = 0
    for leg, (processes, steps) in enumerate(((8, 6), (16, 12), (8, 18))):
        results = ph.run(
            processes,
            data_dir,
            model_dir,
            str(tmp_path / f"logs{leg}"),
            *FLAGS,
            f"--train_steps={steps}",
        )
        ph.assert_ok(results)
        chief = results[0].stderr
        if previous:
            # Resumed where the other host count stopped, at the saved global input position.
            assert f"Restored checkpoint at step {previous}" in chief, chief[-3000:]
            assert "input restarts" not in chief
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


def test_a_batch_this_host_count_cannot_split_is_one_line(tmp_path_factory, tmp_path, capsys):
    # The test process has 8 CPU devices (tests/conftest.py): a global batch of 12, such as a
    # run started on 4 or 12 devices resumed here, does not split over 8 replicas.
    from absl import flags

    from estimax.programs import cli, mnist

    data_dir = mh.write_data(str(tmp_path_factory.getbasetemp() / "multihost_data"))
    fv = flags.FlagValues()
    mnist.define_flags(fv)
    argv = ["mnist", f"--data_dir={data_dir}", f"--model_dir={tmp_path / 'm'}"]
    fv([*argv, "--batch_size=12", "--train_steps=1"])
    with pytest.raises(SystemExit) as e:
        cli._run(mnist.run_from_flags, fv, [], None, ["mnist"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("FATAL:")]
    assert len(lines) == 1, err
    assert "train_batch_size=12 is not divisible by the number of replicas (8)" in lines[0]
    assert "This job: 1 process(es), 8 device(s)" in lines[0]
