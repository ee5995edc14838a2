"""The goodput record (estimax/state/goodput.py) and ``estimax goodput``: in-process, tiny."""

from __future__ import annotations

import json
import os
import shutil

import flax.linen as nn
import numpy as np
import optax
import pytest
from tensorboard.backend.event_processing import event_accumulator

import estimax as ex
from estimax import command
from estimax.state import checkpoints, goodput


def _model_fn(features, labels, mode, params):
    logits = nn.Dense(2)(features)
    return ex.EstimatorSpec(
        mode=mode,
        loss=ex.losses.softmax_cross_entropy(logits, labels),
        optimizer=optax.sgd(0.1),
    )


def _input_fn(num_epochs=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    return ex.numpy_input_fn(x, (x[:, 0] > 0).astype(np.int32), num_epochs=num_epochs, seed=1)


def _estimator(model_dir: str) -> ex.Estimator:
    config = ex.RunConfig(
        model_dir=model_dir,
        iterations_per_loop=2,
        save_checkpoints_steps=2,
        keep_checkpoint_max=None,
        num_shards=1,
    )
    return ex.Estimator(_model_fn, config, train_batch_size=8, eval_batch_size=8)


def _job(model_dir: str, max_steps: int) -> None:
    """A job's process: train_and_evaluate, then the process ends (its record closes)."""
    try:
        ex.train_and_evaluate(
            _estimator(model_dir),
            ex.TrainSpec(_input_fn(), max_steps=max_steps),
            ex.EvalSpec(_input_fn(num_epochs=1), steps=None),
        )
    finally:
        goodput.forget(model_dir)


def test_a_job_with_a_restart_from_an_earlier_checkpoint(tmp_path, capsys):
    model_dir = str(tmp_path / "model")
    _job(model_dir, 6)
    first = goodput.summarize(model_dir)
    # Every second of the process is in one bucket: they add up to the wall time.
    assert sum(first.buckets.values()) == pytest.approx(first.wall, abs=1e-4)
    for bucket in ("productive", "compile", "save", "restore", "eval"):
        assert first.buckets[bucket] > 0, bucket
    assert (first.steps, first.runs, first.lost_steps, first.lost_secs) == (6, 1, 0, 0.0)
    assert first.ratio == pytest.approx(first.buckets["productive"] / first.wall)
    # TensorBoard: the process's buckets at every loop's end.
    acc = event_accumulator.EventAccumulator(model_dir, size_guidance={"scalars": 0})
    acc.Reload()
    ratios = {e.step: e.value for e in acc.Scalars("goodput/ratio")}
    assert sorted(ratios) == [2, 4, 6] and all(0 < r < 1 for r in ratios.values())
    assert acc.Scalars("goodput/compile_secs")[-1].value > 0

    # The job "crashed" after step 6 before checkpoints 4 and 6 were durable: the restarted
    # job starts from step 2 and trains 3..6 again: 4 steps lost, with their time.
    for step in (4, 6):
        shutil.rmtree(checkpoints.step_path(model_dir, step))
    _job(model_dir, 6)
    second = goodput.summarize(model_dir)
    assert (second.runs, second.lost_steps, second.steps) == (2, 4, 6)
    assert second.lost_secs > 0
    assert second.buckets["lost"] == second.lost_secs
    assert sum(second.buckets.values()) == pytest.approx(second.wall, abs=1e-4)
    assert len(os.listdir(os.path.join(model_dir, goodput.SUBDIR))) == 2  # one file a process

    assert command.main(["goodput", model_dir]) == 0
    out = capsys.readouterr().out
    assert "lost (steps recomputed)" in out and "lost: 4 steps" in out
    assert f"goodput ratio (productive / wall): {second.ratio:.3f}" in out


def _write(folder, name, lines):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))


def _loop(begin, end, productive, t=0.0):
    return {"t": t, "begin": begin, "end": end, "secs": {"productive": productive}}


def test_lost_steps_and_per_process_step_times_from_the_lines(tmp_path):
    folder = tmp_path / goodput.SUBDIR
    for process, per_step in ((0, 1.0), (1, 3.0)):
        _write(
            folder,
            f"20260101T000000.000000-p{process}.jsonl",
            [
                {"t": 0, "event": "start", "secs": {"startup": 2.0}},
                {"t": 1, "event": "train", "step": 0, "secs": {"restore": 1.0}},
                _loop(0, 4, 4 * per_step),
                _loop(4, 8, 4 * per_step),
            ],
        )
        # Restarted from step 6: steps 7..8 (half the second loop) are lost.
        _write(
            folder,
            f"20260101T010000.000000-p{process}.jsonl",
            [
                {"t": 9, "event": "train", "step": 6, "secs": {"compile": 0.5}},
                _loop(6, 8, 2 * per_step),
            ],
        )
    s = goodput.summarize(str(tmp_path))
    assert s.lost_steps == 2
    assert s.lost_secs == pytest.approx((2 * 1.0 + 2 * 3.0) / 2)  # mean over the processes
    assert s.steps == 8
    assert s.per_process == pytest.approx({0: 1.0, 1: 3.0})
    assert s.slowest is not None and s.slowest[0] == 1
    assert s.step_sd == pytest.approx(1.0)  # per-step times 1, 1, 1, 3, 3, 3
    assert s.wall == pytest.approx(sum(s.buckets.values()))


def test_a_process_ending_on_a_lost_peer_writes_its_interval_in_progress_as_lost(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(goodput, "_recorders", {})
    rec = goodput.recorder(str(tmp_path))
    with rec.phase("productive"):
        rec.interval(0, 2)  # a loop's line: kept
        # ... the next loop is in flight when a peer is lost; the watch's callback runs:
        goodput.abandon_all("lost process 3")
    lines = [json.loads(x) for x in open(rec.path)]  # noqa: SIM115 - read whole at once
    assert lines[-1]["event"] == "failed" and lines[-1]["reason"] == "lost process 3"
    assert set(lines[-1]["secs"]) == {"lost"}
    s = goodput.summarize(str(tmp_path))
    assert s.lost_secs == pytest.approx(lines[-1]["secs"]["lost"]) and s.lost_secs >= 0
    assert s.steps == 2 and s.wall == pytest.approx(sum(s.buckets.values()))


def test_a_torn_last_line_is_skipped(tmp_path):
    folder = tmp_path / goodput.SUBDIR
    _write(folder, "a-p0.jsonl", [_loop(0, 2, 1.0)])
    with open(folder / "a-p0.jsonl", "a") as f:
        f.write('{"t": 5, "begin": 2, "end": 4, "secs": {"produc')  # killed while writing
    assert goodput.summarize(str(tmp_path)).steps == 2


@pytest.mark.parametrize("damage", ["missing", "empty", "corrupt"])
def test_a_missing_or_corrupt_record_is_one_line(tmp_path, capsys, damage):
    folder = tmp_path / goodput.SUBDIR
    if damage == "empty":
        folder.mkdir()
    elif damage == "corrupt":
        _write(folder, "a-p0.jsonl", [_loop(0, 2, 1.0), _loop(2, 4, 1.0)])
        text = (folder / "a-p0.jsonl").read_text().replace("begin", "begin\x00{", 1)
        (folder / "a-p0.jsonl").write_text(text)
    assert command.main(["goodput", str(tmp_path)]) == command.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("estimax goodput: ") and "\n" not in err
    assert ("line 1" in err) if damage == "corrupt" else ("no goodput record" in err)
