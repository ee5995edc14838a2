"""Torn and corrupt checkpoints: detected by checksums, set aside, the previous one used.

Each fault is made on the newest checkpoint (step 4) of a real run; the restarted run must
resume from step 2 and end bit for bit where an uninterrupted run ends, and the user must be
told which checkpoint was bad, which file and what was wrong.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil

import pytest

from estimax.state import checkpoints

try:
    from . import ckpt_fixtures as fx  # tests/reliability as a package
except ImportError:
    import ckpt_fixtures as fx


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(a model_dir trained to 4 with checkpoints 2 and 4, variables of an unbroken run to 6)."""
    base = tmp_path_factory.mktemp("ckpt")
    fx.train(str(base / "to4"), 4)
    reference = fx.train(str(base / "to6"), 6)
    return base / "to4", reference


def _halve_every_file(step_dir):
    for f in fx.step_files(step_dir):
        os.truncate(f, os.path.getsize(f) // 2)
    return "_CHECKPOINT_METADATA has"


def _empty_data_file(step_dir):
    victim = sorted(glob.glob(os.path.join(step_dir, "model", "ocdbt.process_0", "d", "*")))[0]
    open(victim, "wb").close()
    return os.path.relpath(victim, step_dir) + " has 0 bytes, expected"


def _delete_data_file(step_dir):
    victim = sorted(glob.glob(os.path.join(step_dir, "optimizer", "ocdbt.process_0", "d", "*")))[0]
    os.remove(victim)
    return os.path.relpath(victim, step_dir) + " is missing"


def _flip_one_bit(step_dir):
    victim = sorted(glob.glob(os.path.join(step_dir, "model", "ocdbt.process_0", "d", "*")))[-1]
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(victim, "wb").write(bytes(data))
    return os.path.relpath(victim, step_dir) + " has CRC32C"


def _tear_input_position(step_dir):
    # The input iterator's position (the `meta` item, JSON) cut mid-record.
    victim = os.path.join(step_dir, "meta", "metadata")
    text = open(victim).read()
    assert "input_state" in text
    open(victim, "w").write(text[: len(text) // 3])
    return "meta/metadata has"


@pytest.mark.parametrize(
    "fault",
    [_halve_every_file, _empty_data_file, _delete_data_file, _flip_one_bit, _tear_input_position],
)
def test_damaged_latest_checkpoint_falls_back_to_previous(runs, tmp_path, caplog, fault):
    trained, reference = runs
    model_dir = tmp_path / "run"
    shutil.copytree(trained, model_dir)
    step_dir = str(model_dir / "checkpoints" / "4")
    expected_problem = fault(step_dir)

    caplog.set_level(logging.WARNING)
    est = fx.estimator(str(model_dir))
    assert est.get_global_step() == 2
    est.close()
    warnings = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"Checkpoint {step_dir} is damaged: {expected_problem}" in warnings[0]
    # Set aside under a name Orbax does not list; the warning says where.
    (aside,) = glob.glob(step_dir + ".corrupt-*")
    assert f"moved aside to {aside}" in warnings[0]
    assert not os.path.exists(step_dir)

    # Nothing lost: resuming from step 2 (params, optimizer and input position) ends where
    # an uninterrupted run ends, bit for bit; no further warning (no crash loop).
    caplog.clear()
    resumed = fx.train(str(model_dir), 6)
    assert fx.leaves_equal(resumed, reference)
    assert not [r for r in caplog.records if "is damaged" in r.getMessage()]
    assert sorted(n for n in os.listdir(model_dir / "checkpoints") if n.isdigit()) == [
        "2",
        "4",
        "6",
    ]


def test_every_finished_save_has_a_manifest_that_matches(runs):
    trained, _ = runs
    for step in ("2", "4"):
        step_dir = str(trained / "checkpoints" / step)
        manifest = json.load(open(os.path.join(step_dir, checkpoints.MANIFEST_NAME)))
        listed = {os.path.join(step_dir, name) for name in manifest["files"]}
        assert listed == set(fx.step_files(step_dir))  # every file, sizes and CRC32C
        assert checkpoints.verify_manifest(step_dir) is None


def test_unreadable_checkpoint_without_manifest_is_set_aside_and_the_previous_used(
    runs, tmp_path, caplog
):
    # A writer killed between Orbax's finalisation and the manifest: nothing to check against;
    # Orbax's own failure is caught, the step set aside, and training resumes from step 2.
    model_dir = tmp_path / "run"
    shutil.copytree(runs[0], model_dir)
    step_dir = model_dir / "checkpoints" / "4"
    os.remove(step_dir / checkpoints.MANIFEST_NAME)
    (step_dir / "meta" / "metadata").write_text('{"input_state": {"pos')
    caplog.set_level(logging.WARNING)
    est = fx.estimator(str(model_dir))
    assert est.get_global_step() == 4  # unverified, so it is tried
    est.train(fx.train_input_fn(), max_steps=6)
    variables = est.get_variables()
    est.close()
    (warning,) = [r.getMessage() for r in caplog.records if "Resuming from" in r.getMessage()]
    assert f"Checkpoint {step_dir} is damaged (Orbax could not read it: " in warning
    assert "It was moved aside to" in warning
    assert glob.glob(str(step_dir) + ".corrupt-*")
    assert fx.leaves_equal(variables, runs[1])
    # A reader (an evaluator) gets one clear error, not Orbax's traceback, and renames nothing.
    (aside,) = glob.glob(str(step_dir) + ".corrupt-*")
    other = tmp_path / "other"
    shutil.copytree(aside, other / "checkpoints" / "4")
    reader = checkpoints.Checkpointer(str(other), None, read_only=True)
    with pytest.raises(checkpoints.CorruptCheckpointError, match="does not own model_dir"):
        reader.restore_meta(4)
    reader.close()
    assert os.path.isdir(other / "checkpoints" / "4")


def test_checkpoints_iterator_skips_a_damaged_checkpoint_and_leaves_it(runs, tmp_path, caplog):
    model_dir = tmp_path / "run"
    shutil.copytree(runs[0], model_dir)
    step_dir = str(model_dir / "checkpoints" / "4")
    _flip_one_bit(step_dir)
    caplog.set_level(logging.WARNING)
    assert list(checkpoints.checkpoints_iterator(str(model_dir), timeout=0)) == [2]
    (warning,) = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert "has CRC32C" in warning and "does not own model_dir" in warning
    assert os.path.isdir(step_dir)  # a reader never renames the trainer's files


def _empty_step_dir(checkpoints_dir):
    os.mkdir(os.path.join(checkpoints_dir, "6"))  # a copy interrupted before its first file
    return "it is empty (a copy that was interrupted"


def _copy_without_its_model(checkpoints_dir):
    # A copy that stopped after Orbax's metadata and the meta item: no manifest, no model.
    target = os.path.join(checkpoints_dir, "6")
    os.makedirs(os.path.join(target, "meta"))
    for name in ("_CHECKPOINT_METADATA", os.path.join("meta", "metadata")):
        shutil.copy(os.path.join(checkpoints_dir, "4", name), os.path.join(target, name))
    return "it is incomplete: its model item is missing"


def _step_2_renamed_6(checkpoints_dir):
    # Whole and intact (its manifest matches), but step 2's: named 6, it would rewind training.
    shutil.copytree(os.path.join(checkpoints_dir, "2"), os.path.join(checkpoints_dir, "6"))
    return "it holds the checkpoint of step 2, not of step 6 (a checkpoint copied or renamed"


@pytest.mark.parametrize("fault", [_empty_step_dir, _copy_without_its_model, _step_2_renamed_6])
def test_a_step_directory_that_is_not_that_step_is_set_aside(runs, tmp_path, caplog, fault):
    trained, reference = runs
    model_dir = tmp_path / "run"
    shutil.copytree(trained, model_dir)
    checkpoints_dir = str(model_dir / "checkpoints")
    expected_problem = fault(checkpoints_dir)
    step_dir = os.path.join(checkpoints_dir, "6")

    caplog.set_level(logging.WARNING)
    est = fx.estimator(str(model_dir))
    assert est.get_global_step() == 4  # the newest real checkpoint, not the "6" beside it
    est.close()
    (warning,) = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert f"Checkpoint {step_dir} is damaged: {expected_problem}" in warning
    (aside,) = glob.glob(step_dir + ".corrupt-*")
    assert f"moved aside to {aside}" in warning and "Using the previous checkpoint" in warning

    # The restart resumes from step 4 and ends where an uninterrupted run ends, bit for bit;
    # no warning again (no loop of the same fault on every restart).
    caplog.clear()
    resumed = fx.train(str(model_dir), 6)
    assert fx.leaves_equal(resumed, reference)
    assert not [r for r in caplog.records if "is damaged" in r.getMessage()]
    assert checkpoints.Checkpointer(str(model_dir), None, read_only=True).latest_step() == 6
