"""The writer lock after the faults of real deployments: a restarted container, a read-only
model_dir, a full disk. Each ends in what the user needs: an immediate restart, or one line.

A restarted container runs its trainer as pid 1 again, on the same host name: the lock its
killed predecessor left must not look alive. The test makes that real with a fresh PID namespace
(``unshare --pid --fork --mount-proc``, root only) for the killed trainer and for its restart.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from estimax.state import lock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import multihost_helpers as mh  # noqa: E402
from test_cli import fatal_line  # noqa: E402

UNSHARE_PID = ["unshare", "--pid", "--fork", "--mount-proc"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ESTIMAX_", "PYTEST"))}
    env.update(PYTHONPATH=mh.ROOT, JAX_PLATFORMS="cpu", **extra)
    return env


def _can(command: list[str]) -> str | None:
    """Why ``command`` cannot run here (None if it can)."""
    if shutil.which(command[0]) is None:
        return f"{command[0]} is not installed"
    if os.geteuid() != 0:
        return f"{command[0]} needs root here"
    proc = subprocess.run([*command, "true"], capture_output=True, text=True)
    return None if proc.returncode == 0 else f"{' '.join(command)}: {proc.stderr.strip()}"


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _program(data_dir: str, model_dir: str) -> list[str]:
    return [sys.executable, mh.WORKER, f"--data_dir={data_dir}", f"--model_dir={model_dir}"]


@pytest.mark.slow  # two trainers, each a child process that imports JAX
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PID namespaces are Linux's")
def test_a_trainer_killed_as_pid_1_is_restarted_at_once(tmp_path_factory, tmp_path):
    reason = _can(UNSHARE_PID)
    if reason:
        pytest.skip(f"no fresh PID namespace: {reason}")
    data_dir = mh.write_data(str(tmp_path_factory.getbasetemp() / "multihost_data"))
    model_dir = str(tmp_path / "model")
    command = [*UNSHARE_PID, *_program(data_dir, model_dir), *mh.FLAGS]
    with open(tmp_path / "first.txt", "w") as log:
        first = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=_env(ESTIMAX_TEST_FAULT="wait:4"),
        )
        try:
            assert first.stdout.readline().strip() == "FAULT_READY"  # training: lock held
            (trainer,) = _children(first.pid)
            holder = json.loads(open(os.path.join(model_dir, lock.LOCK_FILE)).read())
            assert (holder["pid"], holder["host"]) == (1, socket.gethostname())
            os.kill(trainer, signal.SIGKILL)  # the container's pid 1 dies: no cleanup
            first.communicate(timeout=120)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
    assert os.path.exists(os.path.join(model_dir, lock.LOCK_FILE))  # left behind
    restarted = subprocess.run(
        command, capture_output=True, text=True, env=_env(), timeout=300
    )  # pid 1 again, same host: the restarted container
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "in use by another trainer" not in restarted.stderr
    assert f"Took over {model_dir}/{lock.LOCK_FILE} from pid 1 on" in restarted.stderr
    assert "Eval results at step 6" in restarted.stdout
    assert not os.path.exists(os.path.join(model_dir, lock.LOCK_FILE))


def test_an_object_store_lock_of_a_restarted_containers_pid_1_is_stale():
    # No flock on an object store: the holder's identity says it is dead. Same host, same
    # kernel, pid 1 -- but pid 1 is now another process (it started at another time).
    now = time.time()
    holder = {
        "host": socket.gethostname(),
        "pid": 1,
        "boot_id": lock.boot_id(),
        "process_start": 12345,
        "heartbeat": now,
        "token": "old",
    }
    starts = {1: 67890}
    held = lock.WriterLock("memory://bucket/restarted", process_start=starts.get, clock=lambda: now)
    reason = held.stale_reason(holder)
    assert reason is not None and "pid 1 on" in reason and "another process now" in reason
    assert held.stale_reason(dict(holder, process_start=67890)) is None  # that one lives
    starts.clear()
    assert "pid 1 no longer runs" in held.stale_reason(holder)
    other_boot = dict(holder, boot_id="another-boot")
    assert "has restarted since" in held.stale_reason(other_boot)
    # A holder on another host is judged by its heartbeat only.
    assert held.stale_reason(dict(holder, host="elsewhere")) is None
    assert "heartbeat is 301 s old" in held.stale_reason(
        dict(holder, host="elsewhere", heartbeat=now - 301)
    )


@pytest.mark.slow  # a child process that imports JAX
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mount namespaces")
def test_a_read_only_model_dir_is_one_line(tmp_path_factory, tmp_path):
    data_dir = mh.write_data(str(tmp_path_factory.getbasetemp() / "multihost_data"))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "flags.json").write_text("{}")  # a finished run's files: nothing to write
    program = [*_program(data_dir, str(model_dir)), *mh.FLAGS]
    if os.geteuid() == 0:  # root writes through file modes: a read-only mount instead
        reason = _can(["unshare", "--mount"])
        if reason:
            pytest.skip(f"no read-only mount: {reason}")
        script = (
            'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" && shift && exec "$@"'
        )
        command = ["unshare", "--mount", "sh", "-c", script, "sh", str(model_dir), *program]
    else:
        model_dir.chmod(0o555)
        command = program
    proc = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=300)
    last = fatal_line(proc)
    assert last.startswith(f"FATAL: --model_dir={model_dir} is not writable (")
    assert "a training run writes its checkpoints there" in last
    assert "--mode=eval to evaluate it" in last


@pytest.mark.slow  # a child process that imports JAX
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE, sh")
def test_a_full_disk_is_one_line(tmp_path_factory, tmp_path):
    # As in test_disk_full.py: a file size limit of 0 makes every write to a file fail with
    # EFBIG, as on a full disk (SIGXFSZ ignored); pipes (the program's output) are exempt.
    data_dir = mh.write_data(str(tmp_path_factory.getbasetemp() / "multihost_data"))
    model_dir = tmp_path / "model"
    limited = ["sh", "-c", 'trap "" XFSZ; ulimit -f 0; exec "$@"', "sh"]
    program = [*_program(data_dir, str(model_dir)), *mh.FLAGS]
    proc = subprocess.run(
        [*limited, *program], capture_output=True, text=True, env=_env(), timeout=300
    )
    last = fatal_line(proc)
    assert last == (
        f"FATAL: Could not write the writer lock {model_dir}/{lock.LOCK_FILE}: File too large "
        "(the disk is full or a file size limit was reached; free space and run again)."
    )
    assert not (model_dir / lock.LOCK_FILE).exists()  # nothing half-written left
