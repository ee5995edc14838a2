"""A preemption notice saves whatever native code did to the process's signal handling.

oneDNN's CPU runtime installs handlers for 15 signals when its engine is created; one of those
signals arriving (a SIGHUP to a ``nohup``'d trainer, a SIGINT to a trainer started with SIGINT
ignored) made it put back the dispositions it had found, SIGTERM's default among them, and the
next SIGTERM killed the trainer without a save (exit 143). Here the MNIST program (convolutions:
oneDNN's engine is created) is stopped at its 4th batch while the test sends the ignored signal
and then SIGTERM: it must save and exit 0, and the restart must continue from that step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from estimax.ops import native
from estimax.state import checkpoints

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import multihost_helpers as mh  # noqa: E402


def _need_onednn() -> None:
    if native.available():
        return
    if os.environ.get("ESTIMAX_REQUIRE_ONEDNN") == "1":
        pytest.fail(f"ESTIMAX_REQUIRE_ONEDNN=1 but {native.status()}")
    pytest.skip(f"oneDNN kernels not built: {native.status()}")


def _ignored(pid: int) -> set[str]:
    """The signals process ``pid`` ignores, as the kernel says."""
    with open(f"/proc/{pid}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    return {signal.Signals(n).name for n in range(1, 32) if mask >> (n - 1) & 1}


# How each case starts the trainer: nohup (SIGHUP ignored), or a shell that ignores SIGINT for
# the command it runs (as a non-interactive shell does for `cmd &`).
LAUNCHERS = {
    "SIGHUP": ["nohup"],
    "SIGINT": ["sh", "-c", 'trap "" INT; exec "$@"', "sh"],
}


@pytest.mark.slow  # a child process that imports JAX and trains
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("ignored", sorted(LAUNCHERS))
def test_sigterm_after_an_ignored_signal_saves_and_exits_0(ignored, tmp_path_factory, tmp_path):
    _need_onednn()
    launched = subprocess.run(
        [*LAUNCHERS[ignored], sys.executable, "-c", "print(open('/proc/self/status').read())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    ignoring = next(line for line in launched.stdout.splitlines() if line.startswith("SigIgn:"))
    assert int(ignoring.split()[1], 16) >> (getattr(signal, ignored) - 1) & 1, ignoring
    data_dir = mh.write_data(str(tmp_path_factory.getbasetemp() / "multihost_data"))
    model_dir = str(tmp_path / "model")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ESTIMAX_", "PYTEST"))}
    env.update(PYTHONPATH=mh.ROOT, ESTIMAX_TEST_FAULT="wait:4", JAX_PLATFORMS="cpu")
    command = [sys.executable, mh.WORKER, f"--data_dir={data_dir}", f"--model_dir={model_dir}"]
    with open(tmp_path / "stderr.txt", "w+") as stderr:
        proc = subprocess.Popen(
            [*LAUNCHERS[ignored], *command, *mh.FLAGS],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
        try:
            ready = proc.stdout.readline()  # the 4th batch: steps have run, oneDNN is loaded
            assert ready.strip() == "FAULT_READY", ready + open(stderr.name).read()[-3000:]
            # Ignored from the launcher on, and again once oneDNN's runtime is loaded.
            assert ignored in _ignored(proc.pid), "native code took over the ignored signal"
            with open(f"/proc/{proc.pid}/maps") as f:
                assert "libestimax_onednn" in f.read()
            os.kill(proc.pid, getattr(signal, ignored))
            os.kill(proc.pid, signal.SIGTERM)
            out, _ = proc.communicate("go\n", timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stderr.seek(0)
        log = stderr.read()
    assert proc.returncode == 0, (proc.returncode, log[-3000:])
    step = mh.saved_step(out)
    assert 1 <= step < mh.TRAIN_STEPS
    assert checkpoints.Checkpointer(model_dir, None, read_only=True).latest_step() == step
    assert "Eval results" not in out  # stopped: no evaluation
    restarted = subprocess.run(
        [*command, *mh.FLAGS], env=dict(env, ESTIMAX_TEST_FAULT=""), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert f"Restored checkpoint at step {step} " in restarted.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_native_code_replacing_sigterm_is_undone_at_the_next_loop(tmp_path):
    """Any native library (not only oneDNN's runtime) that resets SIGTERM behind Python's back:
    the loop's next host sync puts the handler back, so SIGTERM still saves (in a child, whose
    death would not take the test runner with it)."""
    code = """
import ctypes, os, signal
from estimax.parallel import distributed
with distributed.PreemptionNotice() as notice:
    libc = ctypes.CDLL(None)
    libc.signal(signal.SIGTERM, 0)  # SIG_DFL, as native code would set it
    notice.keep_handlers()  # what the loop does at each host sync
    os.kill(os.getpid(), signal.SIGTERM)
    print("NOTICED" if notice.reached(1) else "MISSED", flush=True)
"""
    env = dict(os.environ, PYTHONPATH=mh.ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "NOTICED"
    assert "Native code replaced the handler of SIGTERM; estimax put its own back" in proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_creating_onednns_engine_leaves_the_signal_handlers_as_they_were():
    """In a fresh process (the engine is created once per process): the handlers the runtime
    installs when oneDNN creates its engine are gone once the probe returns."""
    _need_onednn()
    code = """
import signal
from estimax.ops import native

def caught():
    with open("/proc/self/status") as f:
        return next(line for line in f if line.startswith("SigCgt:")).split()[1]

before = caught()
dims = (1, 3, 8, 8, 4, 3, 3, 8, 8, 1, 1, 1, 1, 1, 1)
assert native.probe(native.CONV_KINDS[0], "float32", dims) is None
print(before, caught())
"""
    env = dict(os.environ, PYTHONPATH=mh.ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after = proc.stdout.split()
    assert before == after
