"""Evaluations are not lost, and TensorBoard never holds two points for one step.

An evaluation counts as done only once its summaries are written and fsynced and it is recorded
in ``<eval dir>/evaluations.json``; a process killed before that redoes it on restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import estimax as ex
from estimax.estimator import summaries
from estimax.programs import configs, modes

try:
    from . import ckpt_fixtures as fx
except ImportError:
    import ckpt_fixtures as fx


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([fx.ROOT, fx.HERE, env.get("PYTHONPATH", "")])
    env.setdefault("ESTIMAX_REQUIRE_ONEDNN", "0")
    return env


def _train_and_evaluate(model_dir: str, max_steps: int = 4) -> dict:
    est = fx.estimator(model_dir)
    try:
        results, _ = ex.train_and_evaluate(
            est,
            ex.TrainSpec(fx.train_input_fn(), max_steps=max_steps),
            ex.EvalSpec(fx.eval_input_fn(), every_steps=2),
        )
        return results
    finally:
        est.close()


def _points(model_dir: str) -> list[int]:
    return [step for step, _ in fx.scalar_events(os.path.join(model_dir, "eval"), "loss")]


def test_summaries_flush_is_durable_even_if_killed_right_after(tmp_path):
    # tensorboardX's flush() does not wait for its writer thread's queue: a kill right after it
    # left an event file holding only its 40-byte header.
    child = textwrap.dedent(f"""
        import os, signal
        from estimax.estimator import summaries
        s = summaries.Summaries({str(tmp_path)!r})
        s.scalars(10, {{"loss": 0.25, "accuracy": 0.75}})
        s.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", child], env=_env(), capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert fx.scalar_events(str(tmp_path), "loss") == [(10, 0.25)]
    assert fx.scalar_events(str(tmp_path), "accuracy") == [(10, 0.75)]


def test_rerunning_a_finished_command_adds_no_second_point(tmp_path):
    model_dir = str(tmp_path)
    first = _train_and_evaluate(model_dir)
    assert first["global_step"] == 4
    assert _points(model_dir) == [2, 4]
    again = _train_and_evaluate(model_dir)
    assert again == first  # read back from the record, not evaluated again
    assert _points(model_dir) == [2, 4]
    recorded = summaries.recorded_evaluations(os.path.join(model_dir, "eval"))
    assert sorted(recorded) == [2, 4] and recorded[4] == first


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["summaries_flush", "record"])
def test_evaluation_cut_off_by_a_kill_is_redone_once(tmp_path, kill_at):
    """SIGKILL before the eval summaries are durable, or after them but before the record."""
    model_dir = str(tmp_path / "run")
    child = textwrap.dedent(f"""
        import os, signal
        import estimax as ex
        import ckpt_fixtures as fx
        from estimax.estimator import summaries

        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        if {kill_at!r} == "record":
            summaries.record_evaluation = die
        else:
            original_flush = summaries.Summaries.flush
            def flush_then_maybe_die(self):
                if os.path.basename(self.logdir) == "eval":
                    die()
                original_flush(self)
            summaries.Summaries.flush = flush_then_maybe_die
        est = fx.estimator({model_dir!r})
        ex.train_and_evaluate(est, ex.TrainSpec(fx.train_input_fn(), max_steps=4),
                              ex.EvalSpec(fx.eval_input_fn(), every_steps=2))
    """)
    proc = subprocess.run([sys.executable, "-c", child], env=_env(), capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]
    assert ex.Estimator(fx.model_fn, ex.RunConfig(model_dir=model_dir)).get_global_step() == 2
    eval_dir = os.path.join(model_dir, "eval")
    assert summaries.recorded_evaluations(eval_dir) == {}  # the evaluation was not recorded
    assert _points(model_dir) == ([2] if kill_at == "record" else [])

    results = _train_and_evaluate(model_dir)
    assert results["global_step"] == 4
    assert _points(model_dir) == [2, 4]  # step 2 redone, and only once in TensorBoard
    recorded = summaries.recorded_evaluations(eval_dir)
    assert sorted(recorded) == [2, 4]
    # The redone evaluation of step 2 is the one an uninterrupted run records.
    reference = str(tmp_path / "reference")
    _train_and_evaluate(reference)
    assert recorded == summaries.recorded_evaluations(os.path.join(reference, "eval"))


def test_eval_mode_redoes_an_unrecorded_evaluation_and_skips_a_recorded_one(tmp_path, caplog):
    model_dir = str(tmp_path)
    fx.train(model_dir, 4)
    loop = configs.LoopConfig(mode="eval", train_steps=4, steps_per_eval=2, eval_timeout=0)

    def run_eval_mode() -> dict:
        est = fx.estimator(model_dir)
        try:
            return modes.evaluate_checkpoints(est, fx.eval_input_fn(), loop)
        finally:
            est.close()

    first = run_eval_mode()
    assert first["global_step"] == 4 and _points(model_dir) == [4]
    caplog.set_level("INFO")
    assert run_eval_mode() == first
    assert any("already recorded" in r.getMessage() for r in caplog.records)
    assert _points(model_dir) == [4]
    # As if killed after the summaries but before the record: redone, still one point.
    record = os.path.join(model_dir, "eval", summaries.EVALUATIONS_FILE)
    assert json.load(open(record))["evaluations"]["4"] == first
    os.remove(record)
    assert run_eval_mode() == first
    assert _points(model_dir) == [4]
    assert os.path.exists(record)


def test_eval_points_and_record_on_an_object_store(object_store):
    # The same promises on gs:// and s3://: the record is one upload, the points are found.
    root, _ = object_store
    logdir = f"{root}/run/eval"
    writer = summaries.Summaries(logdir, unique_steps=True)
    writer.scalars(10, {"loss": 0.5})
    writer.flush()
    summaries.record_evaluation(logdir, {"loss": 0.5, "global_step": 10})
    writer.close()
    again = summaries.Summaries(logdir, unique_steps=True)  # a restarted process
    again.scalars(10, {"loss": 0.75, "accuracy": 0.25})  # loss at 10 is there: not rewritten
    again.close()
    assert summaries.scalar_steps(logdir) == {("loss", 10), ("accuracy", 10)}
    from tensorboardX.proto import event_pb2

    from estimax import storage
    from estimax.data import tfrecord

    fs, path = storage.filesystem(logdir)
    values = [
        (v.tag, v.simple_value)
        for name in fs.ls(path, detail=False)
        if "tfevents" in name
        for record in tfrecord.read_records(f"{logdir}/{os.path.basename(name)}")
        for v in event_pb2.Event.FromString(record).summary.value
    ]
    assert sorted(values) == [("accuracy", 0.25), ("loss", 0.5)]  # one loss point, the first
    assert summaries.recorded_evaluations(logdir) == {10: {"loss": 0.5, "global_step": 10}}
