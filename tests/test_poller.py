"""The server's one polling thread (estimax.serving.poller), as the model managers and the
model config file's poller use it."""

from __future__ import annotations

import logging
import queue

from estimax.serving import registry
from estimax.serving.manager import ModelManager
from estimax.serving.poller import Poller


def test_polls_each_interval_and_outlives_a_failed_poll(caplog):
    ticks: queue.Queue[bool] = queue.Queue()  # each wait's answer: False polls, True stops
    waited: list[float] = []
    calls: list[int] = []

    def wait(seconds: float) -> bool:
        waited.append(seconds)
        return ticks.get(timeout=60)

    def poll() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            raise OSError("the disk went away")

    log = logging.getLogger("estimax.test_poller")
    poller = Poller(poll, 2.5, name="poll-test", what="Model m", logger=log, wait=wait)
    caplog.set_level(logging.ERROR, logger="estimax.test_poller")
    poller.start()
    for answer in (False, False, True):
        ticks.put(answer)
    assert poller._thread is not None
    poller._thread.join(timeout=60)  # it ends on its own at the True
    assert not poller._thread.is_alive()
    assert calls == [0, 1]  # the second poll ran after the first one raised
    assert waited == [2.5, 2.5, 2.5]
    (failed,) = caplog.records
    assert failed.getMessage() == "Model m: poll failed" and failed.exc_info is not None
    assert failed.exc_info[1].args == ("the disk went away",)


def test_stop_ends_the_thread_before_its_first_poll():
    calls: list[None] = []
    poller = Poller(lambda: calls.append(None), 3600.0, name="poll-test", what="Model m")
    poller.start()
    poller.stop()
    assert poller._thread is not None and not poller._thread.is_alive()
    assert calls == []


def test_manager_and_config_poller_share_the_poller(tmp_path):
    manager = ModelManager("m", str(tmp_path), [1], poll_wait_seconds=0)
    manager.start()  # one poll now; with 0 seconds no thread
    assert manager._poller._thread is None and manager.polled.is_set()
    manager.stop()
    config = registry.ConfigPoller(str(tmp_path / "models.config"), None, 7.0)  # type: ignore[arg-type]
    assert (config._poller.interval, config._poller.what) == (
        7.0,
        f"--model_config_file={tmp_path / 'models.config'}",
    )
    assert config._poller.name == "poll-model-config"
