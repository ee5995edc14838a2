"""The hang watchdog: no step within the timeout -> every thread's stack, the last step, exit 75."""

from __future__ import annotations

import sys
import threading

import pytest

from estimax.parallel import watchdog


def _parked_thread(started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait()


def test_no_heartbeat_dumps_every_threads_stack_and_exits_75(capfd):
    exited: list[int] = []
    done = threading.Event()

    def exit_fn(code: int) -> None:
        exited.append(code)
        done.set()

    started, release = threading.Event(), threading.Event()
    other = threading.Thread(target=_parked_thread, args=(started, release), name="input-reader")
    other.start()
    started.wait()
    try:
        dog = watchdog.Watchdog(0.05, exit_fn=exit_fn).start(step=7)
        dog.heartbeat(12)
        assert done.wait(60), "the watchdog never fired"
    finally:
        release.set()
        other.join()
    assert exited == [watchdog.HANG_EXIT_CODE] == [75]
    err = capfd.readouterr().err
    assert "no training step completed in 0.05 s; last completed step: 12" in err
    # Every thread's stack: the parked one (where a host would hang) and the main thread.
    assert "Thread input-reader" in err and "in _parked_thread" in err
    assert "Thread MainThread" in err and "test_no_heartbeat_dumps_every_threads_stack" in err
    dog.stop()


def test_stopped_watchdog_never_fires():
    dog = watchdog.Watchdog(3600, exit_fn=lambda code: pytest.fail("fired"))
    dog.start(step=0)
    dog.heartbeat(1)
    dog.stop()
    assert not dog.fired and dog._thread is None


@pytest.mark.parametrize("timeout", [None, 0])
def test_zero_or_none_disables_it(timeout):
    dog = watchdog.Watchdog(timeout, exit_fn=lambda code: pytest.fail("fired")).start()
    assert dog.timeout_secs is None and dog._thread is None
    dog.stop()


def test_run_config_refuses_a_negative_timeout():
    import estimax as ex

    with pytest.raises(ValueError, match="watchdog_timeout_secs must be >= 0"):
        ex.RunConfig(watchdog_timeout_secs=-1)
    assert ex.RunConfig().watchdog_timeout_secs == 1800


def test_format_stacks_names_this_frame():
    assert f"in {sys._getframe().f_code.co_name}" in watchdog.format_stacks()


def _watchdog_alive() -> bool:
    return any(t.name == "estimax-watchdog" and t.is_alive() for t in threading.enumerate())


@pytest.mark.slow  # a child process that imports JAX and trains
def test_a_failed_final_save_still_stops_the_watchdog(tmp_path):
    """The last checkpoint's write fails (a real full disk: RLIMIT_FSIZE) in the loop's cleanup:
    the error reaches the caller and every other cleanup still runs, so no armed watchdog is left
    to end a process that caught the error."""
    import os
    import subprocess
    import textwrap

    here = os.path.dirname(os.path.abspath(__file__))
    reliability = os.path.join(here, "reliability")
    code = textwrap.dedent(f"""
        import resource, signal, threading
        import ckpt_fixtures as fx
        from estimax import storage
        fx.train({str(tmp_path)!r}, 2, width=256)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # step 4's files are larger
        est = fx.estimator({str(tmp_path)!r}, width=256, watchdog_timeout_secs=3600)
        try:
            est.train(fx.train_input_fn(), max_steps=4)
        except storage.StorageError as e:
            print("ERROR:", str(e).splitlines()[0])
        print("WATCHDOG:", any(t.name == "estimax-watchdog" for t in threading.enumerate()))
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(here), reliability, env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Could not write checkpoint 4 in" in proc.stdout
    assert "WATCHDOG: False" in proc.stdout, proc.stdout


def test_watchdog_is_paused_while_train_and_evaluate_evaluates(tmp_path):
    """EvalSpec(every_steps=None) evaluates inside the training loop (after a save): an
    evaluation completes no training step, so the watchdog must not count it."""
    import numpy as np

    import estimax as ex

    tests_dir = __import__("os").path.dirname(__file__)
    sys.path.insert(0, __import__("os").path.join(tests_dir, "reliability"))
    try:
        import ckpt_fixtures as fx
    finally:
        sys.path.pop(0)
    x, y = fx.data()
    seen: dict[str, list[bool]] = {"train": [], "eval": []}

    def watched(kind, inner):
        def input_fn(params):
            for batch in inner(params):
                seen[kind].append(_watchdog_alive())
                yield batch

        return input_fn

    est = fx.estimator(str(tmp_path), watchdog_timeout_secs=3600)
    ex.train_and_evaluate(
        est,
        ex.TrainSpec(watched("train", ex.numpy_input_fn(x, y, seed=1)), max_steps=6),
        ex.EvalSpec(
            watched("eval", ex.numpy_input_fn(x[:32], y[:32], shuffle=False, num_epochs=1)),
            throttle_secs=0,
        ),
    )
    est.close()
    assert any(seen["train"]), "the watchdog never ran during training"
    assert seen["eval"] and not any(seen["eval"]), seen["eval"]
    assert np.isfinite(est.evaluate(fx.eval_input_fn())["loss"])
