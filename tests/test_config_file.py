"""The original's ``--config_file``/``--hparams_file`` and ``--params_override`` (its params_dict).

The original's configs run as they are (the shipped v2-8/v3-8 copies), give the flags the
equivalent command line gives, keep the original's order (defaults < config file <
params_override < environment < command line), refuse what its ``is_strict=True`` refused and
the features estimax does not build, in one line. Parsing is in-process; one subprocess checks
the one-line error and exit status, one ``estimax train --print_config``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from estimax.programs import cli, config_file, efficientnet, families, resnet
from estimax.programs.cli import UsageError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "examples", "configs", "resnet")
V3_8 = os.path.join(CONFIGS, "v3-8.yaml")
# The flags naming the config, not settings of the run.
CONFIG_FLAGS = {spec.name for spec in config_file.FLAGS}


def _effective(program: str, *argv: str, env: dict[str, str] | None = None):
    """``(flags, Effective)`` of ``program``'s command line, as ``cli._run`` applies them."""
    family = families.get(program)
    fv = family.parse(argv)
    used = cli.apply_environment(fv, env or {})
    return fv, config_file.apply(fv, program, family.config_keys, used)


def _settings(effective) -> dict:
    return {n: v for n, (v, _) in effective.values.items() if n not in CONFIG_FLAGS}


def _as_flags(data: dict) -> list[str]:
    """A YAML mapping of flag names as the command line a user would type."""
    out = []
    for key, value in data.items():
        if isinstance(value, bool):
            out.append(f"--{key}" if value else f"--no{key}")
        else:
            out.append(f"--{key}={value}")
    return out


@pytest.mark.parametrize("name", ["v2-8.yaml", "v3-8.yaml"])
def test_original_config_with_override_is_its_command_line(name):
    path = os.path.join(CONFIGS, name)
    with open(path) as f:
        data = yaml.safe_load(f)
    _, from_config = _effective(
        "resnet", f"--config_file={path}", '--params_override={"train_batch_size": 4096}'
    )
    _, from_flags = _effective("resnet", *_as_flags({**data, "train_batch_size": 4096}))
    assert _settings(from_config) == _settings(from_flags)
    # The recipe the model is built from is the same too.
    fv_config, _ = _effective("resnet", f"--config_file={path}", "--params_override=train_steps=7")
    fv_flags, _ = _effective("resnet", *_as_flags({**data, "train_steps": 7}))
    assert resnet.config_from_flags(fv_config) == resnet.config_from_flags(fv_flags)
    # Each of the file's keys is reported as coming from it, the override's from the override.
    sources = {n: s for n, (_, s) in from_config.values.items()}
    assert sources["train_batch_size"] == "params_override"
    assert {sources[k] for k in data if k != "train_batch_size"} == {f"config file {path}"}
    assert sources["resnet_depth"] == "default"


def test_precedence_defaults_config_override_environment_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "train_batch_size: 512\ntrain_steps: 100\neval_batch_size: 256\niterations_per_loop: 10\n"
    )
    fv, eff = _effective(
        "resnet",
        f"--config_file={path}",
        "--params_override=train_steps: 200\neval_batch_size: 128\niterations_per_loop: 20",
        "--iterations_per_loop=7",
        env={"ESTIMAX_EVAL_BATCH_SIZE": "64", "ESTIMAX_ITERATIONS_PER_LOOP": "9"},
    )
    got = {n: eff.values[n] for n in ("num_label_classes", "train_batch_size", "train_steps")}
    assert got == {
        "num_label_classes": (fv["num_label_classes"].default, "default"),
        "train_batch_size": (512, f"config file {path}"),
        "train_steps": (200, "params_override"),
    }
    assert eff.values["eval_batch_size"] == (64, "$ESTIMAX_EVAL_BATCH_SIZE")
    assert eff.values["iterations_per_loop"] == (7, "command line")
    assert fv.train_steps == 200 and fv.eval_batch_size == 64 and fv.iterations_per_loop == 7


@pytest.mark.parametrize(
    "override",
    [
        '{"train_batch_size": 4096}',  # JSON, as the original's README wrote it
        "train_batch_size: 4096",  # YAML
        "train_batch_size=4096",  # params_dict's key=value form
        "FILE",  # a YAML file
    ],
)
def test_params_override_forms(override, tmp_path):
    if override == "FILE":
        override = str(tmp_path / "o.yaml")
        (tmp_path / "o.yaml").write_text("train_batch_size: 4096\n")
    fv, eff = _effective("resnet", f"--params_override={override}")
    assert fv.train_batch_size == 4096
    assert eff.values["train_batch_size"][1].startswith("params_override")


def test_nesting_follows_each_programs_params():
    # EfficientNet takes the nesting of the original's classification configs...
    fv, eff = _effective(
        "efficientnet", "--params_override=train: {train_batch_size: 4096, total_steps: 9}"
    )
    assert (fv.train_batch_size, fv.train_steps) == (4096, 9)
    assert eff.values["train_steps"][1] == "params_override"
    # ...ResNet's params were flat: the original refused train.*, and so does estimax.
    with pytest.raises(
        UsageError, match=r"unknown key 'train.train_batch_size'.*'train_batch_size'"
    ):
        _effective("resnet", "--params_override=train: {train_batch_size: 4096}")


def test_hparams_file_is_the_older_name(tmp_path):
    fv_old, old = _effective("resnet", f"--hparams_file={V3_8}")
    fv_new, new = _effective("resnet", f"--config_file={V3_8}")
    assert _settings(old) == _settings(new)
    assert fv_old.train_steps != families.get("resnet").parse([]).train_steps  # the file set it
    with pytest.raises(UsageError, match="give one of them"):
        _effective("resnet", f"--hparams_file={V3_8}", f"--config_file={V3_8}")


@pytest.mark.parametrize(
    "argv, message",
    [
        # An unset $CONFIG_DIR in --config_file=$CONFIG_DIR/v3-8.yaml.
        (["--config_file=/v3-8.yaml"], r"--config_file=/v3-8.yaml: no such file .*unset"),
        (["--config_file="], r"--config_file is empty: .*unset"),
        (["--params_override=train_steps: [1"], r"not valid YAML/JSON \(line 1"),
        (["--params_override=- 1"], r"not a mapping of keys"),
        (["--params_override=train_batch_size: 0"], r"not a valid --train_batch_size"),
        (["--params_override=resnet_depth: null"], r"resnet_depth: null, but --resnet_depth"),
        # A feature the original had and estimax's ResNet does not build: refused, not ignored.
        (["--params_override=augment_name: randaugment"], r"augment_name: randaugment: .*null"),
        (["--params_override=se_ratio: 0.25"], r"squeeze-and-excitation"),
    ],
)
def test_bad_settings_are_one_line(argv, message):
    with pytest.raises(UsageError, match=message) as e:
        _effective("resnet", *argv)
    assert "\n" not in str(e.value)


def test_keys_with_no_estimax_meaning(tmp_path):
    # The original's defaults of features estimax lacks, and keys read only with them, pass.
    fv, eff = _effective(
        "resnet",
        "--params_override={dropblock_groups: '', dropblock_keep_prob: 0.9, se_ratio: null, "
        "bn_momentum: 0.9, moving_average_decay: 0}",
    )
    assert set(eff.other_keys) == {
        "dropblock_groups",
        "dropblock_keep_prob",
        "se_ratio",
        "bn_momentum",
        "moving_average_decay",
    }
    assert _settings(eff) == _settings(_effective("resnet")[1])  # no flag changed


def test_every_key_table_names_real_flags():
    for family in families.FAMILIES.values():
        if family.config_keys is None:
            continue
        fv = family.parse([])
        flagged = {s.name for s in family.config_keys.values() if isinstance(s, config_file.Flag)}
        assert flagged <= set(fv), family.name
    # The original ResNet's params keys, each decided (configs/resnet_config.py's RESNET_CFG).
    assert len(resnet.CONFIG_KEYS) == 40
    assert efficientnet.CONFIG_KEYS["train.total_steps"] == config_file.Flag("train_steps")


def test_unknown_key_is_one_line_and_exit_2(tmp_path):
    from test_cli import run_program  # tests/ is on the path, as for the other helpers

    path = tmp_path / "v3-8.yaml"
    path.write_text("train_steps: 10\ntrain_batchsize: 64\n")
    proc = run_program("resnet", f"--config_file={path}", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    fatal = [line for line in proc.stderr.splitlines() if line.startswith("FATAL")]
    assert fatal == [
        f"FATAL: --config_file={path}: unknown key 'train_batchsize': not a key of the original "
        "resnet's params (its params_dict refused it too: is_strict=True). Did you mean "
        "'train_batch_size'? The keys: docs/programs.md."
    ]
    assert "Traceback" not in proc.stderr


def test_print_config_shows_sources_and_exits_before_training(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ESTIMAX_", "TPU_"))}
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    model_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "estimax",
            "train",
            "--family=resnet",
            f"--config_file={V3_8}",
            "--params_override=train_batch_size: 4096",
            "--train_steps=5",
            f"--model_dir={model_dir}",
            "--print_config",
        ],
        capture_output=True,
        text=True,
        env={**env, "ESTIMAX_EVAL_BATCH_SIZE": "8"},
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {line.split()[0]: line.split("# ", 1)[1] for line in proc.stdout.splitlines()}
    assert lines["--train_batch_size=4096"] == "params_override"
    assert lines["--iterations_per_loop=113854"] == f"config file {V3_8}"
    assert lines["--train_steps=5"] == "command line"
    assert lines["--eval_batch_size=8"] == "$ESTIMAX_EVAL_BATCH_SIZE"
    assert lines["--resnet_depth=50"] == "default"
    assert not model_dir.exists()  # nothing trained, nothing written
