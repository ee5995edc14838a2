"""The resnet program and the converter with every path in a bucket: the GCS emulator
(fake-gcs-server) and an S3 server (moto), pointed at only by STORAGE_EMULATOR_HOST /
AWS_ENDPOINT_URL, as a user would."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
from absl import flags
from conftest import point_clients_at

from estimax import storage
from estimax.models.resnet import ResNetTiny
from estimax.programs import resnet
from estimax.tools import convert

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import seed_command_lines  # noqa: E402 (scripts/ is not a package)

TINY = [
    "--resnet_depth=18",
    "--image_size=32",
    "--train_batch_size=8",
    "--eval_batch_size=8",
    "--precision=float32",
    "--num_cores=1",
    "--iterations_per_loop=1",
    "--num_train_images=32",
    "--num_eval_images=16",
]


def _tiny_network(monkeypatch) -> None:
    """The tests' tiny ResNet, whatever --resnet_depth says: the storage paths are under test
    here, not the network (tests/test_models.py tests ResNet-18)."""
    monkeypatch.setattr(
        resnet, "resnet_v1", lambda depth, classes, **kw: ResNetTiny(num_classes=classes, **kw)
    )


def _resnet(argv: list[str]):
    fv = flags.FlagValues()
    resnet.define_flags(fv)
    fv(["resnet", *argv])
    return resnet.run_from_flags(fv)


def _ls(path: str) -> list[str]:
    fs, p = storage.filesystem(path)
    fs.invalidate_cache()
    return sorted(os.path.basename(x.rstrip("/")) for x in fs.ls(p, detail=False))


@pytest.mark.slow
def test_convert_train_eval_export_resume_all_in_the_bucket(object_store, monkeypatch, capsys):
    monkeypatch.setenv("ESTIMAX_ONEDNN", "0")
    _tiny_network(monkeypatch)
    root, _ = object_store
    data, model, export = f"{root}/data", f"{root}/model", f"{root}/export"

    # The converter writes shards and the manifest to the bucket; verify reads them back.
    assert (
        convert.main(
            [
                "fake-imagenet",
                f"--output_dir={data}",
                "--train_examples=32",
                "--validation_examples=16",
                "--num_classes=10",
                "--train_shards=2",
                "--validation_shards=1",
                "--min_size=40",
                "--max_size=64",
                "--num_workers=1",
                "--no_progress",
            ]
        )
        == 0
    )
    assert _ls(data) == [
        ".estimax-index",  # the indexes: no glob of the shards (TF's train-*) matches them
        "manifest.json",
        "train-00000-of-00002",
        "train-00001-of-00002",
        "validation-00000-of-00001",
    ]
    assert _ls(f"{data}/.estimax-index") == [
        "train-00000-of-00002.idx",
        "train-00001-of-00002.idx",
        "validation-00000-of-00001.idx",
    ]
    capsys.readouterr()
    assert convert.main(["verify", f"--output_dir={data}", "--num_workers=1"]) == 0
    assert "verify: OK: 3 shards, 48 examples" in capsys.readouterr().out

    common = [f"--data_dir={data}", f"--model_dir={model}", *TINY]
    # Train (reading the bucket's shards), checkpoint and export to the bucket.
    assert _resnet([*common, "--mode=train", "--train_steps=2", f"--export_dir={export}"]) is None
    assert _ls(f"{model}/checkpoints") == ["2"]
    assert "commit_success.txt" in _ls(f"{model}/checkpoints/2")
    assert any("tfevents" in n for n in _ls(model))  # the training summaries
    (version,) = _ls(export)
    assert {"signature.json"} <= set(_ls(f"{export}/{version}"))

    # --mode=eval follows the bucket's checkpoints (a sidecar evaluator) up to --train_steps.
    results = _resnet([*common, "--mode=eval", "--train_steps=2", "--eval_timeout=0"])
    assert results["global_step"] == 2 and results["num_examples"] == 16
    assert any("tfevents" in n for n in _ls(f"{model}/eval"))

    # Resume from the bucket: two more steps start at step 2, not from scratch.
    results = _resnet([*common, "--mode=train_and_eval", "--train_steps=4", "--steps_per_eval=2"])
    assert results["global_step"] == 4
    assert _ls(f"{model}/checkpoints") == ["2", "4"]


def _seed_001() -> str:
    (command,) = [c for s, c in seed_command_lines.SEED_COMMANDS if s == "001"]
    return command


def _run_program(program: str, argv: list[str], env: dict[str, str]) -> str:
    """``program``'s command line in its own process; resnet with the tests' tiny ResNet as its
    network (tests/tiny_resnet_shim.py), whatever --resnet_depth says."""
    assert program == "resnet", program
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "tiny_resnet_shim.py"), program, *argv],
        check=False,
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _env(server_url: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")
    }
    env.update(
        STORAGE_EMULATOR_HOST=server_url,
        ESTIMAX_ONEDNN="0",
        PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]),
    )
    return env


@pytest.mark.slow
def test_seed_001_line_with_tpu_model_dir_in_the_emulator_bucket(gcs_emulator, monkeypatch):
    """The Gradient job runner's line, ``--model_dir=$TPU_MODEL_DIR`` expanded by the shell, with
    $TPU_MODEL_DIR in the emulator's bucket and only STORAGE_EMULATOR_HOST set."""
    gcs_emulator.create_bucket("gradient-job")
    model_dir = "gs://gradient-job/output_data"
    program, argv = seed_command_lines.to_estimax_argv(_seed_001(), model_dir)
    assert program == "resnet" and f"--model_dir={model_dir}" in argv
    point_clients_at(monkeypatch, "gs", gcs_emulator.url)
    monkeypatch.setenv("ESTIMAX_ONEDNN", "0")
    # The tiny variant of its network, as tests/test_programs.py runs the seed lines.
    _tiny_network(monkeypatch)
    results = _resnet(argv)  # --mode=train_and_eval (the default), an evaluation every step
    assert results["global_step"] == 2 and "top_1_accuracy" in results
    assert _ls(f"{model_dir}/checkpoints") == ["1", "2"]
    assert any("tfevents" in n for n in _ls(f"{model_dir}/eval"))


@pytest.mark.slow
def test_seed_001_line_without_model_dir_takes_tpu_model_dir(gcs_emulator, monkeypatch):
    """The job runner sets TPU_MODEL_DIR; the program finds it without --model_dir."""
    gcs_emulator.create_bucket("gradient-job-env")
    model_dir = "gs://gradient-job-env/output_data"
    program, argv = seed_command_lines.to_estimax_argv(_seed_001(), model_dir)
    argv = [a for a in argv if not a.startswith("--model_dir")] + ["--resnet_depth=18"]
    env = {
        **_env(gcs_emulator.url),
        "TPU_MODEL_DIR": model_dir,
        "TPU_GRPC_URL": "grpc://10.240.1.2:8470",
    }
    out = _run_program(program, argv, env)
    assert "top_1_accuracy" in out, shlex.join(argv)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.url)
    assert _ls(f"{model_dir}/checkpoints") == ["1", "2"]
