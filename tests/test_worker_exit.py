"""Worker processes end with their parent: SIGKILL a converter or a process-mode loader, and no
worker is left running (estimax.data.worker_exit).

The workers are held busy in a read that never returns (a FIFO nobody writes; a transform that
waits on one), so only their parent's death can end them. Linux only: the processes are found
through /proc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="finds processes through /proc (Linux)"
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Bounds on waits for something that happens in well under a second when it works.
START_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 20.0


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None if it no longer exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1])


def _running(pid: int) -> bool:
    """Exists and is not a zombie (a zombie has exited; only its parent's wait() is missing)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def _descendants(pid: int) -> set[int]:
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(int(name))) is not None:
            parents[int(name)] = stat[1]
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _poll(condition, timeout_s: float, what: str):
    """Polls ``condition()`` until it returns something truthy; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.01)
    return result


def _kill_and_expect_no_orphans(proc: subprocess.Popen, workers: set[int]) -> None:
    family = _descendants(proc.pid) | workers
    assert workers <= family
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    try:
        _poll(
            lambda: not any(_running(p) for p in family),
            EXIT_TIMEOUT_S,
            f"the workers {sorted(workers)} and the rest of {sorted(family)} to exit",
        )
    finally:  # a failed run leaves no orphans behind either
        for pid in family:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigkilled_converter_leaves_no_worker_running(tmp_path):
    # Two shards, each with an image that is a FIFO: each worker blocks opening it.
    for label in ("a", "b"):
        os.makedirs(tmp_path / "train" / label)
        os.mkfifo(tmp_path / "train" / label / "stalled.jpg")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "estimax.tools.convert",
            "folder",
            f"--train_dir={tmp_path / 'train'}",
            f"--output_dir={tmp_path / 'out'}",
            "--train_shards=2",
            "--num_workers=2",
            "--no_progress",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def blocked_workers():
            assert proc.poll() is None, "the converter exited before it could be killed"
            # Blocked in open() of a FIFO: the kernel's wait channel names it.
            blocked = set()
            for pid in _descendants(proc.pid):
                try:
                    with open(f"/proc/{pid}/wchan") as f:
                        if f.read() == "wait_for_partner":
                            blocked.add(pid)
                except FileNotFoundError:
                    pass
            return blocked if len(blocked) == 2 else None

        workers = _poll(blocked_workers, START_TIMEOUT_S, "two workers blocked on the FIFOs")
        _kill_and_expect_no_orphans(proc, workers)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


LOADER_CHILD = """
import os, sys, threading

from estimax.data import loader


def stall(record, rng):
    # Announce this worker, then wait for ever (nothing sets the event).
    open(os.path.join(sys.argv[1], f"worker-{os.getpid()}"), "w").close()
    threading.Event().wait()


if __name__ == "__main__":
    ld = loader.Loader(
        [b"x"] * 64, stall, 4, shuffle=False, num_workers=2, worker_type="process", chunk_size=1
    )
    next(iter(ld))
"""


def test_sigkilled_process_mode_loader_leaves_no_worker_running(tmp_path):
    script = tmp_path / "loader_child.py"
    script.write_text(textwrap.dedent(LOADER_CHILD))
    marks = tmp_path / "marks"
    marks.mkdir()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(marks)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def announced_workers():
            assert proc.poll() is None, "the loader's process exited before it could be killed"
            pids = {int(n.split("-")[1]) for n in os.listdir(marks)}
            return pids if len(pids) == 2 else None

        workers = _poll(announced_workers, START_TIMEOUT_S, "two loader workers to start")
        # Forkserver workers: grandchildren of the loader's process (its forkserver's children).
        assert workers <= _descendants(proc.pid)
        _kill_and_expect_no_orphans(proc, workers)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
