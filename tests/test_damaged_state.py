"""Damaged state in model_dir: evaluations.json and early_stopping.json that do not parse, are
nested absurdly deep, or do not agree with the event files (issue #42, items 12 and 13).

Each is one WARNING; the evaluations are rebuilt from what can be verified (TensorBoard's event
files, written and fsynced before each record); a best checkpoint or a published best version is
never replaced or deleted on the word of a record that cannot be verified.
"""

from __future__ import annotations

import json
import logging
import os
import types

import pytest

import estimax as ex
from estimax.estimator import best, summaries
from estimax.export import exporters

# The job: accuracy at steps 4, 8, 12, 16, 20; the best is step 12.
ACCURACY = {4: 0.5, 8: 0.6, 12: 0.65, 16: 0.62, 20: 0.63}


def _evaluated(eval_dir: str, accuracy: dict[int, float] = ACCURACY) -> None:
    """Each evaluation as ``Estimator.evaluate`` leaves it: its scalars flushed, then recorded."""
    writer = summaries.Summaries(eval_dir, unique_steps=True)
    for step, value in accuracy.items():
        writer.scalars(step, {"accuracy": value, "loss": 1 - value})
        writer.flush()
        summaries.record_evaluation(
            eval_dir,
            {"accuracy": value, "loss": 1 - value, "global_step": step, "num_examples": 64},
        )
    writer.close()


def _damage(path: str, how: str) -> None:
    text = open(path).read()
    damaged = {
        "truncated": text[: len(text) // 2],
        "garbage": "\x00\xff" * 8,
        "not utf-8": text.replace("0.65", "0.\xe95"),
        "deep": "[" * 100_000 + "]" * 100_000,
        "deep object": '{"evaluations": ' * 100_000 + "{}" + "}" * 100_000,
        # Valid JSON that lies: the best evaluation's value changed, a step invented.
        "value changed": text.replace("0.65", "0.15"),
        "step invented": json.dumps(
            {"evaluations": {"4": {"accuracy": 0.99, "global_step": 4}, "99": {"accuracy": 1}}}
        ),
        "not a number": text.replace("0.65", '"0.65"'),
        "wrong shape": json.dumps({"evaluations": [1, 2]}),
    }[how]
    with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(damaged)


DAMAGES = [
    "truncated",
    "garbage",
    "not utf-8",
    "deep",
    "deep object",
    "value changed",
    "step invented",
    "not a number",
    "wrong shape",
]


def _checkpoint_infos(steps):
    return [types.SimpleNamespace(step=s) for s in steps]


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_record_is_rebuilt_from_the_event_files(tmp_path, how, caplog):
    eval_dir = str(tmp_path / "eval")
    _evaluated(eval_dir)
    record = os.path.join(eval_dir, summaries.EVALUATIONS_FILE)
    sound = summaries.recorded_evaluations(eval_dir)
    _damage(record, how)
    caplog.set_level(logging.WARNING)
    for _ in range(3):  # read at every check and save: one warning
        found = summaries.read_evaluations(eval_dir)
    assert found.damage is not None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "is damaged" in warnings[0], warnings
    assert "rebuilt from TensorBoard's event files" in warnings[0]
    assert sorted(found.evaluations) == sorted(ACCURACY)
    for step, results in found.evaluations.items():
        assert results["global_step"] == step
        assert results["accuracy"] == pytest.approx(sound[step]["accuracy"], rel=1e-6)

    # The next record keeps the damaged file as evidence and replaces it with a sound one.
    _evaluated(eval_dir, {24: 0.6})
    assert os.path.exists(record + ".damaged")
    assert sorted(summaries.recorded_evaluations(eval_dir)) == [*sorted(ACCURACY), 24]
    assert summaries.read_evaluations(eval_dir).damage is None


@pytest.mark.parametrize("how", DAMAGES)
def test_the_best_checkpoint_and_export_survive_a_damaged_record(tmp_path, how):
    """The issue: a damaged record made step 20 (0.63) replace step 12 (0.65) as the published
    version, and checkpoint 12 was rotated away."""
    model_dir = str(tmp_path)
    eval_dir = best.eval_dir(model_dir, None)
    _evaluated(eval_dir)
    _damage(os.path.join(eval_dir, summaries.EVALUATIONS_FILE), how)

    keep = best.KeepBest(model_dir, ex.BestCheckpoint("accuracy", "max"))
    assert keep.should_preserve(_checkpoint_infos([12, 16, 20]), context=None) == [
        True,
        False,
        False,
    ]
    exporter = exporters.BestExporter("best", lambda: None, metric="accuracy", mode="max")
    exporter.watch(eval_dir)
    result = {"accuracy": 0.63, "loss": 0.37, "global_step": 20}
    assert exporter.choose(20, result, False, {1: 8, 2: 12}) is None  # 12 stays published
    better = {"accuracy": 0.7, "loss": 0.3, "global_step": 24}
    assert exporter.choose(24, better, False, {1: 8, 2: 12}) == 24


def test_without_event_files_nothing_is_deleted_or_replaced_on_a_damaged_record(tmp_path):
    """No event file to rebuild from (deleted by hand): every checkpoint is kept, and the
    published version is not replaced, until an evaluation's record is sound again."""
    model_dir = str(tmp_path)
    eval_dir = best.eval_dir(model_dir, None)
    os.makedirs(eval_dir)
    for step, value in ACCURACY.items():
        summaries.record_evaluation(eval_dir, {"accuracy": value, "global_step": step})
    _damage(os.path.join(eval_dir, summaries.EVALUATIONS_FILE), "truncated")

    keep = best.KeepBest(model_dir, ex.BestCheckpoint("accuracy", "max"))
    assert keep.should_preserve(_checkpoint_infos([12, 16, 20]), context=None) == [True] * 3
    exporter = exporters.BestExporter("best", lambda: None, metric="accuracy", mode="max")
    exporter.watch(eval_dir)
    assert exporter.choose(20, {"accuracy": 0.63, "global_step": 20}, False, {1: 12}) is None
    # Nothing published yet: the evaluation at hand is the best there is to publish.
    assert exporter.choose(20, {"accuracy": 0.63, "global_step": 20}, False, {}) == 20


def test_a_sound_record_without_event_files_is_used_as_written(tmp_path):
    eval_dir = str(tmp_path / "eval")
    summaries.record_evaluation(eval_dir, {"loss": 0.5, "global_step": 10})
    assert summaries.read_evaluations(eval_dir) == summaries.Evaluations(
        {10: {"loss": 0.5, "global_step": 10}}
    )


def test_a_redone_evaluation_that_differs_in_the_last_digits_agrees(tmp_path):
    # Killed after the summaries, before the record; redone with reductions in another order.
    eval_dir = str(tmp_path / "eval")
    writer = summaries.Summaries(eval_dir, unique_steps=True)
    writer.scalars(10, {"loss": 0.123456789})
    writer.close()
    summaries.record_evaluation(eval_dir, {"loss": 0.12345681, "global_step": 10})
    assert summaries.read_evaluations(eval_dir).damage is None


@pytest.mark.parametrize(
    "content",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"stopped_at": ' * 100_000 + "1" + "}" * 100_000,
        '{"stopped_at": "12", "best_step": 4}',
        '{"stopped_at": true, "best_step": 4}',
        '{"stopped_at": -1, "best_step": 4}',
        "[1, 2]",
        "\xff",
    ],
)
def test_a_damaged_early_stop_record_is_one_warning_and_does_not_hold_training_back(
    tmp_path, content, caplog
):
    with open(tmp_path / best.EARLY_STOP_FILE, "w", errors="surrogateescape") as f:
        f.write(content)
    caplog.set_level(logging.WARNING)
    assert best.read_early_stop(str(tmp_path)) is None
    assert best.read_early_stop(str(tmp_path)) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "is unreadable" in warnings[0], warnings
    assert len(warnings[0]) < 300
    config = types.SimpleNamespace(train_after_early_stop=False)
    assert best.held_back(str(tmp_path), config) is None


def test_deeply_nested_records_do_not_end_early_stopping_checks(tmp_path):
    """Item 13: the hook reads both files at its checks; a RecursionError ended training."""
    est_dir = str(tmp_path)
    eval_dir = best.eval_dir(est_dir, None)
    os.makedirs(eval_dir)
    with open(os.path.join(eval_dir, summaries.EVALUATIONS_FILE), "w") as f:
        f.write("[" * 100_000)
    with open(os.path.join(est_dir, best.EARLY_STOP_FILE), "w") as f:
        f.write("{" * 100_000)
    estimator = types.SimpleNamespace(model_dir=est_dir)
    hook = ex.stop_if_no_increase_hook(estimator, "accuracy", 4, run_every_steps=1)
    assert hook.decision(10) is None
