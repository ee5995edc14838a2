"""SessionRunHooks, saving listeners that stop, ready hooks and the profiler."""

from __future__ import annotations

import glob
import logging
import os

import jax
import numpy as np
import pytest
from test_estimator import _scalars, data, make_model_fn

import estimax as ex
from estimax.estimator import summaries


class Recorder(ex.SessionRunHook):
    """Notes every call; asks to stop once a loop ends at or after ``stop_at``."""

    def __init__(self, stop_at: int | None = None):
        self.calls: list[tuple] = []
        self.values: list[ex.SessionRunValues] = []
        self.stop_at = stop_at

    def begin(self):
        self.calls.append(("begin",))

    def after_create_session(self, session, coord):
        self.calls.append(("after_create_session", session.mode, session.global_step, coord))

    def before_run(self, run_context):
        self.calls.append(("before_run", run_context.session.global_step))

    def after_run(self, run_context, run_values):
        self.calls.append(("after_run", run_values.begin_step, run_values.end_step))
        self.values.append(run_values)
        if self.stop_at is not None and run_values.end_step >= self.stop_at:
            run_context.request_stop()

    def end(self, session):
        self.calls.append(("end", session.global_step))


def estimator(tmp_path, name="run", **kw):
    kw.setdefault("iterations_per_loop", 2)
    kw.setdefault("save_checkpoints_steps", 2)
    kw.setdefault("keep_checkpoint_max", None)
    kw.setdefault("save_summary_steps", 1)
    config = ex.RunConfig(model_dir=str(tmp_path / name), num_shards=1, **kw)
    return ex.Estimator(
        make_model_fn(),
        config,
        train_batch_size=16,
        eval_batch_size=16,
        predict_batch_size=16,
    )


def test_train_hook_sees_each_loop_with_its_per_step_metrics(tmp_path):
    x, y = data()
    est = estimator(tmp_path)
    hook = Recorder()
    est.train(ex.numpy_input_fn(x, y), hooks=[hook], max_steps=5)
    est.close()
    assert hook.calls == [
        ("begin",),
        ("after_create_session", ex.ModeKeys.TRAIN, 0, None),
        ("before_run", 0),
        ("after_run", 0, 2),
        ("before_run", 2),
        ("after_run", 2, 4),
        ("before_run", 4),
        ("after_run", 4, 5),  # the last loop is shortened to hit max_steps
        ("end", 5),
    ]
    losses = np.concatenate([v.results["loss"] for v in hook.values])
    assert [list(v.steps) for v in hook.values] == [[1, 2], [3, 4], [5]]
    # The hook's per-step losses are those TensorBoard holds at the same steps.
    written = _scalars(est.model_dir, "loss")
    np.testing.assert_allclose(losses, [written[s] for s in range(1, 6)], rtol=1e-6)
    assert all(len(v.results["learning_rate"]) == len(v.steps) for v in hook.values)


def test_request_stop_ends_at_the_loop_with_a_checkpoint_and_a_restart_continues(tmp_path):
    x, y = data()
    est = estimator(tmp_path, save_checkpoints_steps=100)  # only the stop makes a checkpoint
    est.train(ex.numpy_input_fn(x, y), hooks=[Recorder(stop_at=3)], max_steps=10)
    assert est.get_global_step() == 4  # the loop that passed step 3 ends at 4
    again = Recorder()
    est.train(ex.numpy_input_fn(x, y), hooks=[again], max_steps=6)
    est.close()
    assert again.calls[1] == ("after_create_session", ex.ModeKeys.TRAIN, 4, None)
    assert [(v.begin_step, v.end_step) for v in again.values] == [(4, 6)]
    assert est.get_global_step() == 6


def test_stop_at_step_hook_stops_exactly_there(tmp_path):
    x, y = data()
    est = estimator(tmp_path, iterations_per_loop=4, save_checkpoints_steps=100)
    est.train(ex.numpy_input_fn(x, y), hooks=[ex.StopAtStepHook(last_step=3)], max_steps=10)
    assert est.get_global_step() == 3
    est.train(ex.numpy_input_fn(x, y), hooks=[ex.StopAtStepHook(num_steps=2)], max_steps=10)
    est.close()
    assert est.get_global_step() == 5


class StopAfterSave:
    """A ``CheckpointSaverListener``-like object: stops once ``after_save`` saw ``step``."""

    def __init__(self, step):
        self.step, self.saved = step, []

    def after_save(self, session, global_step):
        self.saved.append(global_step)
        return global_step >= self.step


def test_a_saving_listener_returning_true_stops_training(tmp_path):
    x, y = data()
    est = estimator(tmp_path)
    seen = []
    est.train(
        ex.numpy_input_fn(x, y),
        max_steps=10,
        saving_listeners=[lambda step: seen.append(step) or step >= 4],
    )
    assert seen == [2, 4] and est.get_global_step() == 4
    listener = StopAfterSave(6)
    est.train(ex.numpy_input_fn(x, y), max_steps=10, saving_listeners=[listener])
    est.close()
    assert listener.saved == [6] and est.get_global_step() == 6


def test_evaluate_hook_sees_each_loop_and_the_results(tmp_path):
    x, y = data()
    est = estimator(tmp_path)
    est.train(ex.numpy_input_fn(x, y), max_steps=2)
    hook = Recorder()
    results = est.evaluate(  # 70 examples: 5 batches of 16, the last one padded
        ex.numpy_input_fn(x[:70], y[:70], shuffle=False, num_epochs=1), hooks=[hook]
    )
    assert hook.calls[:2] == [("begin",), ("after_create_session", ex.ModeKeys.EVAL, 2, None)]
    assert [(v.begin_step, v.end_step) for v in hook.values] == [(0, 2), (2, 4), (4, 5)]
    assert hook.values[-1].results["accuracy"] == pytest.approx(results["accuracy"])
    assert hook.calls[-1] == ("end", 2)
    # Stopping after the first loop evaluates those 2 batches only.
    partial = est.evaluate(
        ex.numpy_input_fn(x[:70], y[:70], shuffle=False, num_epochs=1),
        hooks=[Recorder(stop_at=2)],
        name="partial",
    )
    est.close()
    assert partial["num_examples"] == 32


def test_predict_hook_sees_each_batch_and_can_stop(tmp_path):
    x, y = data()
    est = estimator(tmp_path)
    est.train(ex.numpy_input_fn(x, y), max_steps=2)
    hook = Recorder()
    predictions = list(
        est.predict(ex.numpy_input_fn(x[:40], shuffle=False, num_epochs=1), hooks=[hook])
    )
    assert len(predictions) == 40
    assert [(v.begin_step, v.end_step) for v in hook.values] == [(0, 1), (1, 2), (2, 3)]
    assert [len(v.results["classes"]) for v in hook.values] == [16, 16, 8]
    np.testing.assert_array_equal(
        hook.values[0].results["classes"], [p["classes"] for p in predictions[:16]]
    )
    assert hook.calls[-1] == ("end", 2)
    stopped = list(
        est.predict(ex.numpy_input_fn(x[:40], shuffle=False, num_epochs=1), hooks=[Recorder(1)])
    )
    est.close()
    assert len(stopped) == 16


def test_logging_and_step_counter_hooks(tmp_path, caplog):
    x, y = data()
    est = estimator(tmp_path)
    hooks = [
        ex.LoggingTensorHook(["loss"], every_n_iter=3),
        ex.StepCounterHook(every_n_steps=2, output_dir=str(tmp_path / "counter")),
    ]
    with caplog.at_level(logging.INFO):
        est.train(ex.numpy_input_fn(x, y), hooks=hooks, max_steps=6)
    est.close()
    lines = [r.getMessage() for r in caplog.records]
    assert [m.split("(")[-1] for m in lines if m.startswith("loss = ") and "(step" in m] == [
        "step 3)",
        "step 6)",
    ]
    assert sorted(_scalars(str(tmp_path / "counter"), "global_step/sec")) == [2, 4, 6]


@pytest.mark.parametrize("losses,stopped_at", [([1.0, 1.1, 1.2], 2), ([1.0, 0.9, 0.8], 6)])
def test_stop_if_no_decrease_hook_reads_the_recorded_evaluations(tmp_path, losses, stopped_at):
    x, y = data()
    est = estimator(tmp_path)
    eval_dir = os.path.join(est.model_dir, "eval")
    for step, loss in zip([10, 20, 30], losses, strict=True):
        summaries.record_evaluation(eval_dir, {"global_step": step, "loss": loss})
    hook = ex.stop_if_no_decrease_hook(est, "loss", 20, run_every_steps=1)
    est.train(ex.numpy_input_fn(x, y), hooks=[hook], max_steps=6)
    est.close()
    assert est.get_global_step() == stopped_at


def test_train_and_evaluate_passes_the_specs_hooks(tmp_path):
    x, y = data()
    est = estimator(tmp_path)
    train_hook, eval_hook = Recorder(stop_at=4), Recorder()
    results, _ = ex.train_and_evaluate(
        est,
        ex.TrainSpec(ex.numpy_input_fn(x, y), max_steps=10, hooks=[train_hook]),
        ex.EvalSpec(
            ex.numpy_input_fn(x[:32], y[:32], shuffle=False, num_epochs=1),
            every_steps=4,
            hooks=[eval_hook],
        ),
    )
    est.close()
    # The train hook's stop (at step 4, where an evaluation falls anyway) ends it all.
    assert results["global_step"] == 4 and est.get_global_step() == 4
    assert [c[2] for c in eval_hook.calls if c[0] == "after_create_session"] == [4]


def test_hooks_must_be_session_run_hooks(tmp_path):
    est = estimator(tmp_path)
    with pytest.raises(TypeError, match="estimax.SessionRunHook"):
        est.train(ex.numpy_input_fn(*data()), hooks=[lambda: None], max_steps=2)


def _trace_steps(model_dir: str) -> tuple[list[str], set[int]]:
    """The trace files under model_dir/plugins/profile and the step markers they hold."""
    files = glob.glob(os.path.join(model_dir, "plugins", "profile", "*", "*.xplane.pb"))
    steps = set()
    for path in files:
        for plane in jax.profiler.ProfileData.from_file(path).planes:
            for line in plane.lines:
                for event in line.events:
                    if event.name == "train":
                        steps.add(int(dict(event.stats)["step_num"]))
    return files, steps


def test_profile_steps_write_a_trace_of_those_steps(tmp_path):
    x, y = data()
    est = estimator(tmp_path, iterations_per_loop=4, profile_steps=(3, 5))
    est.train(ex.numpy_input_fn(x, y), max_steps=8)
    est.close()
    files, steps = _trace_steps(est.model_dir)
    assert len(files) == 1, files
    assert steps == {3, 4, 5}  # loops were cut at 2 and 5 so the trace holds exactly those
    with pytest.raises(ValueError, match="profile_steps"):
        ex.RunConfig(profile_steps=(5, 3))


def test_profile_steps_flag_of_every_program():
    from absl import flags

    from estimax.programs import cli

    fv = flags.FlagValues()
    cli.define_cluster_flags(fv)  # every program defines these
    fv(["prog", "--profile_steps=3,5"])
    assert cli.profile_steps(fv) == (3, 5)
    fv(["prog", "--profile_steps=7"])
    assert cli.profile_steps(fv) == (7, 7)
    fv(["prog", "--profile_steps=5,x"])
    with pytest.raises(cli.UsageError, match="--profile_steps: .*START,STOP"):
        cli.profile_steps(fv)


def test_profile_to_an_object_store(tmp_path, object_store):
    """The trace is written locally, then uploaded where TensorBoard reads it (gs://, s3://)."""
    from estimax import storage

    url, _ = object_store
    x, y = data()
    est = estimator(tmp_path, iterations_per_loop=4)
    out = f"{url}/run"
    est.train(ex.numpy_input_fn(x, y), hooks=[ex.ProfilerHook((2, 3), output_dir=out)], max_steps=4)
    est.close()
    fs, root = storage.filesystem(out)
    found = fs.glob(f"{root}/plugins/profile/*/*.xplane.pb")
    assert len(found) == 1, found
    local = tmp_path / "downloaded"
    fs.get(found[0], str(local / "plugins" / "profile" / "run" / "host.xplane.pb"))
    assert _trace_steps(str(local))[1] == {2, 3}


def test_a_failing_hook_still_runs_every_cleanup(tmp_path):
    """A hook's error reaches the caller; the watchdog stops and the profiler's trace is
    written (every part is closed under one ExitStack)."""
    import threading

    class Boom(ex.SessionRunHook):
        def after_run(self, run_context, run_values):
            raise RuntimeError("boom")

    x, y = data()
    est = estimator(tmp_path, profile_steps=(1, 4), watchdog_timeout_secs=3600)
    with pytest.raises(RuntimeError, match="boom"):
        est.train(ex.numpy_input_fn(x, y), hooks=[Boom()], max_steps=6)
    est.close()
    assert not any(t.name == "estimax-watchdog" for t in threading.enumerate())
    assert _trace_steps(est.model_dir)[1] == {1, 2}  # the first loop's steps, then the error
    jax.profiler.start_trace(str(tmp_path / "again"))  # no trace was left running
    jax.profiler.stop_trace()
