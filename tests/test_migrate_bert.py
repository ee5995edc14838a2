"""Your own model from its TensorFlow checkpoint: a BERT written by TensorFlow (bert_tiny, by
scripts/make_tf_checkpoints.py), warm-started into run_classifier.py's model_fn in Flax
(examples/bert_classifier.py), converted, and read back by name."""

import dataclasses
import json
import logging
import os
import sys

import jax
import numpy as np
import pytest

import estimax as ex
from estimax import migrate, models
from estimax.migrate.assignment import renamer
from estimax.models.tf_names import Entry, TFNames, register_tf_names
from estimax.state import checkpoints, warm_start
from estimax.tools import convert

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))
import bert_classifier as bert  # noqa: E402

DATA = os.path.join(REPO, "tests", "data", "tf_checkpoints")
BERT = os.path.join(DATA, "bert_tiny")
EXAMPLE = os.path.join(REPO, "examples", "bert_classifier.py")
CLS = ["cls/predictions/output_bias", "cls/seq_relationship/output_bias"]
CLS += ["cls/seq_relationship/output_weights"]


def _tf_values():
    """TensorFlow's own values of every variable (its session's, not our reader's)."""
    refs = np.load(os.path.join(DATA, "reference.npz"))
    reader = migrate.CheckpointReader(BERT)
    flat, out, at = refs["bert_tiny/values"], {}, 0
    for name in refs["bert_tiny/names"]:
        info = reader.variables()[str(name)]
        size = int(np.prod(info.shape))
        out[str(name)] = flat[at : at + size].reshape(info.shape)
        at += size
    return out, refs


TF_VALUES, REFS = _tf_values()
BERT_NAMES = sorted(n for n in TF_VALUES if n.startswith("bert/"))
TO_FLAX = renamer(bert.RENAME)


def _variables(dtype=np.float32):
    """The variables the Estimator gives examples/bert_classifier.py's model_fn (the test below
    checks the names against an Estimator's)."""
    cfg = bert.BertConfig()
    ids = np.zeros((1, 5), np.int32)
    params = {
        "bert": bert.BertModel(cfg).init(jax.random.PRNGKey(0), ids, ids + 1, ids)["params"],
        "classifier": bert.Classifier(2).init(jax.random.PRNGKey(1), np.zeros((1, 8)))["params"],
    }
    return {"params": jax.tree.map(lambda x: np.asarray(x, dtype), params)}


def _leaf(variables, name):
    leaf = variables["params"]
    for key in name.split("/"):
        leaf = leaf[key]
    return leaf


def _warm(**settings):
    return warm_start.warm_start_variables(ex.WarmStartSettings(BERT, **settings), _variables())


def test_bert_warm_starts_exactly_and_reads_back_by_name(tmp_path, caplog):
    est = ex.Estimator(
        bert.model_fn,
        ex.RunConfig(model_dir=str(tmp_path / "m"), num_shards=1),
        # A zero rate: the weights after a step are the warm-started ones (AdamW's decay is
        # scaled by the rate too).
        params={"learning_rate": 0.0, "num_labels": 2},
        train_batch_size=2,
        warm_start_from=ex.WarmStartSettings(BERT, "bert/.*", rename=bert.RENAME),
    )
    with caplog.at_level(logging.INFO):
        est.train(bert.input_fn, max_steps=1)
    text = caplog.text
    assert "39 variables loaded, 2 initialised fresh." in text
    assert "bert/embeddings/LayerNorm/scale <- bert/embeddings/LayerNorm/gamma" in text
    assert "initialised fresh (not warm-started): classifier/output_bias, " in text
    assert "checkpoint variables not used" not in text  # "bert/.*": cls/ is left on purpose

    names = est.get_variable_names()
    assert names == sorted(
        [TO_FLAX(n) for n in BERT_NAMES]
        + ["classifier/output_bias", "classifier/output_weights", "global_step"]
    )
    for name in BERT_NAMES:  # each of the 39 equals TensorFlow's own, bit for bit
        np.testing.assert_array_equal(
            est.get_variable_value(TO_FLAX(name)), TF_VALUES[name].astype(np.float32)
        )
    assert est.get_variable_value("global_step") == 1  # the step starts fresh, not TF's 7
    first = est.latest_checkpoint()
    assert est.get_variable_names(first) == names
    with pytest.raises(KeyError, match="nearest: bert/pooler/dense/kernel"):
        est.get_variable_value("bert/pooler/dense/kernal")

    # The warm-started network computes what TensorFlow's did.
    feats = {
        "input_ids": REFS["bert_tiny/input_ids"],
        "input_mask": REFS["bert_tiny/input_mask"],
        "segment_ids": REFS["bert_tiny/token_type_ids"],
    }
    est_pred = ex.Estimator(
        bert.model_fn,
        ex.RunConfig(model_dir=str(tmp_path / "m"), num_shards=1),
        params={"num_labels": 2},
        predict_batch_size=2,
    )
    pooled = np.stack(
        [p["pooled_output"] for p in est_pred.predict(lambda params: iter([(feats, None)]))]
    )
    np.testing.assert_allclose(pooled, REFS["bert_tiny/pooled_output"], atol=2e-6)
    est.close()
    est_pred.close()


def test_assignment_map_forms_and_renames():
    # A scope, as run_classifier.py's get_assignment_map_from_checkpoint: bert/ only.
    loaded, report = _warm(assignment_map={"bert/": "bert/"}, rename=bert.RENAME)
    assert report.loaded == sorted(TO_FLAX(n) for n in BERT_NAMES)
    for name in BERT_NAMES:
        np.testing.assert_array_equal(_leaf(loaded, TO_FLAX(name)), TF_VALUES[name])
    # A callable rename does what the mapping does.
    _, again = _warm(
        assignment_map={"bert/": "bert/"},
        rename=lambda n: n.replace("/gamma", "/scale").replace("/beta", "/bias"),
    )
    assert again.loaded == report.loaded
    # Variable to variable (the next-sentence head into a new head of its shape), as a list
    # of pairs; and tf.estimator's var_name_to_prev_var_name.
    pairs = [
        ("cls/seq_relationship/output_weights", "classifier/output_weights"),
        ("cls/seq_relationship/output_bias", "classifier/output_bias"),
    ]
    loaded, report = _warm(assignment_map=pairs)
    assert report.loaded == ["classifier/output_bias", "classifier/output_weights"]
    np.testing.assert_array_equal(
        _leaf(loaded, "classifier/output_weights"),
        TF_VALUES["cls/seq_relationship/output_weights"],
    )
    # A selected variable under its own name, not in the checkpoint: refused (as tf.estimator's
    # "Tensor ... is not found"), with its closest names; allowed, it starts fresh.
    half = {
        "vars_to_warm_start": "classifier/.*",
        "var_name_to_prev_var_name": {"classifier/output_bias": "cls/seq_relationship/output_bias"},
    }
    assert _problems(**half) == [
        "not in the checkpoint: 1 of the 2 selected variables",
        "classifier/output_weights: closest in the checkpoint: cls/seq_relationship/output_weights",
    ]
    loaded, report = _warm(**half, allow_missing=True)
    assert report.loaded == ["classifier/output_bias"]
    assert report.sources == {"classifier/output_bias": "cls/seq_relationship/output_bias"}
    assert report.missing == ["classifier/output_weights"]  # its own name: not in the checkpoint
    # One scope into another: the checkpoint's bert/ into a model whose module is "encoder".
    variables = {"params": {"encoder": _variables()["params"]["bert"]}}
    settings = ex.WarmStartSettings(BERT, assignment_map={"bert/": "encoder/"}, rename=bert.RENAME)
    loaded, report = warm_start.warm_start_variables(settings, variables)
    assert len(report.loaded) == 39
    np.testing.assert_array_equal(
        loaded["params"]["encoder"]["pooler"]["dense"]["kernel"],
        TF_VALUES["bert/pooler/dense/kernel"],
    )


def test_the_checkpoints_root_into_a_scope():
    # {"/": "scope/"}: a ResNet's root-level tf.layers names under a module of one's own.
    reader = migrate.CheckpointReader(os.path.join(DATA, "resnet_tiny"))
    names = ["conv2d/kernel", "dense/kernel", "dense/bias"]
    variables = {"params": {"trunk": {}}}
    for name in names:
        scope, leaf = name.split("/")
        variables["params"]["trunk"].setdefault(scope, {})[leaf] = np.zeros(
            reader.variables()[name].shape, np.float32
        )
    settings = ex.WarmStartSettings(
        os.path.join(DATA, "resnet_tiny"), assignment_map={"/": "trunk/"}
    )
    loaded, report = warm_start.warm_start_variables(settings, variables)
    assert report.loaded == ["trunk/conv2d/kernel", "trunk/dense/bias", "trunk/dense/kernel"]
    for name in names:
        np.testing.assert_array_equal(_leaf(loaded, f"trunk/{name}"), reader.get_tensor(name))


def test_without_the_rename_the_layer_norms_are_refused_with_their_names():
    norms = [TO_FLAX(n) for n in BERT_NAMES if "LayerNorm" in n]
    # All trainable variables, by their own names: Flax's scale/bias are TensorFlow's
    # gamma/beta, so the norms are not in the checkpoint, each shown with its closest names.
    problems = _problems()
    # (and the new head's 2, also selected)
    assert problems[0] == f"not in the checkpoint: {len(norms) + 2} of the 41 selected variables"
    assert problems[1] == (
        "bert/embeddings/LayerNorm/bias: closest in the checkpoint: "
        "bert/embeddings/LayerNorm/beta, bert/embeddings/LayerNorm/gamma, "
        "bert/embeddings/word_embeddings"
    )
    assert len(problems) == 1 + warm_start.SHOWN + 1
    assert problems[-1] == f"and {len(norms) + 2 - warm_start.SHOWN} more"


def test_allowed_missing_variables_stay_fresh_and_unused_is_reported():
    loaded, report = _warm(allow_missing=True)
    norms = [TO_FLAX(n) for n in BERT_NAMES if "LayerNorm" in n]
    assert len(report.loaded) == 39 - len(norms)
    assert set(norms) < set(report.missing)
    np.testing.assert_array_equal(
        _leaf(loaded, "bert/embeddings/LayerNorm/scale"),
        _leaf(_variables(), "bert/embeddings/LayerNorm/scale"),
    )
    assert report.asked_for_all
    lines = report.summary().splitlines()
    unused = [line for line in lines if "checkpoint variables not used" in line]
    # One line listing them: the pre-training heads and the unrenamed norms; no global_step.
    assert len(unused) == 1 and "global_step" not in unused[0]
    assert all(name in unused[0] for name in CLS + ["bert/embeddings/LayerNorm/gamma"])
    missing = [line for line in lines if "(not in the checkpoint)" in line]
    assert len(missing) == 1 and "bert/embeddings/LayerNorm/scale" in missing[0]


def test_an_unnamed_top_module_is_refused_with_the_prefix_to_strip():
    # The model_fn's BERT inside a module of the user's own, left unnamed: Flax calls it
    # Top_0, and ".*bert/.*" selects Top_0/bert/..., which the checkpoint has as bert/...
    top = {"params": {"Top_0": _variables()["params"]}}
    settings = ex.WarmStartSettings(BERT, ".*bert/.*", rename=bert.RENAME)
    with pytest.raises(warm_start.WarmStartError) as e:
        warm_start.warm_start_variables(settings, top)
    lines = [line.strip() for line in str(e.value).splitlines()[1:]]
    assert lines[0] == (
        "no variable would be loaded (39 selected): a warm start that loads nothing is refused"
    )
    assert lines[1] == "not in the checkpoint: 39 of the 39 selected variables"
    assert lines[2] == (
        "Top_0/bert/embeddings/LayerNorm/bias: the checkpoint has bert/embeddings/LayerNorm/beta; "
        "strip 'Top_0/'?"
    )
    assert lines[-2] == "and 29 more"
    assert lines[-1] == (
        "every one is in the checkpoint without 'Top_0/': "
        "assignment_map={'bert/': 'Top_0/bert/'} loads them"
    )
    # The map it names loads every one, exactly.
    fixed = dataclasses.replace(settings, assignment_map={"bert/": "Top_0/bert/"})
    loaded, report = warm_start.warm_start_variables(fixed, top)
    assert len(report.loaded) == 39 and not report.missing
    for name in BERT_NAMES:
        np.testing.assert_array_equal(_leaf(loaded, f"Top_0/{TO_FLAX(name)}"), TF_VALUES[name])


def _problems(**settings):
    with pytest.raises(warm_start.WarmStartError) as e:
        _warm(**settings)
    head, *lines = str(e.value).splitlines()
    assert head == f"--warm_start_from={BERT} does not fit the model:"
    return [line.strip() for line in lines]


def test_each_problem_is_one_line_listing_names():
    assert _problems(vars_to_warm_start=["bret/.*", "bert/.*", "nothing"], rename=bert.RENAME) == [
        "vars_to_warm_start matches no variable: 'bret/.*', 'nothing'"
    ]
    assert _problems(vars_to_warm_start="bret/.*") == [
        "vars_to_warm_start matches no trainable variable: 'bret/.*'"
    ]
    assert _problems(
        assignment_map={"bert/": "bret/", "x/y": "classifier/kernel"},
        var_name_to_prev_var_name={"bert/missing": "bert/x"},
    ) == [
        "matches no variable to warm-start: var_name_to_prev_var_name 'bert/missing', "
        "assignment_map 'x/y': 'classifier/kernel', assignment_map 'bert/': 'bret/'"
    ]
    assert _problems(assignment_map={"bert/": "bert"}) == [
        "assignment_map maps a scope to a scope (both ending in '/', as 'bert/': 'bert/') or a "
        "variable to a variable, not one to the other: 'bert/': 'bert'"
    ]
    # Mapped explicitly, a variable must be in the checkpoint and fit (init_from_checkpoint),
    # opt-outs or not.
    problems = _problems(
        assignment_map={
            "bert/": "bert/",
            "cls/nothing": "classifier/output_bias",
            "bert/pooler/dense/kernel": "classifier/output_weights",
        },
        rename=bert.RENAME,
        allow_missing=True,
        allow_shape_mismatch=True,
    )
    assert problems[:2] == [
        "not in the checkpoint: 1 of the 41 selected variables",
        "classifier/output_bias <- cls/nothing: nothing like it in the checkpoint",
    ]
    assert problems[2:] == [
        "other shape or dtype: classifier/output_weights [2, 8] float32 <- "
        "bert/pooler/dense/kernel [8, 8] float32"
    ]


def test_another_dtype_is_refused_unless_allowed_and_always_when_mapped():
    variables = _variables()
    variables["params"]["bert"]["pooler"]["dense"]["kernel"] = np.zeros((8, 8), np.float16)
    settings = ex.WarmStartSettings(BERT, "bert/.*", rename=bert.RENAME)
    # float32 -> float16 would not be TensorFlow's value: refused, both named...
    with pytest.raises(warm_start.WarmStartError, match=r"other shape or dtype: bert/pooler"):
        warm_start.warm_start_variables(settings, variables)
    # ...or, allowed, kept as initialised, and said.
    allowed = dataclasses.replace(settings, allow_shape_mismatch=True)
    loaded, report = warm_start.warm_start_variables(allowed, variables)
    assert report.mismatched == ["bert/pooler/dense/kernel"]
    assert report.lines == [
        "bert/pooler/dense/kernel [8, 8] float16 <- bert/pooler/dense/kernel [8, 8] float32"
    ]
    assert "initialised fresh (other shape or dtype): bert/pooler" in report.summary()
    assert not _leaf(loaded, "bert/pooler/dense/kernel").any()
    mapped = ex.WarmStartSettings(
        BERT, assignment_map={"bert/": "bert/"}, rename=bert.RENAME, allow_shape_mismatch=True
    )
    with pytest.raises(warm_start.WarmStartError, match=r"other shape or dtype: bert/pooler"):
        warm_start.warm_start_variables(mapped, variables)


def test_a_registered_family_map_loads_without_a_rename(monkeypatch):
    monkeypatch.setattr(models, "TF_NAMES", models.TF_NAMES)  # restored after the test

    def entries(variables):
        out = []
        for name in BERT_NAMES:
            flax = TO_FLAX(name).split("/")[1:]  # inside the scope the marker finds
            out.append(Entry("params", tuple(flax), name))
        return out

    names = TFNames("bert", "embeddings", entries)
    register_tf_names(names)
    register_tf_names(names)  # the same map twice: once
    assert models.TF_NAMES[-1] is names and models.TF_NAMES.count(names) == 1
    with pytest.raises(ValueError, match="'bert' are registered already"):
        register_tf_names(TFNames("bert", "embeddings", entries))
    loaded, report = _warm(vars_to_warm_start="bert/.*")
    assert len(report.loaded) == 39
    np.testing.assert_array_equal(
        _leaf(loaded, "bert/embeddings/LayerNorm/scale"),
        TF_VALUES["bert/embeddings/LayerNorm/gamma"],
    )


def test_convert_a_model_fn_with_the_map(tmp_path, capsys):
    rename = tmp_path / "rename.json"
    rename.write_text(json.dumps(bert.RENAME))
    out = str(tmp_path / "converted")
    argv = [
        "tf-checkpoint",
        f"--checkpoint={BERT}",
        f"--model_dir={out}",
        f"--model_fn={EXAMPLE}:model_fn",
        '--params={"num_labels": 2}',
        '--assignment_map={"bert/": "bert/"}',
        f"--rename={rename}",
    ]
    # A map that covers only bert/: the head is missing, cls/ unmapped; refused unless allowed.
    assert convert.main(argv) == 2
    err = capsys.readouterr().err
    assert "missing: classifier/output_weights" in err and "unmapped: cls/predictions" in err
    assert "Traceback" not in err
    assert convert.main([*argv, "--allow_missing", "--allow_unmapped"]) == 0
    printed = capsys.readouterr().out
    assert "loaded 39 variables" in printed and "at step 7" in printed
    saved = checkpoints.Checkpointer(out, read_only=True).restore_numpy(7)["params"]
    for name in BERT_NAMES:
        np.testing.assert_array_equal(_leaf({"params": saved}, TO_FLAX(name)), TF_VALUES[name])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model=bert"], "--model='bert': must be one of resnet"),
        ([f"--model_fn={EXAMPLE}:nothing"], "has no callable 'nothing'"),
        (["--model_fn=no/such.py:model_fn"], "no file no/such.py"),
        (
            [f"--model_fn={EXAMPLE}:model_fn", "--assignment_map={bert"],
            "--assignment_map: not JSON",
        ),
        ([f"--model_fn={EXAMPLE}:model_fn", "--rename=nowhere.json"], "--rename=nowhere.json"),
        (
            [f"--model_fn={EXAMPLE}:model_fn", '--assignment_map={"bert/": "bret/"}'],
            "matches no variable of the model: assignment_map 'bert/': 'bret/'",
        ),
        (["--model=resnet", f"--model_fn={EXAMPLE}:model_fn"], "one of --model or --model_fn"),
    ],
)
def test_convert_mistakes_are_one_line(tmp_path, capsys, flags, message):
    argv = ["tf-checkpoint", f"--checkpoint={BERT}", f"--model_dir={tmp_path / 'o'}", *flags]
    assert convert.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.startswith("estimax-convert tf-checkpoint: error: ")
