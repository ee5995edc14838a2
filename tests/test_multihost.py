"""Two processes on localhost (JAX's CPU runtime, gloo collectives) against one process.

Each run is the MNIST program on the demo's digits (tests/multihost_worker.py); the 2-process job
has 2 CPU devices per process, the 1-process job 4, so both train 4 replicas on the same global
batches. Slow: every run starts JAX and compiles (a persistent compilation cache shares that).
"""

from __future__ import annotations

import os

import multihost_helpers as mh
import pytest

from estimax.parallel import distributed, preflight


def test_preflight_names_the_field_and_every_process_value():
    same = {"flags": {"batch_size": 8}, "data_files": {"train.tfrecords": 100}}
    preflight.compare([same, same])
    other = {"flags": {"batch_size": 8}, "data_files": {"train.tfrecords": 99}}
    with pytest.raises(preflight.PreflightError) as e:
        preflight.compare([same, other, same])
    assert str(e.value).startswith(
        "pre-flight check: the 3 processes disagree on data_files.train.tfrecords (process 0: "
        "100, process 1: 99, process 2: 100)."
    )
    with pytest.raises(preflight.PreflightError, match="on flags.extra .*process 1: '<missing>'"):
        preflight.compare([{"flags": {"extra": 1}}, {"flags": {}}])


def test_cluster_numbers_without_an_address_are_refused(monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="give --coordinator_address=HOST:PORT"):
        distributed.initialize(None, num_processes=2, process_id=1)
    assert distributed.initialize(None, None, None) is False  # one process: nothing to join


@pytest.mark.slow
def test_two_processes_train_and_evaluate_as_one(tmp_path_factory):
    _, one_dir, one = mh.reference(1, tmp_path_factory)
    _, two_dir, two = mh.reference(2, tmp_path_factory)
    # Same parameters as one process with the same global batch (float tolerance: the gradient
    # sums are reduced across processes in another order).
    mh.assert_same_params(mh.params(two_dir), mh.params(one_dir))
    # Exact evaluation: 19 held-out digits on process 0, 16 on process 1 (which runs one batch
    # fully masked), the same metrics and count as one process, reported by both processes.
    reference = mh.eval_results(one[0].stderr)
    assert reference["num_examples"] == mh.NUM_EVAL
    for proc in two:
        results = mh.eval_results(proc.stderr)
        assert results["num_examples"] == mh.NUM_EVAL
        assert results["accuracy"] == pytest.approx(reference["accuracy"], abs=1e-6)
        assert results["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    # Summaries once: only process 0 writes event files.
    events = [f for f in os.listdir(two_dir) if f.startswith("events.out.tfevents")]
    assert len(events) == 1, events


@pytest.mark.slow
def test_killed_job_restarts_exactly(tmp_path_factory, tmp_path):
    data_dir, two_dir, _ = mh.reference(2, tmp_path_factory)
    # Both processes die (SIGKILL) when reading their 6th batch, once the checkpoint of step 2
    # is complete: before step 6.
    killed = mh.run_job(2, data_dir, str(tmp_path), faults={0: "kill:6:2", 1: "kill:6:2"})
    assert [p.returncode for p in killed] == [-9, -9], [p.stderr[-2000:] for p in killed]
    resumed_from = mh.params(str(tmp_path))["step"]
    assert resumed_from in (2, 4)
    restarted = mh.run_job(2, data_dir, str(tmp_path))
    mh.assert_ok(restarted)
    assert f"Restored checkpoint at step {resumed_from}" in restarted[0].stderr
    # Each host's input position was saved: the restart trains on exactly the batches the
    # uninterrupted job did.
    mh.assert_same_params(mh.params(str(tmp_path)), mh.params(two_dir), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_a_mismatched_flag_stops_every_process_naming_it(tmp_path_factory, tmp_path):
    data_dir = mh.write_data(str(tmp_path_factory.getbasetemp() / "multihost_data"))
    procs = mh.run_job(2, data_dir, str(tmp_path), per_process={1: ("--learning_rate=0.2",)})
    for proc in procs:
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert (
            "FATAL: pre-flight check: the 2 processes disagree on flags.learning_rate "
            "(process 0: 0.1, process 1: 0.2)" in proc.stderr
        ), proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.slow
def test_export_with_many_processes_is_refused_before_training(tmp_path_factory, tmp_path):
    data_dir = mh.write_data(str(tmp_path_factory.getbasetemp() / "multihost_data"))
    procs = mh.run_job(2, data_dir, str(tmp_path), f"--export_dir={tmp_path / 'exports'}")
    for proc in procs:
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "FATAL: --export_dir with 2 processes: export from one process" in proc.stderr
    assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.slow
def test_a_host_that_stops_stepping_trips_its_watchdog_and_the_job_ends(tmp_path_factory, tmp_path):
    # After the reference run: its compiled programs are in the compilation cache, so the first
    # step is quick and the watchdog's timeout measures the hang, not compiling.
    data_dir, _, _ = mh.reference(2, tmp_path_factory)
    # Process 1's input blocks at its 4th batch; process 0 then waits in the step's collective.
    procs = mh.run_job(
        2,
        data_dir,
        str(tmp_path),
        # Long enough for the first step's compile on a loaded machine (3 test workers).
        "--watchdog_timeout=30",
        # The peer's end comes sooner than the default 60 s of the peer watch would give it;
        # either way out is checked below.
        "--peer_timeout=10",
        faults={1: "hang:4"},
        timeout=240,
    )
    dump = "estimax watchdog: no training step completed in 30 s; last completed step:"
    # The stuck host dumps its stacks (showing where it is stuck) and exits with the watchdog's
    # status.
    assert procs[1].returncode == 75, procs[1].stderr[-3000:]
    assert dump in procs[1].stderr and "Thread MainThread" in procs[1].stderr
    assert "in blocked_reading_input" in procs[1].stderr
    # Its peer ends too, never hangs: by its own watchdog when that fires first, or (when the
    # stuck host exits first, as under load) by JAX's runtime reporting the lost peer.
    assert procs[0].returncode != 0, procs[0].stderr[-3000:]
    if procs[0].returncode == 75:
        # Its own watchdog, or the peer watch once the stuck host has exited (one line).
        lost = "estimax: lost process 1 " in procs[0].stderr
        assert lost or (dump in procs[0].stderr and "Thread MainThread" in procs[0].stderr)


def test_a_program_refuses_cluster_numbers_without_an_address_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "ESTIMAX_"))}
    proc = mh.run_mnist(str(tmp_path), "--num_processes=2", "--process_id=1", env=env)
    assert proc.returncode == 2
    assert (
        "FATAL: could not join the multi-process job: num_processes=2, process_id=1 given "
        "without a coordinator address" in proc.stderr
    )
    assert "Traceback" not in proc.stderr
