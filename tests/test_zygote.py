"""tests/zygote.py: a job's processes forked from one interpreter behave as started ones do."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import zygote

SCRIPT = """\
import os, sys, time
what = sys.argv[1]
print("argv", sys.argv[1:], "var", os.environ.get("ZYGOTE_TEST_VAR"))
sys.stdout.flush()
if what == "exit":
    sys.exit(int(sys.argv[2]))
if what == "raise":
    sys.excepthook = lambda *a: print("hooked:", a[1], file=sys.stderr)
    raise ValueError("from the program")
if what == "sleep":
    print("sleeping", file=sys.stderr, flush=True)
    time.sleep(600)
"""


def test_forked_processes_have_their_argv_env_output_and_exit_status(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT)
    base = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}

    def spec(name: str, *argv: str, **env: str) -> zygote.Spec:
        return zygote.Spec(
            (str(script), *argv),
            {**base, **env},
            str(tmp_path / f"{name}.out"),
            str(tmp_path / f"{name}.err"),
        )

    specs = [
        spec("a", "exit", "3", ZYGOTE_TEST_VAR="one"),
        spec("b", "raise", ZYGOTE_TEST_VAR="two"),
        spec("c", "sleep"),
        spec("d", "end"),
    ]
    procs = zygote.start(base, specs)
    assert len({p.pid for p in procs} | {os.getpid()}) == 5
    assert procs[0].wait(120) == 3
    out, _ = procs[0].communicate()
    assert out == "argv ['exit', '3'] var one\n"
    # An uncaught exception goes to the program's own sys.excepthook, and the status is 1.
    assert procs[1].wait(120) == 1
    out, err = procs[1].communicate()
    assert out == "argv ['raise'] var two\n" and err == "hooked: from the program\n"
    assert procs[3].wait(120) == 0
    with pytest.raises(subprocess.TimeoutExpired):
        procs[2].wait(0.01)
    assert procs[2].poll() is None
    procs[2].send_signal(signal.SIGKILL)
    assert procs[2].wait(120) == -signal.SIGKILL
    assert procs[2].communicate()[1] == "sleeping\n"


def test_a_variable_jax_reads_at_import_that_differs_is_not_forked():
    base = {"JAX_PLATFORMS": "cpu", "PATH": "/bin"}
    assert zygote.can_fork(base, [dict(base), {**base, "JAX_PROCESS_ID": "1", "TF_CONFIG": "{}"}])
    assert not zygote.can_fork(base, [dict(base), {**base, "JAX_PLATFORMS": "tpu"}])
    assert not zygote.can_fork(base, [{**base, "JAX_ENABLE_X64": "1"}])
