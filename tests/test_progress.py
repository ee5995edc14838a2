"""Training progress: a line with the ETA updated in place on a terminal, plain lines in a log.

The same training runs in a child process with its stderr on a real pseudo-terminal, then
on a pipe (a CI log).
"""

from __future__ import annotations

import errno
import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = textwrap.dedent("""
    import sys
    import estimax as ex
    import bestmodel_job as job

    x, y = job.data(64, seed=0)
    est = ex.Estimator(
        job.model_fn,
        ex.RunConfig(model_dir=sys.argv[1], iterations_per_loop=2, log_step_count_steps=4,
                     save_checkpoints_steps=10, num_shards=1),
        train_batch_size=16,
    )
    est.train(ex.numpy_input_fn(x, y, seed=1), max_steps=20)
""")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, env.get("PYTHONPATH", "")])
    env.setdefault("ESTIMAX_REQUIRE_ONEDNN", "0")
    env.pop("COLUMNS", None)
    return env


def _on_a_terminal(model_dir: str) -> str:
    """The child's stderr as a terminal shows it (raw bytes: carriage returns kept)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, model_dir],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env=_env(),
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError as e:  # EIO: the child closed the terminal
            if e.errno != errno.EIO:
                raise
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait() == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode(errors="replace")


def test_on_a_terminal_the_progress_line_shows_the_eta(tmp_path):
    out = _on_a_terminal(str(tmp_path))
    # Redrawn in place: each redraw starts with a carriage return, on the same line.
    redraws = re.findall(r"\rstep (\d+)/20 \|[^\r\n]*ETA (\d\d:\d\d|\?)[^\r\n]*loss=", out)
    assert redraws, out[-2000:]
    assert [int(step) for step, _ in redraws][-1] == 20
    assert any(eta != "?" for _, eta in redraws)
    # Log lines are printed above the bar (cleared, then redrawn below them), whole: what the
    # terminal shows of each line is its last carriage-return segment.
    shown = [_shown(line) for line in out.split("\n")]
    assert any(re.search(r"loss = [\d.]+, step = 4$", line) for line in shown), shown[-20:]
    assert any(re.search(r"Loss for final step: [\d.]+\.$", line) for line in shown)
    assert not any("step = " in line and "ETA" in line for line in shown)
    assert re.search(r"step 20/20 .*100% .*ETA 00:00", shown[-2])


def _shown(line: str) -> str:
    """What a terminal shows of a line: the text after its last carriage return that is not
    a clearing run of spaces (each segment is drawn over the previous from column 0)."""
    segments = [seg for seg in line.rstrip("\r").split("\r") if seg.strip()]
    return segments[-1] if segments else ""


def test_in_a_log_there_are_plain_lines_and_no_carriage_returns(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)], env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stderr
    assert re.search(r"Progress: step 8 / 20 \(40%\), ETA \d+:\d\d:\d\d", proc.stderr), proc.stderr
    assert proc.stderr.count("Loss for final step") == 1
