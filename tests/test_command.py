"""The `estimax` command's layout: `estimax train --family=NAME` runs any registered family, a
model file registers its own networks, and the server starts without training code."""

import importlib
import json
import os
import pkgutil
import subprocess
import sys

import pytest

import estimax.models
from estimax.programs import families

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


TINY_RESNET_SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_resnet_shim.py")


def _estimax(*args, timeout=300, tiny_resnet=False):
    """``python -m estimax ARGS``; ``tiny_resnet``: with the tests' tiny ResNet as the resnet
    program's network (tests/tiny_resnet_shim.py)."""
    command = [TINY_RESNET_SHIM, "estimax"] if tiny_resnet else ["-m", "estimax"]
    return subprocess.run(
        [sys.executable, *command, *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "--family=NAME is required: one of efficientnet, inception_v3, inception_v4, mnist"),
        (("--family=bert",), "no program called 'bert': one of efficientnet"),
        (("--family",), "--family=NAME is required"),
    ],
)
def test_train_without_a_known_family_is_one_line(args, message, monkeypatch, capsys):
    if not args:
        # As a user meets it: the command in its own process, whose stderr is that one line.
        proc = _estimax("train", *args)
        assert proc.returncode == 2
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        return
    # The other command lines in this process: the console script's entry point, on them.
    from estimax import command

    monkeypatch.setattr(sys, "argv", ["estimax", "train", *args])
    with pytest.raises(SystemExit) as e:
        command.run()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_train_family_runs_the_program_as_its_own_script(tmp_path):
    # The seeds' `resnet` line through `estimax train --family=resnet` (fake data: no
    # --data_dir): it trains, checkpoints, and records the program's name and flags. The
    # network is the tests' tiny ResNet (the command, not ResNet-18, is under test here).
    model_dir = tmp_path / "model"
    proc = _estimax(
        "train",
        "--family=resnet",
        f"--model_dir={model_dir}",
        "--resnet_depth=18",
        "--image_size=32",
        "--train_batch_size=8",
        "--iterations_per_loop=1",
        "--train_steps=1",
        "--mode=train",
        timeout=600,
        tiny_resnet=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    recorded = json.loads((model_dir / "flags.json").read_text())
    assert recorded["program"] == "resnet" and recorded["flags"]["resnet_depth"] == 18
    assert (model_dir / "checkpoints" / "1").is_dir()
    # A flag of another program is the program's own one-line error, as from its script.
    proc = _estimax("train", "--family=mnist", "--resnet_depth=18")
    assert proc.returncode != 0 and "resnet_depth" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_family_and_model_file_is_registered_from_its_own_file():
    # MODELS is exactly the union of the model files' own MODELS: a new model file needs no
    # line in estimax/models/__init__.py.
    union, tf_names = {}, []
    for info in pkgutil.iter_modules(estimax.models.__path__):
        module = importlib.import_module(f"estimax.models.{info.name}")
        union.update(getattr(module, "MODELS", {}))
        if hasattr(module, "TF_NAMES"):
            tf_names.append(module.TF_NAMES)
    assert estimax.models.MODELS == union and len(union) >= 21
    assert list(estimax.models.TF_NAMES) == tf_names
    # Each family's program names a network the registry has (or is the MNIST CNN).
    for name, family in families.FAMILIES.items():
        assert family.name == name
        if family.tf_names is not None:
            assert family.tf_names in estimax.models.TF_NAMES


def test_the_server_and_export_format_import_no_training_code():
    # What `make lint`'s forbidden contract checks statically, at run time: a serving image can
    # leave training out (estimator, models, programs, optax, orbax are never imported).
    code = (
        "import sys\n"
        "import estimax.serving.server, estimax.serving.cli, estimax.serving.grpc_server\n"
        "import estimax.export.servable, estimax.export.versions, estimax.export.cli\n"
        "import estimax.command\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('optax', 'orbax') or "
        "m.startswith(('estimax.estimator', 'estimax.models', 'estimax.programs'))]\n"
        "print(bad)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
