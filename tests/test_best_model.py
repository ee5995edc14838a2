"""The best model is kept: exporters, the best checkpoint, early stopping that stays stopped.

The job (``bestmodel_job.py``) runs as a command in a child process and is killed (SIGKILL)
between an evaluation and its export; it is then resumed and run again in this process (its
``main``: the kill needs a process of its own, the resumptions only the files it left); what it
left in ``model_dir`` is checked against its recorded evaluations.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

import bestmodel_job as job
import jax
import numpy as np
import pytest
from flax import serialization

import estimax as ex
from estimax.estimator import best, summaries
from estimax.export import exporters
from estimax.state import checkpoints

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _run_job(model_dir: str, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join([ROOT, environ.get("PYTHONPATH", "")])
    environ.setdefault("ESTIMAX_REQUIRE_ONEDNN", "0")
    environ.update(env)
    return subprocess.run(
        [sys.executable, os.path.join(HERE, "bestmodel_job.py"), model_dir],
        env=environ,
        capture_output=True,
        text=True,
    )


def _run_job_here(model_dir: str, monkeypatch, caplog, **env: str) -> str:
    """The job's ``main`` in this process (``env``: its environment variables); its log."""
    caplog.clear()
    with monkeypatch.context() as m:
        for name in ("KILL_AT_EXPORT", "TRAIN_AFTER_EARLY_STOP"):
            m.delenv(name, raising=False)
        for name, value in env.items():
            m.setenv(name, value)
        with caplog.at_level(logging.INFO):
            job.main(model_dir)
    return caplog.text


def _steps(model_dir: str) -> list[int]:
    return checkpoints.Checkpointer(model_dir, None, read_only=True).all_steps()


def _export_variables(version_dir: str) -> dict:
    with open(os.path.join(version_dir, "variables.msgpack"), "rb") as f:
        return serialization.msgpack_restore(f.read())


def _same_leaves(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb, strict=True))


@pytest.mark.slow
def test_killed_resumed_and_rerun_job_keeps_and_exports_its_best_model(
    tmp_path, monkeypatch, caplog
):
    model_dir = str(tmp_path / "run")
    # Killed as it publishes its second best export: that evaluation is recorded, its export
    # is not.
    killed = _run_job(model_dir, KILL_AT_EXPORT="2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    recorded = summaries.recorded_evaluations(os.path.join(model_dir, "eval"))
    assert len(recorded) == 2
    assert list(exporters.exported_steps(os.path.join(model_dir, "export", "best")).values()) == [
        min(recorded)
    ]

    _run_job_here(model_dir, monkeypatch, caplog)  # resumed (raises if it fails)
    recorded = summaries.recorded_evaluations(os.path.join(model_dir, "eval"))
    assert len(recorded) > 2  # it went on evaluating after the kill
    accuracy = {step: r["accuracy"] for step, r in recorded.items()}
    best_step = max(accuracy, key=lambda s: (accuracy[s], -s))  # the earliest of the best
    stop = best.read_early_stop(model_dir)
    assert stop is not None and stop["best_step"] == best_step and stop["metric"] == "accuracy"
    last = max(_steps(model_dir))
    assert stop["stopped_at"] == last and last - best_step >= 8 and last < 200

    # The best export is the best checkpoint, bit for bit; the newest exports are the best ones.
    export_path = os.path.join(model_dir, "export", "best")
    published = exporters.exported_steps(export_path)
    assert published[max(published)] == best_step
    assert len(published) == 2  # exports_to_keep
    est = ex.Estimator(job.model_fn, ex.RunConfig(model_dir=model_dir))
    best_path = checkpoints.step_path(model_dir, best_step)
    checkpoint_vars = est.get_variables(checkpoint_path=best_path)
    assert _same_leaves(
        _export_variables(os.path.join(export_path, str(max(published)))), checkpoint_vars
    )

    # More checkpoints than keep_checkpoint_max were written after it, and it is still there.
    saves_after_best = (last - best_step) // 2
    assert saves_after_best > job.KEEP
    assert _steps(model_dir) == sorted({best_step, *range(last - 2 * (job.KEEP - 1), last + 1, 2)})
    kept = ex.Estimator(
        job.model_fn,
        ex.RunConfig(
            model_dir=model_dir, keep_best_checkpoint=ex.BestCheckpoint("accuracy", "max")
        ),
    )
    assert kept.best_checkpoint() == best_path

    _run_again_and_asked_to_train_on(
        model_dir,
        last,
        best_step,
        recorded,
        published,
        lambda **env: _run_job_here(model_dir, monkeypatch, caplog, **env),
    )


def _run_again_and_asked_to_train_on(model_dir, last, best_step, recorded, published, run_job):
    export_path = os.path.join(model_dir, "export", "best")
    # The same command again: nothing trained, nothing evaluated or exported, and it says why.
    again = run_job()
    assert f"stopped early at step {last} (best {best_step}" in again
    assert "RunConfig(train_after_early_stop=True)" in again
    assert best.read_early_stop(model_dir)["stopped_at"] == last  # the record stands
    assert max(_steps(model_dir)) == last
    assert summaries.recorded_evaluations(os.path.join(model_dir, "eval")) == recorded
    assert exporters.exported_steps(export_path) == published

    # Asked to, it trains on, and stops again once later evaluations show no increase.
    on = run_job(TRAIN_AFTER_EARLY_STOP="1")  # raises if it fails
    assert f"stopped early at step {last}" in on and "training on" in on
    again_stop = best.read_early_stop(model_dir)
    assert again_stop is not None and again_stop["stopped_at"] > last
    assert max(_steps(model_dir)) == again_stop["stopped_at"]


def _trained(model_dir: str, steps: int = 8, **config) -> ex.Estimator:
    est = job.estimator(model_dir, keep_checkpoint_max=None, **config)
    x, y = job.data(64, seed=0)
    est.train(ex.numpy_input_fn(x, y, seed=1), max_steps=steps)
    return est


def _train_input_fn():
    x, y = job.data(64, seed=0)
    return ex.numpy_input_fn(x, y, seed=1)


def _eval_input_fn():
    x, y = job.data(40, seed=1)
    return ex.numpy_input_fn(x, y, shuffle=False, num_epochs=1)


def test_checkpoint_path_best_names_the_best_evaluated_checkpoint(tmp_path):
    model_dir = str(tmp_path / "run")
    est = _trained(model_dir, keep_best_checkpoint=ex.BestCheckpoint("loss", "min"))
    with pytest.raises(FileNotFoundError, match="no checkpoint of .* has a recorded evaluation"):
        est.evaluate(_eval_input_fn(), checkpoint_path="best")
    eval_dir = os.path.join(model_dir, "eval")
    for step, loss in [(2, 0.9), (4, 0.5), (6, 0.7), (8, 0.8)]:
        summaries.record_evaluation(eval_dir, {"global_step": step, "loss": loss})
    assert est.best_checkpoint() == checkpoints.step_path(model_dir, 4)
    assert est.evaluate(_eval_input_fn(), checkpoint_path="best")["global_step"] == 4

    # Training from an older checkpoint of the same model_dir would rewrite its history.
    with pytest.raises(ValueError, match="Train from it in a new model_dir") as refused:
        est.train(_train_input_fn(), max_steps=10, checkpoint_path="best")
    assert checkpoints.step_path(model_dir, 4) in str(refused.value)
    # In a new model_dir it starts from there: that checkpoint's step and weights.
    other = str(tmp_path / "finetune")
    fresh = ex.Estimator(
        job.model_fn,
        ex.RunConfig(model_dir=other, save_checkpoints_steps=2, num_shards=1),
        train_batch_size=16,
    )
    x, y = job.data(64, seed=0)
    fresh.train(ex.numpy_input_fn(x, y, seed=1), max_steps=6, checkpoint_path=est.best_checkpoint())
    assert _steps(other) == [6]


def test_best_checkpoint_and_early_stopping_refuse_a_wrong_mode_or_metric(tmp_path):
    with pytest.raises(ValueError, match="mode must be 'min' .* or 'max'"):
        ex.BestCheckpoint("accuracy", "highest")
    est = _trained(str(tmp_path), steps=2)
    summaries.record_evaluation(
        os.path.join(est.model_dir, "eval"), {"global_step": 2, "loss": 1.0}
    )
    hook = ex.stop_if_no_increase_hook(est, "acuracy", 4, run_every_steps=1)
    with pytest.raises(KeyError, match=r"no 'acuracy'; they have \['loss'\]"):
        est.train(_train_input_fn(), steps=2, hooks=[hook])


@pytest.mark.parametrize(
    "accuracies, min_steps, stopped",
    [
        ({10: 0.5, 20: 0.6, 30: 0.6, 40: 0.55}, 0, True),  # 40 - 20 >= 20
        ({10: 0.5, 20: 0.6, 30: 0.7, 40: 0.65}, 0, False),
        ({10: 0.9, 20: 0.6, 30: 0.7, 40: 0.65}, 15, False),  # step 10 is before min_steps
        ({10: 0.9, 20: 0.6, 30: 0.7, 40: 0.65}, 0, True),
    ],
)
def test_stop_if_no_increase_hook_follows_the_originals_rule(
    tmp_path, accuracies, min_steps, stopped
):
    est = _trained(str(tmp_path), steps=2)
    eval_dir = os.path.join(est.model_dir, "eval_validation")
    for step, value in accuracies.items():
        summaries.record_evaluation(eval_dir, {"global_step": step, "accuracy": value})
    hook = ex.stop_if_no_increase_hook(
        est, "accuracy", 20, min_steps=min_steps, run_every_steps=1, eval_name="validation"
    )
    assert (hook.decision(40) is not None) == stopped
    assert (best.read_early_stop(est.model_dir) is not None) == stopped


def test_eval_spec_exporters_are_checked(tmp_path):
    with pytest.raises(TypeError, match="BestExporter, LatestExporter or FinalExporter"):
        ex.EvalSpec(_eval_input_fn(), exporters=[object()])
    spec = lambda: ex.TensorSpec((None, 6), np.float32)
    with pytest.raises(ValueError, match=r"the names \['x'\] are used more than once"):
        ex.EvalSpec(
            _eval_input_fn(), exporters=[ex.LatestExporter("x", spec), ex.FinalExporter("x", spec)]
        )
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['top_kk'\]"):
        ex.LatestExporter("x", spec, top_kk=3)
    with pytest.raises(ValueError, match="needs serving_input_receiver_fn"):
        ex.FinalExporter("x")
    with pytest.raises(ValueError, match="give compare_fn or metric=, not both"):
        ex.BestExporter("b", spec, compare_fn=lambda **_: True, metric="loss")
    est = _trained(str(tmp_path), steps=2)
    with pytest.raises(ValueError, match=r"several EvalSpecs are named \['v'\]"):
        ex.train_and_evaluate(
            est,
            ex.TrainSpec(_train_input_fn(), max_steps=4),
            [ex.EvalSpec(_eval_input_fn(), name="v"), ex.EvalSpec(_eval_input_fn(), name="v")],
        )


def test_latest_and_final_exporters_publish_once_per_checkpoint(tmp_path):
    est = _trained(str(tmp_path), steps=2)
    spec = lambda: ex.TensorSpec((None, 6), np.float32)
    x, y = job.data(64, seed=0)

    def run():
        return ex.train_and_evaluate(
            est,
            ex.TrainSpec(ex.numpy_input_fn(x, y, seed=1), max_steps=8),
            ex.EvalSpec(
                _eval_input_fn(),
                every_steps=2,
                exporters=[
                    ex.LatestExporter("latest", spec, exports_to_keep=2, platforms=("cpu",)),
                    ex.FinalExporter("final", spec, platforms=("cpu",)),
                ],
            ),
        )

    results, published = run()
    assert results["global_step"] == 8
    latest = exporters.exported_steps(os.path.join(est.model_dir, "export", "latest"))
    assert sorted(latest.values()) == [6, 8]  # the 2 newest of 2 (restart), 4, 6, 8
    final = exporters.exported_steps(os.path.join(est.model_dir, "export", "final"))
    assert list(final.values()) == [8]
    assert len(published) == 1 and published[0].endswith(os.path.join("final", "1"))
    again, published_again = run()  # a finished job run again publishes nothing
    assert published_again == [] and again == results
    assert exporters.exported_steps(os.path.join(est.model_dir, "export", "latest")) == latest
    with open(os.path.join(est.model_dir, "export", "final", "1", "signature.json")) as f:
        assert json.load(f)["global_step"] == 8
