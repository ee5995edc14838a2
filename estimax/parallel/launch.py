"""How a process finds its job: cluster specs, JAX's cluster detection, a bounded rendezvous.

``detect`` says what this process is, before JAX is touched; ``rendezvous`` checks, with a
timeout, that every process of the job sees the same job. Where each fact comes from, in the
order looked at (an explicit ``--coordinator_address=HOST:PORT`` skips the detection):

1. ``flags``: ``--coordinator_address=HOST:PORT`` with ``--num_processes``/``--process_id``.
2. ``vertex``: Vertex AI's ``$CLUSTER_SPEC``. Process 0 (the coordinator) is ``workerpool0[0]``,
   then ``workerpool1[0]``, ``workerpool1[1]``...
3. ``tf_config``: ``$TF_CONFIG`` (Cloud ML Engine, Vertex AI, TensorFlow's own jobs). Process 0
   is ``chief[0]`` (ML Engine's older ``master[0]``; without either, ``worker[0]``), then
   ``worker[0]``, ``worker[1]``...
4. ``jax_env``: ``$JAX_COORDINATOR_ADDRESS``, ``$JAX_NUM_PROCESSES`` and ``$JAX_PROCESS_ID``
   (JAX's own names; Kubeflow Trainer's JAX runtime sets the three in every pod). ``env``:
   ``$JAX_COORDINATOR_ADDRESS`` alone, the numbers from the flags or JAX's detection.
5. Only with ``auto``, JAX's own plugins, named as JAX names them: ``ompi`` (Open MPI 4 or older:
   ``$OMPI_MCA_orte_hnp_uri``, set by ORTE, which Open MPI 5 replaced with PRRTE), ``slurm``
   (``$SLURM_JOB_ID``, ``$SLURM_STEP_NODELIST``, ``$SLURM_NTASKS``, ``$SLURM_PROCID``,
   ``$SLURM_LOCALID``), ``gcetpu``/``gketpu`` (Cloud TPU metadata, GKE's ``$TPU_WORKER_*``),
   ``K8sCluster`` (Kubernetes, with the ``kubernetes`` package).

Both cluster specs are read with no flag at all (and with ``auto``): a job spec written for Cloud
ML Engine or Vertex AI starts one training job, not N unconnected ones writing one model_dir. When
both are set (Vertex sets both) ``$CLUSTER_SPEC`` is used. The coordinator's port is the one the
spec gives the chief (Vertex: 2222). Tasks that are not training processes:

* an ``evaluator`` task (``$TF_CONFIG``) or a ``workerpool3`` replica (``$CLUSTER_SPEC``) is the
  job's sidecar evaluator: it follows the checkpoints in the same ``model_dir`` and never joins
  the training processes (``Launch.evaluator``);
* a ``ps`` task / ``workerpool2`` replica (parameter or reduction servers) is refused in one line:
  estimax has none; the other processes leave those pools out of their count.

Why not JAX ``ClusterEnv`` plugins: in jax 0.10.2 ``ClusterEnv`` lives in the private
``jax._src.clusters``; a subclass registers itself by being defined and is consulted after the
built-in ones (in import order), so on a Kubernetes-based service (Vertex, GKE) JAX's K8s plugin
would claim the job first; and a plugin cannot say "this process must not join" (the evaluator)
nor turn a malformed spec into one line naming the field. JAX's own plugins are still what finds
Open MPI, SLURM, TPU pods and Kubernetes: ``detect`` asks them (the same private list, read only)
and passes what they say to ``jax.distributed.initialize`` explicitly, so what is logged is what
is used.

The rendezvous runs before ``jax.distributed.initialize``, whose coordination service, given a
wrong process count, waits out its timeout (300 s) and then aborts the process with a C++ stack
trace. Process 0 listens on the coordinator's port; every other process connects (retrying until
the timeout), sends its view (kind, coordinator, process count and id, host) and waits for the
verdict; process 0 compares the views and answers every process the same: all agree, or one line
saying who disagrees on what, or who never came. The port is free again before JAX binds it. No
library offers a bounded pre-join check (JAX's own is the abort above), so this one is ours: JSON
lines over a TCP socket, from the standard library.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from estimax import storage

__all__ = [
    "AUTO",
    "MAX_PROCESSES",
    "Launch",
    "LaunchError",
    "detect",
    "evaluator_task",
    "jax_env_launch",
    "parse_cluster_spec",
    "parse_tf_config",
    "rendezvous",
]

AUTO = "auto"
# What the rendezvous's messages start with: anything else on the port is not an estimax process.
_MAGIC = "estimax-launch/1 "
# A view or a verdict is a few hundred bytes; a line longer than this is not ours.
_MAX_LINE = 1 << 20
# How many absent processes the launch check names (then how many in all).
_SHOW_MISSING = 8
_TF_TYPES = ("chief", "master", "worker", "evaluator", "ps")
_VERTEX_POOLS = ("workerpool0", "workerpool1", "workerpool2", "workerpool3")
# ASCII digits only: ``\d`` alone also matches other scripts' digits, which int() reads.
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[^\s:\[\]]+):([0-9]{1,5})$", re.ASCII)
_MAX_PORT = 65535
# A task index as a string ("1"): ASCII digits, as many as an index can have ("²" is a digit to
# str.isdigit() but not to int()).
_INDEX = re.compile(r"[0-9]{1,9}", re.ASCII)
# A number in a launch variable ($JAX_NUM_PROCESSES, $SLURM_NTASKS...): ASCII digits only (int()
# also reads other scripts' digits, and "²" passes str.isdigit() but not int()), and few of them
# (int() raises ValueError past 4,300 digits); 18 digits hold any count, id, job id or port.
_NUMBER = re.compile(r"[0-9]{1,18}", re.ASCII)
# The most processes one job may have. JAX runs one process per host (on GPUs at most one per
# GPU); the largest TPU pod has 2,304 hosts (Ironwood: 9,216 chips), and multislice jobs and the
# largest GPU clusters (~100,000 GPUs) stay below 2**17 processes even at one per GPU. A count above
# 2**20 is therefore a typo or an attack, and is refused before anything is sized by it
# ($JAX_NUM_PROCESSES=10**12 once made the launch check list every missing process until
# MemoryError).
MAX_PROCESSES = 1 << 20
_WHY_MAX = "estimax's limit for one job, far above any real pod or GPU cluster"


class LaunchError(ValueError):
    """The job cannot start as specified: a malformed spec, or processes that disagree or never
    reach each other. The message is one line naming the field, the processes and the values."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """What this process is in its job.

    Attributes:
      kind: where it came from: ``single`` (no job), ``flags``, ``env``, ``tf_config``,
        ``vertex``, or the name of JAX's plugin (``ompi``, ``slurm``, ``gcetpu``...).
      source: the same, for a person (``$TF_CONFIG task worker:0``).
      coordinator: ``host:port`` of process 0's coordination service (None: no job).
      num_processes: training processes of the job (evaluators not counted).
      process_id: this process's index among them (0 for an evaluator).
      evaluator: this process is the job's sidecar evaluator and does not join.
    """

    kind: str
    source: str
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    evaluator: bool = False

    @property
    def joins(self) -> bool:
        """Whether this process joins a multi-process JAX job."""
        return not self.evaluator and self.coordinator is not None and self.num_processes > 1

    def describe(self) -> str:
        """One line for the log and ``estimax doctor --launch``."""
        if self.evaluator:
            return (
                f"{self.source}: the job's evaluator: follows the checkpoints in --model_dir "
                "and does not join the training processes"
            )
        if not self.joins:
            return f"one process ({self.source})"
        return (
            f"{self.kind} ({self.source}): process {self.process_id} of {self.num_processes}, "
            f"coordinator {self.coordinator}"
        )


# ----------------------------------------------------------------------------- cluster specs


def _short(value: Any) -> str:
    """``repr(value)`` cut to what one line can hold (a spec is any size the job sets)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _digits(text: str) -> int | None:
    """``text`` (surrounding whitespace aside, as int() allows) as a whole number when it is
    ASCII digits, at most 18 of them; None for anything else ("-1", "²", 5,000 digits, "")."""
    text = text.strip()
    return int(text) if _NUMBER.fullmatch(text) else None


def _number(var: str, raw: str, lowest: int, highest: int, what: str) -> int:
    """``$var``'s value ``raw`` as a whole number in ``lowest .. highest``, or one LaunchError
    line naming the variable and its value (cut to fit the line)."""
    value = _digits(raw)
    if value is None:
        raise LaunchError(f"${var}={_short(raw)} is not a whole number ({what})")
    if not lowest <= value <= highest:
        raise LaunchError(f"${var}={_short(raw)} is not in {lowest} .. {highest:,} ({what})")
    return value


def slice_number(var: str, raw: str, lowest: int, what: str) -> int:
    """A ``MEGASCALE_*`` value (``$MEGASCALE_NUM_SLICES``, ``$MEGASCALE_SLICE_ID``) as a whole
    number from ``lowest``, or one LaunchError line naming it (``replication.num_slices_from``)."""
    return _number(var, raw, lowest, MAX_PROCESSES - 1 + lowest, what)


# The numbers JAX's cluster plugins read with int() (jax 0.10.2, ``jax/_src/clusters``), checked
# first so that a bad one is one line naming it, not a ValueError from inside JAX: for each plugin
# (by its name), the variable, its range, whether empty means unset (MEGASCALE_* default to one
# slice), and what it is. ``*_LOCAL*`` ones are read by ``jax.distributed.initialize`` itself.
_PLUGIN_NUMBERS: dict[str, tuple[tuple[str, int, int, bool, str], ...]] = {
    "ompi": (
        ("OMPI_COMM_WORLD_SIZE", 1, MAX_PROCESSES, False, "Open MPI's process count"),
        ("OMPI_COMM_WORLD_RANK", 0, MAX_PROCESSES - 1, False, "Open MPI's rank"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", 0, MAX_PROCESSES - 1, False, "Open MPI's local rank"),
    ),
    "slurm": (
        ("SLURM_JOB_ID", 0, 10**18 - 1, False, "SLURM's job id"),
        ("SLURM_NTASKS", 1, MAX_PROCESSES, False, "SLURM's task count"),
        ("SLURM_PROCID", 0, MAX_PROCESSES - 1, False, "SLURM's task rank"),
        ("SLURM_LOCALID", 0, MAX_PROCESSES - 1, False, "SLURM's local task rank"),
    ),
    "gketpu": (
        ("TPU_WORKER_ID", 0, MAX_PROCESSES - 1, False, "GKE's TPU worker index"),
        ("MEGASCALE_NUM_SLICES", 1, MAX_PROCESSES, True, "the TPU slices"),
        ("MEGASCALE_SLICE_ID", 0, MAX_PROCESSES - 1, True, "this TPU slice's index"),
    ),
    "gcetpu": (
        ("MEGASCALE_NUM_SLICES", 1, MAX_PROCESSES, True, "the TPU slices"),
        ("MEGASCALE_SLICE_ID", 0, MAX_PROCESSES - 1, True, "this TPU slice's index"),
    ),
    "K8sCluster": (
        ("JOB_COMPLETION_INDEX", 0, MAX_PROCESSES - 1, False, "the Kubernetes Job's index"),
    ),
}
# The plugins whose job ``jax.distributed.initialize`` finds from variables alone (the first
# present, in JAX's order), with the variables that say it is there and the local rank it then
# reads even when given everything else.
_PLUGIN_LOCAL = (
    ("ompi", ("OMPI_MCA_orte_hnp_uri",), "OMPI_COMM_WORLD_LOCAL_RANK"),
    (
        "slurm",
        ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
        "SLURM_LOCALID",
    ),
)


def _check_plugin_numbers(name: str, environ: Mapping[str, str]) -> None:
    """The numbers JAX's plugin ``name`` will read from ``environ``, each valid or one line."""
    for var, lowest, highest, optional, what in _PLUGIN_NUMBERS.get(name, ()):
        raw = environ.get(var)
        if raw is None or (optional and not raw.strip()):
            continue  # unset: the plugin says so (a KeyError, caught) or takes its default
        _number(var, raw, lowest, highest, what)


def check_jax_numbers(environ: Mapping[str, str] | None = None) -> None:
    """Before ``jax.distributed.initialize``: the numbers it reads from the environment
    (``$JAX_COORDINATOR_PORT``, ``$JAX_LOCAL_DEVICE_IDS``, and the local rank of the Open MPI or
    SLURM job it finds), each a whole number in range, or one LaunchError line naming it."""
    environ = os.environ if environ is None else environ
    port = environ.get("JAX_COORDINATOR_PORT")
    if port:
        _number("JAX_COORDINATOR_PORT", port, 1, _MAX_PORT, "the coordinator's port")
    ids = environ.get("JAX_LOCAL_DEVICE_IDS")
    if ids:
        for part in ids.split(",", 4096)[:4096]:  # more ids than devices: the first bad one
            if _digits(part) is None:
                raise LaunchError(
                    f"$JAX_LOCAL_DEVICE_IDS={_short(ids)} is not a comma-separated list of "
                    "device ids (whole numbers)"
                )
    for name, present, local in _PLUGIN_LOCAL:
        if all(var in environ for var in present):
            rule = next(r for r in _PLUGIN_NUMBERS[name] if r[0] == local)
            _number(local, environ[local], *rule[1:3], rule[4])
            return  # JAX reads the first present one only


def _json_object(text: str, var: str) -> dict[str, Any]:
    try:
        value = storage.load_json(text)
    except storage.JSONNestingError as e:
        raise LaunchError(f"${var} is not a cluster spec: it is {e}") from None
    except ValueError as e:
        raise LaunchError(f"${var} is not JSON ({e}): {text[:80]!r}") from None
    if not isinstance(value, dict):
        raise LaunchError(f"${var} must be a JSON object, got {type(value).__name__}")
    return value


def _addresses(cluster: Any, var: str, known: tuple[str, ...]) -> dict[str, list[str]]:
    """``cluster`` checked: ``{type: ["host:port", ...]}`` with known types only."""
    if not isinstance(cluster, dict):
        raise LaunchError(f"${var}: cluster must be an object of task lists, got {_short(cluster)}")
    for name, hosts in cluster.items():
        if name not in known:
            raise LaunchError(f"${var}: cluster.{name[:40]} is not one of {', '.join(known)}")
        if not isinstance(hosts, list):
            raise LaunchError(f"${var}: cluster.{name} must be a list of HOST:PORT strings")
        for i, host in enumerate(hosts):
            if not isinstance(host, str) or not _HOST_PORT.match(host):
                raise LaunchError(f"${var}: cluster.{name}[{i}] = {_short(host)} is not HOST:PORT")
            port = int(host.rsplit(":", 1)[1])
            if not 1 <= port <= _MAX_PORT:
                raise LaunchError(
                    f"${var}: cluster.{name}[{i}] = {host!r}: port {port} is not in 1..{_MAX_PORT}"
                )
    return cluster


def _task(spec: dict[str, Any], var: str, known: tuple[str, ...]) -> tuple[str, int]:
    task = spec.get("task")
    if not isinstance(task, dict):
        raise LaunchError(f"${var}: task must be an object {{'type': ..., 'index': ...}}")
    kind, index = task.get("type"), task.get("index", 0)
    if kind not in known:
        raise LaunchError(f"${var}: task.type = {_short(kind)} is not one of {', '.join(known)}")
    if isinstance(index, str) and _INDEX.fullmatch(index):
        index = int(index)
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise LaunchError(f"${var}: task.index = {_short(index)} is not an index (0, 1, ...)")
    return kind, index


def _in_range(cluster: dict[str, list[str]], kind: str, index: int, var: str) -> None:
    if index >= len(cluster.get(kind, [])):
        raise LaunchError(
            f"${var}: task.index = {_short(index)} but cluster.{kind} lists "
            f"{len(cluster.get(kind, []))} task(s)"
        )


@dataclasses.dataclass(frozen=True)
class _SpecRules:
    """How one kind of cluster spec names its tasks."""

    var: str  # the variable
    kind: str  # Launch.kind
    types: tuple[str, ...]  # every task type it may name
    primaries: tuple[str, ...]  # the chief's types: process 0
    primary_required: bool  # a job without one is malformed
    workers: str  # the other training tasks, in index order
    evaluator: str  # the sidecar evaluator's type
    servers: str  # parameter (or reduction) servers: not estimax's
    servers_why: str  # the rest of the line refusing them


_TF_CONFIG = _SpecRules(
    "TF_CONFIG",
    "tf_config",
    _TF_TYPES,
    ("chief", "master"),
    False,
    "worker",
    "evaluator",
    "ps",
    "(a parameter server): estimax has none (every training process holds the model); drop the "
    "ps tasks from the job spec",
)
_CLUSTER_SPEC = _SpecRules(
    "CLUSTER_SPEC",
    "vertex",
    _VERTEX_POOLS,
    ("workerpool0",),
    True,
    "workerpool1",
    "workerpool3",
    "workerpool2",
    "(parameter or reduction servers): estimax has none; run Vertex's reduction server image "
    "there, or drop the pool",
)


def _parse(text: str, rules: _SpecRules) -> Launch:
    var = rules.var
    spec = _json_object(text, var)
    cluster = _addresses(spec.get("cluster", {}), var, rules.types)
    kind, index = _task(spec, var, rules.types)
    source = f"${var} task {kind}:{index}"
    if kind == rules.evaluator:
        return Launch(rules.kind, source, evaluator=True)
    if kind == rules.servers:
        raise LaunchError(f"${var}: task.type = {kind!r} {rules.servers_why}")
    _in_range(cluster, kind, index, var)
    primaries = [host for t in rules.primaries for host in cluster.get(t, [])]
    if len(primaries) > 1 or (rules.primary_required and not primaries):
        raise LaunchError(
            f"${var}: cluster.{'/'.join(rules.primaries)} lists {len(primaries)} tasks; a job "
            f"has {'exactly' if rules.primary_required else 'at most'} one"
        )
    order = primaries + cluster.get(rules.workers, [])
    process_id = 0 if kind in rules.primaries else len(primaries) + index
    if len(order) == 1:
        return Launch(rules.kind, source + " (the only training task)")
    return Launch(rules.kind, source, order[0], len(order), process_id)


def parse_tf_config(text: str) -> Launch:
    """This process in a ``$TF_CONFIG`` (``{"cluster": {...}, "task": {"type", "index"}}``).

    Process 0 is ``chief[0]`` (ML Engine's older ``master[0]``), or ``worker[0]`` without one;
    ``worker[i]`` follows. ``evaluator`` tasks do not join; ``ps`` tasks are refused.

    Raises:
      LaunchError: malformed, or a task estimax cannot run (one line naming the field).
    """
    return _parse(text, _TF_CONFIG)


def parse_cluster_spec(text: str) -> Launch:
    """This replica in Vertex AI's ``$CLUSTER_SPEC`` (worker pools ``workerpool0..3``).

    Process 0 is ``workerpool0[0]`` (the primary replica), ``workerpool1[i]`` follows;
    ``workerpool3`` (evaluators) does not join; ``workerpool2`` (parameter or reduction servers)
    is not counted, and a replica of it running estimax is refused.

    Raises:
      LaunchError: malformed, or a pool estimax cannot run (one line naming the field).
    """
    return _parse(text, _CLUSTER_SPEC)


def _spec_launch(environ: Mapping[str, str]) -> Launch | None:
    if environ.get("CLUSTER_SPEC"):
        return parse_cluster_spec(environ["CLUSTER_SPEC"])
    if environ.get("TF_CONFIG"):
        return parse_tf_config(environ["TF_CONFIG"])
    return None


def evaluator_task(environ: Mapping[str, str] | None = None) -> str | None:
    """``$TF_CONFIG task evaluator:0`` (or a ``workerpool3`` replica's) when this process is the
    job's sidecar evaluator, else None. A malformed spec is left to ``detect`` to report."""
    try:
        found = _spec_launch(os.environ if environ is None else environ)
    except LaunchError:
        return None
    return found.source if found is not None and found.evaluator else None


def has_evaluator(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the cluster spec names an evaluator task (then training processes only train)."""
    environ = os.environ if environ is None else environ
    for var, key in (("CLUSTER_SPEC", "workerpool3"), ("TF_CONFIG", "evaluator")):
        if environ.get(var):
            with_spec = _spec_or_none(environ[var])
            return bool(with_spec and with_spec.get("cluster", {}).get(key))
    return False


def _spec_or_none(text: str) -> dict[str, Any] | None:
    try:
        spec = storage.load_json(text)
    except ValueError:
        return None
    return spec if isinstance(spec, dict) and isinstance(spec.get("cluster"), dict) else None


# ----------------------------------------------------------------------------- detection


def _jax_cluster(timeout: float) -> Launch | None:
    """What JAX's own cluster detection finds (Open MPI, SLURM, TPU pods, Kubernetes)."""
    try:
        from jax._src import clusters  # private: see the module docstring
    except ImportError:  # pragma: no cover - a JAX without it: nothing more to detect
        return None
    for env in clusters.ClusterEnv._cluster_types:  # noqa: SLF001 - read only
        if env.opt_in_only_method or not env.is_env_present():
            continue
        name = env.name or env.__name__
        check_jax_numbers(os.environ)  # what the plugin reads is os.environ
        _check_plugin_numbers(name, os.environ)
        try:
            coordinator = env.get_coordinator_address(
                timeout_secs=int(timeout),
                override_coordinator_port=os.environ.get("JAX_COORDINATOR_PORT"),
            )
            count, index = int(env.get_process_count()), int(env.get_process_id())
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            # One line whatever the plugin says (a Kubernetes API error can span lines).
            detail = " ".join(str(e).split())
            raise LaunchError(f"JAX's {name} cluster detection failed: {detail[:300]}") from None
        return Launch(name, f"JAX's {name} detection", coordinator, count, index)
    return None


def detect(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    environ: Mapping[str, str] | None = None,
    timeout: float = 300.0,
) -> Launch:
    """What this process is in its job, from its flags and environment (see the module table).

    Args:
      coordinator_address: ``host:port``, ``"auto"``, or None (cluster specs and
        ``$JAX_COORDINATOR_ADDRESS`` only: one process when none is set).
      num_processes, process_id: given by hand; they win over what is detected.
      environ: the environment (``os.environ``).
      timeout: seconds JAX's TPU detection may wait for its metadata.

    Raises:
      LaunchError: a malformed spec, numbers without an address, nothing found for ``auto``.
    """
    environ = os.environ if environ is None else environ
    explicit = coordinator_address not in (None, AUTO)
    spec = _spec_launch(environ)
    if spec is not None and spec.evaluator:
        if explicit:
            raise LaunchError(
                f"{spec.source} makes this process the job's evaluator, but "
                f"--coordinator_address={coordinator_address} asks it to join the training "
                "processes: leave the cluster flags out"
            )
        return spec
    if explicit:
        found = Launch("flags", "--coordinator_address", coordinator_address)
    elif spec is not None:
        found = spec
    elif any(environ.get(var) for var in _JAX_ENV):
        found = jax_env_launch(environ)
    elif coordinator_address == AUTO:
        found = _jax_cluster(timeout) or _nothing_found()
    elif (num_processes is not None and num_processes > 1) or process_id is not None:
        raise LaunchError(
            f"num_processes={num_processes}, process_id={process_id} given without a "
            "coordinator address: give --coordinator_address=HOST:PORT (process 0's host, the "
            "same on every process), or 'auto' on a TPU VM / SLURM / MPI / Kubernetes job."
        )
    else:
        return Launch("single", "no cluster flags, spec or $JAX_COORDINATOR_ADDRESS")
    found = _with_numbers(found, num_processes, process_id, timeout)
    if found.joins:
        check_jax_numbers(environ)  # read by jax.distributed.initialize: said now, in one line
    return found


def _with_numbers(
    found: Launch, num_processes: int | None, process_id: int | None, timeout: float
) -> Launch:
    """``found`` with the numbers given by hand (they win); for an address given without them,
    JAX's detection's, as ``jax.distributed.initialize`` does."""
    if found.kind in ("flags", "env"):
        _port(found)  # said now, in one line, not by the socket (OverflowError) at the join
    if found.kind in ("flags", "env") and (num_processes is None or process_id is None):
        jax_found = _jax_cluster(timeout)
        if jax_found is None and num_processes != 1:
            raise LaunchError(
                f"{found.source}={found.coordinator} without --num_processes and --process_id, "
                "and JAX detected no cluster to take them from: give both (the same "
                "--num_processes on every process, --process_id 0 .. N-1)"
            )
        if jax_found is not None:
            found = dataclasses.replace(
                found, num_processes=jax_found.num_processes, process_id=jax_found.process_id
            )
    count = found.num_processes if num_processes is None else num_processes
    index = found.process_id if process_id is None else process_id
    if not 1 <= count <= MAX_PROCESSES:
        where = f"{found.source} gives " if num_processes is None else "--num_processes="
        raise LaunchError(
            f"{where}{_short(count)} processes: not in 1 .. {MAX_PROCESSES:,} ({_WHY_MAX})"
        )
    if not 0 <= index < count:
        raise LaunchError(
            f"--process_id={_short(index)} is not in 0 .. {count - 1} (--num_processes)"
        )
    return dataclasses.replace(found, num_processes=count, process_id=index)


_JAX_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def jax_env_launch(environ: Mapping[str, str]) -> Launch:
    """This process from JAX's own variables: ``$JAX_COORDINATOR_ADDRESS``, and with it
    ``$JAX_NUM_PROCESSES`` and ``$JAX_PROCESS_ID`` -- the three Kubeflow Trainer's JAX runtime
    sets in every pod of a TrainJob (kind ``jax_env``). The address alone is kind ``env``: its
    numbers come from the flags or JAX's detection. A missing or malformed one is one line naming
    the variable."""
    # Set means non-empty (a shell's VAR= unsets it for us); a value of only spaces is set, and
    # refused below as what it is, not taken for unset.
    address, count, index = (environ.get(var, "") for var in _JAX_ENV)
    where = "Kubeflow Trainer's JAX runtime sets all three"
    if not address:
        given = ", ".join(f"${v}" for v in _JAX_ENV[1:] if environ.get(v))
        raise LaunchError(
            f"{given} set without $JAX_COORDINATOR_ADDRESS (HOST:PORT of process 0): set it too "
            f"({where}), or unset {given}"
        )
    match = _HOST_PORT.match(address.strip())
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise LaunchError(
            f"$JAX_COORDINATOR_ADDRESS={_short(address)} is not HOST:PORT (process 0's host and "
            "a free port, the same in every process)"
        )
    address = address.strip()
    if not count and not index:
        return Launch("env", "$JAX_COORDINATOR_ADDRESS", address)
    if not count or not index:
        have, lack = ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID")[:: 1 if count else -1]
        raise LaunchError(f"${have} is set but ${lack} is not: set both ({where}), or neither")
    # ASCII digits only, and few: "²" (a digit to str.isdigit()) or 5,000 digits made int()
    # raise; 10**12 made the launch check size a list by it.
    processes, process = _digits(count), _digits(index)
    if processes is None or processes < 1:
        raise LaunchError(
            f"$JAX_NUM_PROCESSES={_short(count)} is not a whole number of 1 or more (the job's "
            "processes, the same in every process)"
        )
    if processes > MAX_PROCESSES:
        raise LaunchError(
            f"$JAX_NUM_PROCESSES={_short(count)} is more than {MAX_PROCESSES:,} processes "
            f"({_WHY_MAX}): give the job's real process count, the same in every process"
        )
    if process is None or process >= processes:
        raise LaunchError(
            f"$JAX_PROCESS_ID={_short(index)} is not in 0 .. {processes - 1} "
            f"($JAX_NUM_PROCESSES={processes}; a different one in every process)"
        )
    source = "$JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID"
    return Launch("jax_env", source, address, processes, process)


def _nothing_found() -> Launch:
    raise LaunchError(
        "--coordinator_address=auto found no cluster: no $CLUSTER_SPEC or $TF_CONFIG, and JAX "
        "detected no Open MPI 4 (mpirun), SLURM (srun), Cloud TPU pod or Kubernetes job; give "
        "--coordinator_address=HOST:PORT --num_processes=N --process_id=I"
    )


# ----------------------------------------------------------------------------- rendezvous


def _view(launch: Launch) -> dict[str, Any]:
    return {
        "kind": launch.kind,
        "coordinator": launch.coordinator,
        "num_processes": launch.num_processes,
        "process_id": launch.process_id,
        "host": socket.gethostname(),
    }


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall((_MAGIC + json.dumps(message, sort_keys=True) + "\n").encode())


def _receive(sock: socket.socket, deadline: float) -> dict[str, Any] | None:
    """The next message on ``sock`` before ``deadline``; None on EOF or something not ours."""
    chunks: list[bytes] = []
    size = 0
    while not chunks or not chunks[-1].endswith(b"\n"):
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        size += len(chunk)
        if not chunk or size > _MAX_LINE:
            return None
        chunks.append(chunk)
    line = b"".join(chunks).decode(errors="replace")
    if not line.startswith(_MAGIC):
        return None
    try:
        message = storage.load_json(line[len(_MAGIC) :])
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def _port(launch: Launch) -> int:
    """The coordinator's port; LaunchError naming where the address came from (its flag or
    variable) if it is not HOST:PORT with a port a socket can bind (``socket`` raises
    OverflowError for 99999)."""
    coordinator = launch.coordinator or ""
    match = _HOST_PORT.match(coordinator)
    port = int(match.group(2)) if match else 0
    if not 1 <= port <= _MAX_PORT:
        raise LaunchError(
            f"{launch.source}: coordinator address {_short(coordinator)} is not HOST:PORT with "
            f"a port in 1..{_MAX_PORT}"
        )
    return port


def rendezvous(launch: Launch, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Checks that every process of the job sees the same job; every process gets one verdict.

    A collective over plain TCP on the coordinator's port, before JAX joins: each process calls
    it once. Returns within ``timeout`` seconds (plus the time to send a verdict).

    Returns:
      every process's view (kind, coordinator, num_processes, process_id, host), in process order.

    Raises:
      LaunchError: a process disagrees (on the kind, coordinator, process count, or two claim
        one id), or not all processes reached the coordinator in time; the same one line on
        every process that reached it.
    """
    if not launch.joins:
        return [_view(launch)]
    assert launch.coordinator is not None  # joins
    deadline = time.monotonic() + timeout
    if launch.process_id == 0:
        # Process 0 answers a little before its own deadline, so that the others, started at
        # about the same time, still wait for the verdict (and all print the same line).
        return _serve(launch, deadline - min(10.0, timeout / 5), timeout)
    return _ask(launch, deadline, timeout)


def _listen(port: int) -> socket.socket:
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(
                ("", port), family=socket.AF_INET6, dualstack_ipv6=True, reuse_port=False
            )
        return socket.create_server(("", port))
    except OSError as e:
        raise LaunchError(
            f"process 0 cannot listen on the coordinator's port {port}: {e.strerror or e} (is "
            "another job, or an earlier run of this one, still using it?)"
        ) from None


def _serve(launch: Launch, deadline: float, timeout: float) -> list[dict[str, Any]]:
    """Process 0: gathers the others' views until all came or the deadline, answers each."""
    server = _listen(_port(launch))
    conns: list[socket.socket] = []
    views: list[dict[str, Any]] = [_view(launch)]
    problems: list[str] = []
    try:
        while not problems and len(views) < launch.num_processes:
            conn = _accept(server, deadline)
            if conn is None:
                problems.append(_missing(launch, views, timeout))
                break
            view = _peer_view(conn, deadline)
            if view is None:
                conn.close()  # not an estimax process: a port scanner, a health check
                continue
            conns.append(conn)
            if view["process_id"] in {v["process_id"] for v in views}:
                problems.append(
                    f"launch check: two processes say they are process {view['process_id']} "
                    f"(one on {view.get('host')}); give each process its own --process_id"
                )
            views.append(view)
            problems += _disagreements(views)
        views.sort(key=lambda v: v["process_id"])
        verdict = {"ok": not problems, "message": problems[0] if problems else "", "views": views}
        for conn in conns:
            _answer(conn, verdict, deadline)
    finally:
        server.close()
    if problems:
        raise LaunchError(problems[0])
    return views


def _accept(server: socket.socket, deadline: float) -> socket.socket | None:
    """The next connection before ``deadline`` (None when it passes)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return None
    server.settimeout(remaining)
    try:
        conn, _ = server.accept()
    except TimeoutError:
        return None
    return conn


def _peer_view(conn: socket.socket, deadline: float) -> dict[str, Any] | None:
    try:
        view = _receive(conn, min(deadline, time.monotonic() + 5.0))
    except OSError:
        return None
    if view is None or not isinstance(view.get("process_id"), int):
        return None
    return view


def _answer(conn: socket.socket, verdict: dict[str, Any], deadline: float) -> None:
    """Sends the verdict, then waits (briefly) for the peer to close first, so that the port's
    closed connections wait out TCP's TIME_WAIT on the peers' side, not on the port JAX binds."""
    try:
        _send(conn, verdict)
        conn.settimeout(max(0.5, min(5.0, deadline - time.monotonic())))
        conn.recv(1)
    except OSError:
        pass
    finally:
        conn.close()


def _disagreements(views: list[dict[str, Any]]) -> list[str]:
    for field in ("num_processes", "coordinator", "kind"):
        values = {v["process_id"]: v.get(field) for v in views}
        if len(set(map(json.dumps, values.values()))) > 1:
            shown = ", ".join(f"process {p}: {values[p]}" for p in sorted(values))
            return [
                f"launch check: the processes disagree on {field} ({shown}); start every "
                "process of the job with the same cluster flags or spec"
            ]
    return []


def _missing(launch: Launch, views: list[dict[str, Any]], timeout: float) -> str:
    """The line for processes that never came: the first few absent ids and how many in all,
    never a list sized by the claimed process count."""
    came = {v["process_id"] for v in views}
    absent = (p for p in range(launch.num_processes) if p not in came)
    first = [str(p) for p in itertools.islice(absent, _SHOW_MISSING)]
    count = launch.num_processes - sum(1 for p in came if 0 <= p < launch.num_processes)
    shown = ", ".join(first) + (f", ... ({count:,} in all)" if count > len(first) else "")
    return (
        f"launch check: only {len(views)} of {launch.num_processes} processes reached the "
        f"coordinator {launch.coordinator} within {timeout:g} s (missing: process {shown}); "
        f"start them, or give every process the same, correct --num_processes"
    )


def _ask(launch: Launch, deadline: float, timeout: float) -> list[dict[str, Any]]:
    """A process other than 0: connects to the coordinator (retrying), sends its view, waits."""
    coordinator = launch.coordinator or ""
    host, port = coordinator.rsplit(":", 1)[0].strip("[]"), _port(launch)
    last_error = "no answer"
    retry = threading.Event()  # waits between attempts without sleeping the whole timeout
    while time.monotonic() < deadline:
        try:
            sock = socket.create_connection(
                (host, port), timeout=max(0.001, min(2.0, deadline - time.monotonic()))
            )
        except OSError as e:
            last_error = e.strerror or str(e) or type(e).__name__
            retry.wait(min(0.25, max(0.0, deadline - time.monotonic())))
            continue
        with sock:
            try:
                _send(sock, _view(launch))
                verdict = _receive(sock, deadline)
            except TimeoutError:
                break
            except OSError as e:
                last_error = e.strerror or str(e)
                retry.wait(min(0.25, max(0.0, deadline - time.monotonic())))
                continue
        if verdict is None:
            raise LaunchError(
                f"launch check: the coordinator {coordinator} answered, but not as an estimax "
                "process 0 (is the job already running without this process, or is another "
                "service on that port?)"
            )
        if not verdict.get("ok"):
            raise LaunchError(str(verdict.get("message")))
        return list(verdict.get("views") or [_view(launch)])
    raise LaunchError(
        f"launch check: process {launch.process_id} got no answer from the coordinator "
        f"{coordinator} (process 0) within {timeout:g} s ({last_error}): is process 0 running, "
        "at that address, and expecting this many processes?"
    )
