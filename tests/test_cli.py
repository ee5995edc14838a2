"""The programs' command lines as a user meets them: each mistake named at start.

The user-facing tests run the real programs and assert the exit status, the one ``FATAL: ...``
line and that no traceback was shown. Two run the console scripts in a subprocess, as a user
meets them (the process boundary: absl's app, its log format, the exit status); the others run
the same entry point's parsing and run (``cli._parse``, ``cli._run``) in this process, which
costs no interpreter start-up. Every case stops before training.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys

import fsspec
import numpy as np
import pytest
from absl import flags

from estimax.data import tfrecord
from estimax.models.resnet import ResNetTiny
from estimax.programs import (
    cli,
    common,
    configs,
    efficientnet,
    inception_v3,
    inception_v4,
    inputs,
    mnist,
    modes,
    resnet,
)
from estimax.programs.job import Job
from estimax.state import lock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import seed_command_lines  # noqa: E402

MODULES = {"resnet": resnet, "inception_v3": inception_v3, "estimax-mnist": mnist}


def run_program(
    program: str,
    *args: str,
    cwd,
    env: dict[str, str] | None = None,
    timeout: int = 300,
    tiny_resnet: bool = False,
) -> subprocess.CompletedProcess:
    """Runs ``program`` as a user does: its console script, with this checkout first.

    ``tiny_resnet``: resnet with the tests' tiny ResNet as its network, whatever
    --resnet_depth says (tests/tiny_resnet_shim.py), for a test of the command line, not of
    the network."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ESTIMAX_", "TPU_"))
        or k in ("ESTIMAX_ONEDNN", "ESTIMAX_REQUIRE_ONEDNN")
    }
    base["PYTHONPATH"] = os.pathsep.join([REPO, base.get("PYTHONPATH", "")])
    script = shutil.which(program, path=os.path.dirname(sys.executable))
    module = {"estimax-mnist": "mnist"}.get(program, program)
    cmd = [script] if script else [sys.executable, "-m", f"estimax.programs.{module}"]
    if tiny_resnet:
        assert program == "resnet", program
        cmd = [sys.executable, os.path.join(REPO, "tests", "tiny_resnet_shim.py"), "resnet"]
    return subprocess.run(
        [*cmd, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**base, **(env or {})},
        timeout=timeout,
    )


@dataclasses.dataclass
class Ran:
    """A program run in this process: its exit status, what it printed to stderr, and its log
    records as ``LEVEL: message`` lines (a subprocess shows them on stderr in absl's format)."""

    returncode: int
    stderr: str
    log: str


def run_here(
    program: str,
    *args: str,
    cwd,
    monkeypatch,
    capsys,
    caplog,
    env: dict[str, str] | None = None,
) -> Ran:
    """Runs ``program`` as its console script does (``cli.main``: ``cli._parse`` then
    ``cli._run``), in this process, on a fresh flag registry, in ``cwd``, with the environment
    ``run_program`` gives a subprocess. A traceback would be an exception raised here."""
    for name in list(os.environ):
        if name.startswith(("ESTIMAX_", "TPU_")) and name not in (
            "ESTIMAX_ONEDNN",
            "ESTIMAX_REQUIRE_ONEDNN",
        ):
            monkeypatch.delenv(name)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(cwd)
    family = importlib.import_module(
        f"estimax.programs.{ {'estimax-mnist': 'mnist'}.get(program, program) }"
    ).FAMILY
    fv = flags.FlagValues()
    family.define_flags(fv)
    config = None if family.config_keys is None else (family.name, family.config_keys)
    capsys.readouterr()
    caplog.clear()
    code = 0
    with caplog.at_level(logging.INFO):
        try:
            argv = cli._parse(fv, [program, *args])
            cli._run(family.run_from_flags, fv, sorted(fv), config, argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    log = "\n".join(f"{r.levelname}: {r.getMessage()}" for r in caplog.records)
    return Ran(code, capsys.readouterr().err, log)


@pytest.fixture
def here(tmp_path, monkeypatch, capsys, caplog):
    """``here(program, *args, env=...)``: ``run_here`` in ``tmp_path``."""
    return functools.partial(
        run_here, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys, caplog=caplog
    )


def fatal_line(proc: subprocess.CompletedProcess | Ran) -> str:
    """The one line a user mistake ends with; asserts exit status 2 and no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("FATAL: "), proc.stderr[-3000:]
    return last


def parse(program: str, argv: list[str]) -> flags.FlagValues:
    fv = flags.FlagValues()
    MODULES[program].define_flags(fv)
    fv([program, *argv])
    return fv


# ------------------------------------------------- locations: empty refused, under / warned


def test_empty_location_is_refused_naming_the_flag_and_the_unset_variable(tmp_path):
    last = fatal_line(run_program("resnet", "--model_dir=", cwd=tmp_path))
    assert last.startswith("FATAL: --model_dir is empty: an environment variable")
    assert "$MODEL_DIR" in last and "probably unset" in last
    assert os.listdir(tmp_path) == []  # no ./checkpoints left behind


def test_root_location_is_warned_and_real_data_without_data_dir_refused(tmp_path):
    model_dir = f"/estimax-test-{os.getpid()}"
    # The seeds' Inception line with $STORAGE_BUCKET set but no --data_dir at all.
    proc = run_program("inception_v3", f"--model_dir={model_dir}", "--use_data=real", cwd=tmp_path)
    last = fatal_line(proc)
    assert last.startswith("FATAL: --data_dir is not set") and "--use_data=fake" in last
    warning = [
        line for line in proc.stderr.splitlines() if "directly under the filesystem root" in line
    ]
    assert warning and warning[0].startswith("W") and f"--model_dir={model_dir}" in warning[0]
    assert "${STORAGE_BUCKET}/inception" in warning[0]
    assert not os.path.exists(model_dir)  # warned before anything was created


def test_check_location_rules():
    assert cli.check_location("model_dir", "gs://bucket/run") == "gs://bucket/run"
    assert cli.check_location("export_dir", None) is None
    with pytest.raises(cli.UsageError, match=r"--model_dir=gs:///run names no bucket"):
        cli.check_location("model_dir", "gs:///run")
    with pytest.raises(cli.UsageError, match="--model_dir is required"):
        cli.check_location("model_dir", None, required=True)
    with pytest.raises(cli.UsageError, match="--data_dir is empty"):
        cli.check_location("data_dir", "  ")


# ------------------------------------------------- fake data only when asked, and then said


def test_fake_data_is_warned_at_start_and_in_tensorboard(tmp_path, here):
    from tensorboard.backend.event_processing import event_accumulator

    model_dir = tmp_path / "m"
    # --mode=eval with --eval_timeout=0 sets everything up and stops at once (no checkpoint).
    proc = here(
        "resnet",
        "--data_dir=fake",
        f"--model_dir={model_dir}",
        "--mode=eval",
        "--eval_timeout=0",
        "--num_cores=1",
    )
    last = fatal_line(proc)
    warnings = [line for line in proc.log.splitlines() if "FAKE DATA" in line]
    assert warnings and warnings[0].startswith("WARNING: ") and "--data_dir=fake" in warnings[0]
    # --mode=eval says what it waits for and where, then gives up after --eval_timeout.
    assert f"Waiting for checkpoints in {model_dir}/checkpoints" in proc.log
    assert "giving up after --eval_timeout=0 s" in proc.log
    assert last == (
        f"FATAL: no checkpoint appeared in --model_dir={model_dir} within "
        "--eval_timeout=0 s: is it the training job's --model_dir?"
    )
    acc = event_accumulator.EventAccumulator(str(model_dir), size_guidance={"tensors": 0})
    acc.Reload()
    [event] = acc.Tensors("run_description/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert "FAKE DATA" in text and "random images" in text


def test_fake_data_values():
    assert inputs.check_data("null", "train")[:2] == (None, "zeros")
    assert inputs.check_data("fake", "train")[:2] == (None, "random")
    assert inputs.check_data(inputs.FAKE_DATA_DIR, "train")[:2] == (None, "random")
    _, _, notes = inputs.check_data("x", "train", use_fake=True)
    assert notes and "--use_data=fake" in notes[0]
    with pytest.raises(cli.UsageError, match="--data_dir is not set"):
        inputs.check_data(None, "train")


# ------------------------------------------------- a missing split is found at start


def test_missing_split_is_found_at_start(tmp_path, here):
    data = tmp_path / "data"
    data.mkdir()
    with tfrecord.TFRecordWriter(str(data / "train-00000-of-00001")) as w:
        w.write(b"x")
    last = fatal_line(here("resnet", f"--data_dir={data}", f"--model_dir={tmp_path / 'm'}"))
    assert last.startswith(
        f"FATAL: --data_dir={data} has no validation-* files, which --mode=train_and_eval reads"
    )
    assert not (tmp_path / "m").exists()
    # --mode=train reads only train-*: the same data_dir passes the check.
    assert inputs.check_data(str(data), "train") == (str(data), "random", [])


# ------------------------------------------------- one line for every user mistake


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--train_steps=-5"], "FATAL: flag --train_steps=-5: -5 is not a positive integer"),
        (
            ["--resnet_depth=19"],
            "FATAL: --resnet_depth=19: must be one of [18, 34, 50, 101, 152, 200]",
        ),
        (
            ["--iterations_per_loop=4", "--steps_per_device_call=8"],
            "FATAL: --steps_per_device_call=8 is more than --iterations_per_loop=4",
        ),
        (
            ["--gradient_accumulation_steps=0"],
            "FATAL: flag --gradient_accumulation_steps=0: 0 is not",
        ),
        (
            ["--train_batch_size=64", "--gradient_accumulation_steps=3"],
            "FATAL: --gradient_accumulation_steps=3 (RunConfig.gradient_accumulation_steps) must "
            "divide each replica's train batch, 8 (train_batch_size=64 over 8 replicas), into "
            "equal micro-batches: use 2 or 4",
        ),
    ],
    ids=[
        "flag_parser",
        "program_check",
        "device_loop_longer_than_the_loop",
        "accumulation_below_one",
        "accumulation_not_dividing_the_batch",
    ],
)
def test_user_mistakes_end_in_one_line(tmp_path, here, args, expected):
    last = fatal_line(here("resnet", f"--model_dir={tmp_path / 'm'}", "--data_dir=fake", *args))
    assert last.startswith(expected)


@pytest.mark.slow  # initialises a (tiny) ResNet before the warm start reads the path
def test_a_warm_start_from_nowhere_ends_in_one_line(tmp_path, monkeypatch, here):
    # The tests' tiny ResNet whatever --resnet_depth says (as tests/tiny_resnet_shim.py does):
    # a test of the command line, not of the network.
    monkeypatch.setattr(
        resnet, "resnet_v1", lambda depth, classes, **kw: ResNetTiny(num_classes=classes, **kw)
    )
    last = fatal_line(
        here(
            "resnet",
            f"--model_dir={tmp_path / 'm'}",
            "--data_dir=fake",
            "--resnet_depth=18",
            "--image_size=32",
            "--train_batch_size=8",
            "--train_steps=1",
            f"--warm_start_from={tmp_path / 'nowhere'}",
        )
    )
    assert last.startswith(f"FATAL: --warm_start_from={tmp_path / 'nowhere'}: neither a TensorFlow")


def test_sizes_are_checked_when_parsed_not_as_bad_records():
    with pytest.raises(flags.IllegalFlagValueError, match="--image_size=0"):
        parse("resnet", ["--image_size=0"])
    with pytest.raises(flags.IllegalFlagValueError, match="--width=64"):
        parse("inception_v3", ["--width=64"])


def test_model_mismatch_names_the_flag_and_what_to_do(tmp_path, here):
    model_dir = tmp_path / "m"
    cli.check_model_dir(
        str(model_dir), "resnet", {"resnet_depth": 18, "num_label_classes": 1000}, write=True
    )
    last = fatal_line(
        here(
            "resnet",
            f"--model_dir={model_dir}",
            "--data_dir=fake",
            "--resnet_depth=34",
        )
    )
    assert last == (
        f"FATAL: --resnet_depth=34, but the checkpoints in --model_dir={model_dir} "
        f"were written with --resnet_depth=18 (see {model_dir}/flags.json): use "
        "another --model_dir to train a new model, or --resnet_depth=18 to continue "
        "this one."
    )
    assert not (model_dir / lock.LOCK_FILE).exists()  # the lock went with the run
    with pytest.raises(cli.UsageError, match="holds a resnet model"):
        cli.check_model_dir(str(model_dir), "inception_v3", {"num_classes": 1001}, write=False)
    # The same flags pass, and a training run records them.
    cli.check_model_dir(
        str(model_dir), "resnet", {"resnet_depth": 18, "num_label_classes": 1000}, write=True
    )
    assert json.loads((model_dir / "flags.json").read_text())["flags"]["resnet_depth"] == 18


# ------------------------------------------------- one trainer per model_dir


def test_second_trainer_exits_naming_the_first(tmp_path, here):
    model_dir = tmp_path / "m"
    with lock.WriterLock(str(model_dir)):  # this test process is "the first trainer"
        last = fatal_line(here("resnet", f"--model_dir={model_dir}", "--data_dir=fake"))
    assert last == (
        f"FATAL: --model_dir is in use by another trainer: pid {os.getpid()} on "
        f"host {socket.gethostname()} (see {model_dir}/writer.lock). Stop it or use "
        "another --model_dir; a lock left by a process that died is taken over "
        "automatically."
    )
    assert not (model_dir / lock.LOCK_FILE).exists()  # released by its holder only


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    path = tmp_path / lock.LOCK_FILE
    path.write_text(
        json.dumps({"host": socket.gethostname(), "pid": int(dead), "heartbeat": 1e12})
    )  # a heartbeat from the future: pid decides
    with lock.WriterLock(str(tmp_path)) as held:
        assert json.loads(path.read_text())["pid"] == os.getpid()
        assert held.read()["host"] == socket.gethostname()
    assert not path.exists()


def test_lock_on_an_object_store_goes_stale_by_heartbeat():
    # fsspec's memory:// filesystem stands for gs:// and s3:// here: no O_EXCL, no pids.
    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    first = lock.WriterLock(
        "memory://bucket/run",
        clock=clock,
        host="host-a",
        pid=11,
        heartbeat_secs=3600,
        stale_secs=300,
    )
    first.acquire()
    try:
        second = lock.WriterLock(
            "memory://bucket/run", clock=clock, host="host-b", pid=22, stale_secs=300
        )
        with pytest.raises(lock.LockError, match="pid 11 on host host-a"):
            second.acquire()
        now[0] += 301  # host-a stopped beating (its heartbeat thread waits an hour here)
        assert "heartbeat is 301 s old" in second.stale_reason(second.read())
        second.acquire()
        assert second.read()["host"] == "host-b"
        second.release()
    finally:
        first._stop.set()
    assert not fsspec.filesystem("memory").exists("/bucket/run/writer.lock")


# ------------------------------------------------- help, flags on every program


@pytest.mark.parametrize("program", ["resnet", "inception_v3", "efficientnet", "estimax-mnist"])
def test_console_scripts_list_their_flags(program_help, program):
    proc = program_help(program)  # one --help run per program, shared (conftest.py)
    assert "Traceback" not in proc.stderr  # (absl's --help exits with status 1)
    for name in ("--model_dir", "--data_dir", "--[no]skip_bad_records", "--export_dir"):
        assert name in proc.stdout, (program, name)
    assert "ORIGINAL_SYSTEM" not in proc.stdout and "§" not in proc.stdout
    assert "ESTIMAX_" in proc.stdout  # the module docstring, standing on its own


def _captured_job(monkeypatch, program: str, argv: list[str]) -> Job:
    jobs = []
    monkeypatch.setattr(common, "run", jobs.append)
    fv = parse(program, argv)
    MODULES[program].run_from_flags(fv)
    return jobs[0]


def test_skip_bad_records_and_export_dir_reach_the_inception_run(tmp_path, monkeypatch):
    job = _captured_job(
        monkeypatch,
        "inception_v3",
        [
            "--use_data=fake",
            f"--model_dir={tmp_path}",
            f"--export_dir={tmp_path / 'e'}",
            "--skip_bad_records",
            "--width=107",
            "--height=107",
        ],
    )
    assert job.input_fn.keywords["skip_bad_records"] is True
    assert job.loop.export_dir == str(tmp_path / "e")
    assert job.serving.shape == (None, 107, 107, 3) and job.serving.dtype == np.float32
    assert job.input_fn.keywords["index_beside_data"] is False  # issue #51: never, by default
    job = _captured_job(
        monkeypatch,
        "resnet",
        ["--data_dir=fake", f"--model_dir={tmp_path}", "--skip_bad_records", "--index_beside_data"],
    )
    assert job.input_fn.keywords["skip_bad_records"] is True
    assert job.input_fn.keywords["index_beside_data"] is True
    assert job.input_fn.keywords["index_dir"] == f"{tmp_path}/shard_indexes"


def test_steps_per_device_call_reaches_every_programs_run_config(tmp_path, monkeypatch):
    for program, argv in (
        ("resnet", ["--data_dir=fake", "--iterations_per_loop=8"]),
        ("inception_v3", ["--use_data=fake", "--iterations=8", "--width=107", "--height=107"]),
    ):
        job = _captured_job(
            monkeypatch, program, [*argv, f"--model_dir={tmp_path}", "--steps_per_device_call=4"]
        )
        assert job.config.steps_per_device_call == 4, program
        assert job.config.iterations_per_loop == 8, program


@pytest.mark.parametrize(
    "module,argv",
    [
        (resnet, ["--train_batch_size=64"]),
        (efficientnet, ["--train_batch_size=64"]),
        (inception_v3, ["--train_batch_size=64"]),
        (inception_v4, ["--train_batch_size=64"]),
        (mnist, ["--batch_size=64"]),
    ],
    ids=lambda v: getattr(v, "__name__", "").rsplit(".", 1)[-1] or None,
)
def test_gradient_accumulation_steps_reaches_every_programs_run_config(
    tmp_path, monkeypatch, module, argv
):
    jobs: list[Job] = []
    monkeypatch.setattr(common, "run", jobs.append)
    fv = flags.FlagValues()
    module.define_flags(fv)
    # --compile_for: no data is read (run, which would compile, is replaced).
    fv(
        ["program", *argv, f"--model_dir={tmp_path}", "--compile_for=v5e:2x2"]
        + ["--gradient_accumulation_steps=4"]
    )
    module.run_from_flags(fv)
    assert jobs[0].config.gradient_accumulation_steps == 4


def test_mnist_skip_bad_records(tmp_path):
    path = str(tmp_path / "train.tfrecords")
    from estimax.tools import mnist_data

    mnist_data.write_tfrecords(path, np.zeros((3, 784), np.uint8), np.array([1, 2, 3]))
    with open(path, "ab") as f:
        f.write(b"\x05\x00")  # a truncated record at the end
    with pytest.raises(cli.UsageError, match="--skip_bad_records"):
        mnist.load_tfrecords(path)
    x, y = mnist.load_tfrecords(path, skip_bad_records=True)
    assert x.shape == (3, 784) and y.tolist() == [1, 2, 3]


# ------------------------------------------------- settings from the environment


def test_flags_from_the_environment_and_the_command_line_wins():
    fv = parse("resnet", ["--train_steps=7"])
    used = cli.apply_environment(
        fv,
        {
            "ESTIMAX_TRAIN_STEPS": "9",
            "ESTIMAX_IMAGE_SIZE": "64",
            "ESTIMAX_SKIP_BAD_RECORDS": "true",
            "TPU_MODEL_DIR": "gs://b/tpu",
            "TPU_GRPC_URL": "grpc://x",
        },
    )
    assert fv.train_steps == 7  # the command line wins
    assert fv.image_size == 64 and fv.skip_bad_records is True
    assert fv.model_dir == "gs://b/tpu" and fv.master == "grpc://x"
    assert used == {
        "image_size": "ESTIMAX_IMAGE_SIZE",
        "skip_bad_records": "ESTIMAX_SKIP_BAD_RECORDS",
        "model_dir": "TPU_MODEL_DIR",
        "master": "TPU_GRPC_URL",
    }
    fv = parse("resnet", [])
    cli.apply_environment(fv, {"ESTIMAX_MODEL_DIR": "/a", "TPU_MODEL_DIR": "/b"})
    assert fv.model_dir == "/a"  # the documented prefix before the job runner's variable
    with pytest.raises(
        cli.UsageError,
        match=r"\$ESTIMAX_IMAGE_SIZE='big' is not a valid "
        r"--image_size",
    ):
        cli.apply_environment(parse("resnet", []), {"ESTIMAX_IMAGE_SIZE": "big"})


def test_environment_reaches_the_program(tmp_path, here):
    proc = here(
        "resnet",
        env={
            "ESTIMAX_DATA_DIR": str(tmp_path / "nothing"),
            "TPU_MODEL_DIR": str(tmp_path / "m"),
            "TPU_NAME": "my-tpu",
        },
    )
    last = fatal_line(proc)
    assert last.startswith(f"FATAL: --data_dir={tmp_path / 'nothing'} has no train-* files")
    assert (
        "From the environment: --data_dir=$ESTIMAX_DATA_DIR, --model_dir=$TPU_MODEL_DIR, "
        "--tpu=$TPU_NAME" in proc.log
    )
    assert "$TPU_NAME=my-tpu (the Cloud TPU the job runner gave this job): not needed" in proc.log


# ------------------------------------------------- the seeds' lines with their variables unset


@pytest.mark.parametrize(
    "seed,command",
    seed_command_lines.SEED_COMMANDS,
    ids=[f"{s}-{i}" for i, (s, _) in enumerate(seed_command_lines.SEED_COMMANDS)],
)
def test_seed_line_with_unset_variables_stops_at_start(seed, command, tmp_path, monkeypatch):
    # In-process (the subprocess tests above show how a UsageError reaches the user);
    # scripts/seed_command_lines.py --unset runs the same lines as subprocesses.
    monkeypatch.chdir(tmp_path)
    program, argv = seed_command_lines.to_estimax_argv(command, "", unset=True)
    mod = importlib.import_module(f"estimax.programs.{program}")
    fv = flags.FlagValues()
    mod.define_flags(fv)
    fv([program, *argv])
    with pytest.raises(cli.UsageError) as e:
        mod.run_from_flags(fv)
    assert str(e.value).startswith(("--model_dir is empty", "--data_dir is empty"))
    assert os.listdir(tmp_path) == []


def test_eval_mode_says_where_it_waits_for_a_mistyped_model_dir(tmp_path, caplog):
    class NoEstimator:  # evaluate is never reached: no checkpoint appears
        model_dir = str(tmp_path / "typo")

    loop = configs.LoopConfig(mode="eval", train_steps=10, steps_per_eval=1, eval_timeout=0)
    with caplog.at_level("INFO"):
        assert modes.evaluate_checkpoints(NoEstimator(), None, loop) is None
    assert (
        f"Waiting for checkpoints in {tmp_path}/typo/checkpoints (a training job's "
        f"--model_dir={tmp_path}/typo, which does not exist yet) and evaluating each new one "
        "until step 10; giving up after --eval_timeout=0 s without a new one."
    ) in caplog.text


def test_model_flags_on_an_object_store():
    # memory:// stands for gs:// and s3:// (fsspec): written aside, moved into place.
    cli.check_model_dir("memory://bucket/flags", "mnist", {"dense_units": 128}, write=True)
    assert fsspec.filesystem("memory").ls("/bucket/flags", detail=False) == [
        "/bucket/flags/flags.json"
    ]
    with pytest.raises(cli.UsageError, match="--dense_units=64, but the checkpoints"):
        cli.check_model_dir("memory://bucket/flags", "mnist", {"dense_units": 64}, write=False)
