"""The hang watchdog: no step within the timeout -> every thread's stack, the last step, exit 75."""

from __future__ import annotations

import sys
import threading

import pytest

from estimax.estimator import watchdog


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
