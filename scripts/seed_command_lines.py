"""Runs every command line of the seed documents with estimax's programs in place of the originals.

Each ``python <original script> --flags...`` line of the seeds (000: Cloud TPU
Inception v3/v4 tutorials; 001: Paperspace Gradient ResNet README; 004: the ResNet README) runs
with ``python -m estimax.programs.<name>``, the same flags, and only these appended:
``--train_steps``/``--image_size`` (``--width/--height`` for Inception, its minimum 107) and
batch-size overrides (plus the eval-set size and steps between evaluations, so the run finishes
here), ``--model_dir`` for lines that name a bucket, and fake data: ``$DATA_DIR`` becomes the
seeds' own ``gs://cloud-tpu-test-datasets/fake_imagenet``, which estimax maps to local fake data.

The ResNet README's Cloud Bigtable line (``--bigtable_project=$PROJECT --bigtable_instance=$INSTANCE
--bigtable_table=$TABLE``) runs against the Cloud Bigtable emulator (``cbtemulator`` of the Cloud
SDK, started here on a free port, ``BIGTABLE_EMULATOR_HOST`` set for the program), whose table
``load_bigtable`` first fills with small fake ImageNet records through ``estimax-convert
fake-imagenet`` and ``estimax-convert to-bigtable``. Without the emulator that line is reported
as skipped.

With ``--unset`` each line runs as a user's first try does, its shell variables unset (so
``--data_dir=$DATA_DIR`` is ``--data_dir=`` and ``--model_dir=${STORAGE_BUCKET}/inception`` is
``--model_dir=/inception``): each must stop at start, in seconds, with exit status 2, one
``FATAL: --<flag> ...`` line naming the variable-like flag, no traceback, and nothing written.

    python scripts/seed_command_lines.py            # full models (minutes each on 2 CPU cores)
    python scripts/seed_command_lines.py --unset    # every line stops at start, naming the flag

``tests/test_programs.py`` runs the same lines in-process with the tiny model variants, and
``tests/test_cli.py`` with their variables unset.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

SEEDS_DIR = os.environ.get("ESTIMAX_SEEDS_DIR", "/work/shared/seeds")
SEED_FILES = ("000_205ea632e84c21cc.txt", "001_4049241e1e03a510.txt", "004_3440b27b10ebf5ff.txt")

# The command lines as extract_commands() finds them in the seeds (kept here so the test runs
# where the seeds are absent; tests/test_programs.py checks the two agree when they are there).
SEED_COMMANDS: list[tuple[str, str]] = [
    (
        "000",
        "python /usr/share/tpu/models/experimental/inception/inception_v3.py --tpu=$TPU_NAME "
        "--learning_rate=0.165 --train_steps=250000 --iterations=500 --use_tpu=True "
        "--use_data=real --mode=train_and_eval --train_steps_per_eval=2000 "
        "--data_dir=${DATA_DIR} --model_dir=${STORAGE_BUCKET}/inception",
    ),
    (
        "000",
        "python /usr/share/tpu/models/experimental/inception/inception_v4.py --tpu=$TPU_NAME "
        "--learning_rate=0.36 --train_steps=1000000 --iterations=500 --use_tpu=True "
        "--use_data=real --train_batch_size=256 --mode=train_and_eval "
        "--train_steps_per_eval=2000 --data_dir=${DATA_DIR} "
        "--model_dir=${STORAGE_BUCKET}/inception",
    ),
    (
        "001",
        "python resnet_main.py --master=$TPU_GRPC_URL "
        "--data_dir=gs://cloud-tpu-test-datasets/fake_imagenet --model_dir=$TPU_MODEL_DIR "
        "--train_batch_size=1024 --eval_batch_size=128",
    ),
    ("004", "python resnet_main.py --tpu=$TPU_NAME --data_dir=$DATA_DIR --model_dir=$MODEL_DIR"),
    (
        "004",
        "python resnet_main.py --tpu=$TPU_NAME --model_dir=$MODEL_DIR "
        "--bigtable_project=$PROJECT --bigtable_instance=$INSTANCE --bigtable_table=$TABLE",
    ),
]

PROGRAMS = {
    "inception_v3.py": "inception_v3",
    "inception_v4.py": "inception_v4",
    "resnet_main.py": "resnet",
}

# Small overrides so each line finishes here (appended: absl lets a later flag win).
OVERRIDES = {
    "resnet": [
        "--train_steps=2",
        "--train_batch_size=16",
        "--eval_batch_size=16",
        "--num_eval_images=16",
        "--image_size=32",
        "--steps_per_eval=1",
        "--iterations_per_loop=1",
    ],
    "inception_v3": [
        "--train_steps=2",
        "--train_batch_size=8",
        "--eval_batch_size=8",
        "--eval_total_size=8",
        "--width=107",
        "--height=107",
        "--train_steps_per_eval=1",
        "--iterations=1",
    ],
}
OVERRIDES["inception_v4"] = OVERRIDES["inception_v3"]

# The Bigtable line's $PROJECT/$INSTANCE/$TABLE: a table of the emulator that load_bigtable fills.
BIGTABLE_ENV = {"PROJECT": "my-project", "INSTANCE": "my-instance", "TABLE": "imagenet"}


def uses_bigtable(command: str) -> bool:
    """Whether a seed line reads Cloud Bigtable (and so needs the emulator and a loaded table)."""
    return "--bigtable_instance" in command


def load_bigtable(work_dir: str) -> None:
    """Fills the Bigtable line's table with 32 training and 16 validation fake ImageNet records.

    Writes them as TFRecord shards under ``work_dir`` with ``estimax-convert fake-imagenet`` and
    copies them with ``estimax-convert to-bigtable`` (replacing rows already there), into the
    Bigtable that ``BIGTABLE_EMULATOR_HOST`` names.
    """
    from estimax.tools import convert

    data_dir = os.path.join(work_dir, "bigtable_data")
    steps = (
        [
            "fake-imagenet",
            f"--output_dir={data_dir}",
            "--train_examples=32",
            "--validation_examples=16",
            "--train_shards=2",
            "--validation_shards=1",
            "--min_size=40",
            "--max_size=64",
            "--no_progress",
            "--overwrite",
        ],
        [
            "to-bigtable",
            f"--data_dir={data_dir}",
            f"--bigtable_project={BIGTABLE_ENV['PROJECT']}",
            f"--bigtable_instance={BIGTABLE_ENV['INSTANCE']}",
            f"--bigtable_table={BIGTABLE_ENV['TABLE']}",
            "--overwrite",
        ],
    )
    for argv in steps:
        if convert.main(argv) != 0:
            raise RuntimeError(f"estimax-convert {shlex.join(argv)} failed")


def extract_commands(seeds_dir: str = SEEDS_DIR) -> list[tuple[str, str]]:
    """Finds the ``python <script>.py ...`` command lines of the seed files.

    Handles the three layouts of the seeds: one line with `` \\ `` separators (scraped HTML),
    ``\\``-continued lines (with HTML tags around), and a continued block ending at a blank line.

    Returns:
      [(seed number, the command as one line)], in file order.
    """
    found = []
    for name in SEED_FILES:
        with open(os.path.join(seeds_dir, name), encoding="utf-8") as f:
            lines = [re.sub(r"<[^>]+>", "", line).rstrip() for line in f]
        i = 0
        while i < len(lines):
            m = re.search(r"python (\S+\.py)\b.*", lines[i])
            if not m or os.path.basename(m.group(1)) not in PROGRAMS:
                i += 1
                continue
            parts = [m.group(0)]
            while parts[-1].endswith("\\") and i + 1 < len(lines) and lines[i + 1].strip():
                parts[-1] = parts[-1][:-1]
                i += 1
                parts.append(lines[i].strip())
            tokens = [t for t in " ".join(parts).split() if t != "\\"]
            found.append((name[:3], " ".join(tokens)))
            i += 1
    return found


def to_estimax_argv(command: str, model_dir: str, unset: bool = False) -> tuple[str, list[str]]:
    """The estimax program name and its arguments for a seed command line.

    ``$DATA_DIR`` becomes the seeds' public fake-data bucket (which estimax maps to local fake
    data), model directories become ``model_dir``, other variables placeholder values. With
    ``unset`` every variable expands to '' (as the shell does for an unset one).
    """
    env = {
        "TPU_NAME": "my-tpu",
        "DATA_DIR": "gs://cloud-tpu-test-datasets/fake_imagenet",
        "STORAGE_BUCKET": model_dir,
        "MODEL_DIR": model_dir,
        "TPU_MODEL_DIR": model_dir,
        "TPU_GRPC_URL": "grpc://10.240.1.2:8470",
        **BIGTABLE_ENV,
    }
    expanded = re.sub(
        r"\$\{(\w+)\}|\$(\w+)", lambda m: "" if unset else env[m.group(1) or m.group(2)], command
    )
    tokens = shlex.split(expanded)
    assert tokens[0] == "python", command
    program = PROGRAMS[os.path.basename(tokens[1])]
    return program, tokens[2:] + OVERRIDES[program]


# The flags of the seed lines that hold a shell variable naming a location.
LOCATION_FLAGS = ("--model_dir", "--data_dir")


def check_unset_line(command: str, work_dir: str) -> tuple[bool, str]:
    """Runs a seed line with its variables unset; returns (as expected, what it printed last).

    Expected: exit status 2 within a minute, a last line ``FATAL: --model_dir ...`` or
    ``FATAL: --data_dir ...``, no traceback, and nothing created in ``work_dir`` (its cwd).
    """
    program, args = to_estimax_argv(command, "", unset=True)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TPU_MODEL_DIR", "TPU_NAME", "TPU_GRPC_URL")
        and not k.startswith("ESTIMAX_")
        or k in ("ESTIMAX_ONEDNN", "ESTIMAX_REQUIRE_ONEDNN")
    }
    proc = subprocess.run(
        [sys.executable, "-m", f"estimax.programs.{program}", *args],
        capture_output=True,
        text=True,
        cwd=work_dir,
        env=env,
        timeout=300,
    )
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    ok = (
        proc.returncode == 2
        and "Traceback" not in proc.stderr
        and any(last.startswith(f"FATAL: {flag}") for flag in LOCATION_FLAGS)
        and not os.listdir(work_dir)
    )
    return ok, last


def main_unset(commands: list[tuple[str, str]]) -> int:
    """``--unset``: every seed line, its variables unset, stops at start naming the flag."""
    failures = 0
    for seed, command in commands:
        with tempfile.TemporaryDirectory(prefix="estimax_seed_") as tmp:
            start = time.time()
            ok, last = check_unset_line(command, tmp)
            print(
                f"[seed {seed}] {command}\n    {'ok' if ok else 'FAILED'} in "
                f"{time.time() - start:.0f} s: {last}",
                flush=True,
            )
            failures += not ok
    print(f"{len(commands) - failures}/{len(commands)} seed command lines stopped at start")
    return 1 if failures else 0


def main() -> int:
    commands = SEED_COMMANDS
    if os.path.isdir(SEEDS_DIR):
        commands = extract_commands()
    if "--unset" in sys.argv[1:]:
        return main_unset(commands)
    failures, skipped = 0, 0
    with contextlib.ExitStack() as stack:
        for seed, command in commands:
            with tempfile.TemporaryDirectory(prefix="estimax_seed_") as tmp:
                program, args = to_estimax_argv(command, os.path.join(tmp, "model"))
                cmd = [sys.executable, "-m", f"estimax.programs.{program}", *args]
                print(f"[seed {seed}] {shlex.join(cmd[1:])}", flush=True)
                if uses_bigtable(command):
                    from estimax.tools import bigtable_emulator

                    if bigtable_emulator.find_emulator() is None:
                        print(
                            "    SKIPPED: the Cloud Bigtable emulator (cbtemulator) is not "
                            "installed",
                            flush=True,
                        )
                        skipped += 1
                        continue
                    # Started once, on the first line that needs it; BIGTABLE_EMULATOR_HOST is
                    # set for this process (the loading) and the programs it starts.
                    if "BIGTABLE_EMULATOR_HOST" not in os.environ:
                        emulator = stack.enter_context(bigtable_emulator.running_emulator())
                        print(f"    Bigtable emulator at {emulator.host}", flush=True)
                    load_bigtable(tmp)
                start = time.time()
                proc = subprocess.run(cmd, capture_output=True, text=True)
                took = time.time() - start
                ok = proc.returncode == 0 and "Eval results at step 2" in proc.stdout
                what = "ok" if ok else f"FAILED (exit {proc.returncode})"
                tail = (proc.stdout.strip().splitlines() or [""])[-1]
                print(f"    {what} in {took:.0f} s wall: {tail}", flush=True)
                if not ok:
                    failures += 1
                    print(proc.stderr[-3000:], flush=True)
    ran = len(commands) - skipped
    print(
        f"{ran - failures}/{ran} seed command lines ran"
        + (f" ({skipped} skipped: no Bigtable emulator)" if skipped else "")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
