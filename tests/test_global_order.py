"""One global input order for any number of hosts (estimax.data.order).

The multi-process runs: the MNIST program on the demo's digits, 2 processes x 1 CPU device
against 1 process x 2 devices (tests/multihost_helpers.py). With 2 replicas the cross-replica
gradient sum is one addition of two numbers, the same in any order: the parameters must be
bitwise equal, not merely close.
"""

from __future__ import annotations

import os

import multihost_helpers as mh
import numpy as np
import pytest

from estimax.data.order import GlobalOrder
from estimax.estimator.inputs import NumpyIterator

# 100 training digits in global batches of 8: epochs end inside a batch (100 = 12.5 x 8), where a
# per-host order would diverge from one process's.
NUM_TRAIN = 100
NUM_EVAL = 1000
FLAGS = ("--train_steps=30", "--iterations=5", "--save_checkpoints_steps=5")


def _write_data(path: str) -> str:
    from estimax.tools import mnist_data

    if not os.path.exists(os.path.join(path, "validation.tfrecords")):
        os.makedirs(path, exist_ok=True)
        images, labels = mnist_data.load_mnist_5k()
        (train_x, train_y), (eval_x, eval_y) = mnist_data.split(images, labels)
        assert len(eval_y) == NUM_EVAL
        mnist_data.write_tfrecords(
            os.path.join(path, "train.tfrecords"), train_x[:NUM_TRAIN], train_y[:NUM_TRAIN]
        )
        mnist_data.write_tfrecords(os.path.join(path, "validation.tfrecords"), eval_x, eval_y)
    return path


def _hosts_side_by_side(n, batch, num_hosts, steps, shuffle=True, num_epochs=None, start=None):
    its = [
        NumpyIterator(np.arange(n), None, batch, shuffle, num_epochs, 3, h, num_hosts)
        for h in range(num_hosts)
    ]
    if start is not None:
        for it in its:
            it.set_state(start)
    out = []
    for _ in range(steps):
        parts = [next(it, None) for it in its]
        if all(p is None for p in parts):
            break
        out.append(np.concatenate([p[0] for p in parts if p is not None]))
    return out, its[0].get_state()


@pytest.mark.parametrize("num_hosts", [2, 3, 4])
def test_hosts_together_read_what_one_host_reads(num_hosts):
    one, state_one = _hosts_side_by_side(10, 12, 1, 9)
    many, state_many = _hosts_side_by_side(10, 12 // num_hosts, num_hosts, 9)
    for a, b in zip(one, many, strict=True):
        np.testing.assert_array_equal(a, b)
    assert state_one == state_many  # the same position on every host count


def test_a_position_saved_on_two_hosts_resumes_on_three():
    _, state = _hosts_side_by_side(10, 6, 2, 4)  # 48 examples into the stream
    resumed, _ = _hosts_side_by_side(10, 4, 3, 5, start=state)
    straight, _ = _hosts_side_by_side(10, 12, 1, 9)
    np.testing.assert_array_equal(np.concatenate(resumed), np.concatenate(straight)[48:])


def test_one_pass_covers_every_example_once_on_any_number_of_hosts():
    for num_hosts in (1, 2, 3, 5):
        seen, _ = _hosts_side_by_side(23, 2, num_hosts, 20, shuffle=False, num_epochs=1)
        assert sorted(np.concatenate(seen).tolist()) == list(range(23))


def test_block_straddling_epochs_carries_each_records_epoch():
    order = GlobalOrder(np.arange(5), 2, num_hosts=2, host_index=1, shuffle=True, seed=1)
    ids, epochs, nxt = order.host_block(0, 1)  # stream positions [6, 8): epoch 1 only
    assert epochs.tolist() == [1, 1] and nxt == 8
    ids, epochs, nxt = order.host_block(0, 0)  # [2, 4): epoch 0
    assert epochs.tolist() == [0, 0] and nxt == 4
    order0 = GlobalOrder(np.arange(5), 4, shuffle=True, seed=1)
    ids, epochs, _ = order0.host_block(0, 1)  # [4, 8): one record of epoch 0, three of epoch 1
    assert epochs.tolist() == [0, 1, 1, 1]
    assert ids.tolist() == [order0.order(0)[4], *order0.order(1)[:3]]


def test_an_old_per_host_position_restarts_the_input_with_a_warning(caplog):
    it = NumpyIterator(np.arange(10), None, 2, True, None, 0, 1, 2)
    it.set_state({"epoch": 3, "position": 4})  # no "order": an older checkpoint's
    assert it.get_state() == {"order": "global", "epoch": 0, "position": 0}
    one = NumpyIterator(np.arange(10), None, 2, True, None, 0, 0, 1)
    one.set_state({"epoch": 3, "position": 4})  # one host: its count is the stream's
    assert one.get_state()["epoch"] == 3 and one.get_state()["position"] == 4


@pytest.mark.slow
def test_two_processes_and_one_train_bitwise_equal_and_resume_across_host_counts(
    tmp_path_factory,
):
    data_dir = _write_data(str(tmp_path_factory.getbasetemp() / "global_order_data"))
    one_dir = str(tmp_path_factory.mktemp("one_x2"))
    two_dir = str(tmp_path_factory.mktemp("two_x1"))
    one = mh.run_job(1, data_dir, one_dir, *FLAGS, devices=2)
    mh.assert_ok(one)
    two = mh.run_job(2, data_dir, two_dir, *FLAGS, devices=2)
    mh.assert_ok(two)
    a, b = mh.params(one_dir), mh.params(two_dir)
    assert a["step"] == b["step"] == 30
    mh.assert_bitwise(a, b)
    reference = mh.eval_results(one[0].stderr)
    assert reference["num_examples"] == NUM_EVAL
    for proc in two:
        results = mh.eval_results(proc.stderr)
        assert results["num_examples"] == NUM_EVAL
        assert results["accuracy"] == reference["accuracy"]
        assert results["loss"] == pytest.approx(reference["loss"], rel=1e-6)

    # Killed on 2 processes (both SIGKILLed reading their 13th batch, once step 10 is saved),
    # resumed on 1: ends where the uninterrupted 1-process run ended, bitwise.
    resumed_dir = str(tmp_path_factory.mktemp("two_then_one"))
    killed = mh.run_job(
        2, data_dir, resumed_dir, *FLAGS, devices=2, faults={0: "kill:13:10", 1: "kill:13:10"}
    )
    assert [p.returncode for p in killed] == [-9, -9], [p.stderr[-2000:] for p in killed]
    resumed_from = mh.params(resumed_dir)["step"]
    assert 10 <= resumed_from < 30
    finished = mh.run_job(1, data_dir, resumed_dir, *FLAGS, devices=2)
    mh.assert_ok(finished)
    assert f"Restored checkpoint at step {resumed_from}" in finished[0].stderr
    assert "input restarts" not in finished[0].stderr
    c = mh.params(resumed_dir)
    assert c["step"] == 30
    mh.assert_bitwise(a, c)


def test_a_checkpoints_global_position_restores_on_another_process_count(caplog):
    from estimax.estimator.batches import _input_state_of_this_process

    state = {"order": "global", "epoch": 2, "position": 24}
    # Saved by 2 processes, restored by this one process: the same stream position.
    assert _input_state_of_this_process({"input_states": [state, dict(state)]}) == state
    # Per-host positions of an older checkpoint, from 2 processes: the input restarts.
    old = [{"epoch": 2, "position": 12}, {"epoch": 2, "position": 12}]
    assert _input_state_of_this_process({"input_states": old}) is None
    assert "The input restarts from its beginning" in caplog.text
