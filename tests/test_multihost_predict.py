"""Predict with two processes on localhost (JAX's CPU runtime, one device each): process 0
yields every example once, in input order, and the other process nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import multihost_helpers as mh

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_predict_worker.py")


def test_two_processes_predict_every_example_once_in_order_on_process_0(tmp_path):
    port = mh._free_port()
    env = mh._job_env(str(tmp_path / "data"), 1)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                WORKER,
                str(port),
                "2",
                str(i),
                str(tmp_path / "model"),
                str(tmp_path / f"out{i}.json"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    mh.assert_ok(mh.finish(procs, timeout=300))
    chief, other = (json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2))
    # 11 examples in global batches of 4 (2 per host): the last holds 3, host 1's block 1 row.
    # 9: the last global batch holds 1 row, host 0's; host 1 runs that batch as padding only.
    for n, batches in (
        ("11", [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]),
        ("9", [[0, 1, 2, 3], [4, 5, 6, 7], [8]]),
    ):
        assert chief[n]["examples"] == [{"i": i, "y": 2.0 * i} for i in range(int(n))]
        assert chief[n]["batches"] == batches
        assert other[n] == {"examples": [], "batches": []}
