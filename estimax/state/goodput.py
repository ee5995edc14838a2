"""The goodput record: where a job's wall time went, across restarts, in ``model_dir/goodput``.

Every process appends one JSON line per training loop (and one after each evaluation, and at
the end of a run) to its own file, ``model_dir/goodput/<start time>-p<process>.jsonl``, flushed
at once and never rewritten: a SIGKILL loses at most the interval since the last line. Each line
holds the seconds of the interval since the previous line, split into buckets that sum to it;
memory is one interval's buckets whatever the number of steps. ``summarize(model_dir)`` reads
every process's files (``estimax goodput MODEL_DIR`` prints it).

The buckets (seconds of wall time; they sum to ``wall``):

- ``productive``: training steps kept in the model: the training loop's time (dispatching steps,
  the host sync once per loop, logging) less the buckets below that happen inside it.
- ``lost``: training steps recomputed after a failure. A run that starts from checkpoint step C
  after a previous run of the job had reached step L > C trains C..L again: the previous run's
  productive time for those steps is moved here (``lost_steps = L - C``, summed over restarts).
  A process that ends on a failure it sees (a lost peer: ``parallel.distributed.PeerWatch``)
  first writes the interval in progress here too (a ``failed`` line): its steps were in flight.
- ``compile``: JAX tracing, lowering and XLA compiles (or reads from the persistent compilation
  cache), from ``jax.monitoring``'s ``/jax/core/compile/*`` durations.
- ``input``: the training loop waiting for its ``input_fn`` (``DevicePrefetcher.input_wait_secs``).
- ``save``: checkpoint saves, the part the loop blocks for (an async write's background time
  overlaps the steps and is not counted).
- ``restore``: reading checkpoints (the train state, an evaluation's variables, the metadata).
- ``eval``: evaluations of ``train_and_evaluate`` (their compiles and restores in those buckets).
- ``startup``: from the process's start (``/proc``) to its first record: imports, the
  ``jax.distributed`` connection, building the Estimator (only the first record of a process).
- ``other``: the rest: initialising the model, reading the first batches, between runs.

``wall`` is the time the processes ran and recorded (mean over processes); the time between a
crash and the restart is not in it. A record is written only where ``model_dir`` is a local
directory (object stores do not append); TensorBoard gets the same buckets
(``goodput/<bucket>_secs``, ``goodput/ratio``) wherever the summaries go.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from estimax import storage

SUBDIR = "goodput"
# Measured buckets, in the table's order; "lost" is moved out of "productive" when reading.
BUCKETS = ("productive", "compile", "input", "save", "restore", "eval", "startup", "other")
_COMPILE_EVENT_PREFIX = "/jax/core/compile/"  # trace, lowering, backend compile (cache incl.)


def _process_start_time() -> float | None:
    """The process's start as a Unix time, from ``/proc`` (None where there is none)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start, in ticks
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class Recorder:
    """One process's record for one ``model_dir``: the current interval's buckets and the file.

    Time is charged to the innermost open ``phase`` (``other`` when none is open); compile
    durations reported by JAX are moved from it to ``compile``.
    """

    def __init__(self, model_dir: str, process: int, processes: int, startup: float):
        self.model_dir = model_dir
        self._lock = threading.Lock()
        self._stack: list[str] = []
        self._mark = time.monotonic()
        self._interval = dict.fromkeys(BUCKETS, 0.0)
        self._interval["startup"] = startup
        self.totals = dict.fromkeys(BUCKETS, 0.0)  # this process's, since its first record
        self.path: str | None = None
        if not storage.is_remote(model_dir):
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            name = f"{stamp}.{int(time.time() * 1e6) % 1_000_000:06d}-p{process}.jsonl"
            self.path = os.path.join(model_dir, SUBDIR, name)
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._write({"event": "start", "process": process, "processes": processes})

    def _charge(self) -> None:
        """Adds the time since the last charge to the open phase (called under the lock)."""
        now = time.monotonic()
        self._interval[self._stack[-1] if self._stack else "other"] += now - self._mark
        self._mark = now

    @contextlib.contextmanager
    def phase(self, bucket: str) -> Iterator[None]:
        """Charges the time inside to ``bucket`` (an inner phase's time goes to the inner one)."""
        with self._lock:
            self._charge()
            self._stack.append(bucket)
        try:
            yield
        finally:
            with self._lock:
                self._charge()
                self._stack.pop()

    @property
    def active(self) -> bool:
        """Whether a phase is open (compiles now are this record's)."""
        return bool(self._stack)

    def move(self, secs: float, to: str) -> None:
        """Moves ``secs`` measured inside the open phase (a compile, an input wait) to ``to``."""
        with self._lock:
            self._charge()
            source = self._stack[-1] if self._stack else "other"
            secs = min(max(secs, 0.0), self._interval[source])
            self._interval[source] -= secs
            self._interval[to] += secs

    def train_start(self, step: int) -> None:
        """A training run starts at checkpoint step ``step`` (the reader counts lost steps)."""
        self.flush({"event": "train", "step": int(step)})

    def interval(self, begin: int, end: int) -> None:
        """Writes the interval that trained steps ``begin + 1 .. end``."""
        self.flush({"begin": int(begin), "end": int(end)})

    def flush(self, fields: dict[str, Any] | None = None) -> None:
        """Writes the interval so far (with ``fields``) and starts the next."""
        with self._lock:
            self._charge()
            secs, self._interval = self._interval, dict.fromkeys(BUCKETS, 0.0)
        for bucket, value in secs.items():
            self.totals[bucket] += value
        self._write({**(fields or {}), "secs": {k: round(v, 6) for k, v in secs.items() if v}})

    def abandon(self, reason: str) -> None:
        """Writes the interval in progress as ``lost`` (a failure ends it: its steps are not
        in any checkpoint) with ``reason``, before the process exits."""
        with self._lock:
            self._charge()
            secs, self._interval = self._interval, dict.fromkeys(BUCKETS, 0.0)
        total = sum(secs.values())
        self._write({"event": "failed", "reason": reason, "secs": {"lost": round(total, 6)}})

    def _write(self, line: dict[str, Any]) -> None:
        if self.path is None:
            return
        # Appended and flushed: a killed process loses at most this interval, never a line
        # written before (a torn last line is skipped by the reader).
        with open(self.path, "a") as f:
            f.write(json.dumps({"t": round(time.time(), 6), **line}) + "\n")

    def scalars(self) -> dict[str, float]:
        """This process's buckets so far as TensorBoard scalars (``goodput/...``)."""
        wall = sum(self.totals.values())
        values = {f"goodput/{k}_secs": v for k, v in self.totals.items()}
        values["goodput/ratio"] = self.totals["productive"] / wall if wall > 0 else 0.0
        return values


_recorders: dict[str, Recorder] = {}
_listening = False
_process_start_used = False  # the process's start-up is charged to its first record only


def _on_duration(event: str, duration_secs: float, **_: str | int) -> None:
    if not event.startswith(_COMPILE_EVENT_PREFIX) or not _recorders:
        return
    recorders = list(_recorders.values())
    # The records with an open phase are the ones compiling; with none open (the model's
    # initialisation before the loop) the newest record's time ("other") is.
    for rec in [r for r in recorders if r.active] or recorders[-1:]:
        rec.move(duration_secs, "compile")


def recorder(model_dir: str) -> Recorder:
    """This process's record for ``model_dir`` (created, and its file started, on first use)."""
    global _listening, _process_start_used
    key = _key(model_dir)
    rec = _recorders.get(key)
    if rec is None:
        import jax

        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening = True
        start = None if _process_start_used else _process_start_time()
        _process_start_used = True
        startup = max(0.0, time.time() - start) if start is not None else 0.0
        rec = _recorders[key] = Recorder(key, jax.process_index(), jax.process_count(), startup)
    return rec


def abandon_all(reason: str) -> None:
    """Every open record's interval in progress is lost (``Recorder.abandon``): the process
    ends on a failure (a lost peer) before its loop's line."""
    for rec in list(_recorders.values()):
        rec.abandon(reason)


def forget(model_dir: str) -> None:
    """Ends this process's record for ``model_dir``: the next use starts a new file, as a
    restarted process does."""
    rec = _recorders.pop(_key(model_dir), None)
    if rec is not None:
        rec.flush()


def phase(model_dir: str, bucket: str) -> contextlib.AbstractContextManager[None]:
    """Charges the time inside to ``bucket`` of ``model_dir``'s record if this process keeps
    one (a training job opened it); else nothing is recorded (a read-only export, a tool)."""
    rec = _recorders.get(_key(model_dir))
    return contextlib.nullcontext() if rec is None else rec.phase(bucket)


def _key(model_dir: str) -> str:
    path = os.fspath(model_dir)
    return path if storage.is_remote(path) else os.path.abspath(path)


# ------------------------------------------------------------------ reading


@dataclasses.dataclass(frozen=True)
class Goodput:
    """A job's record, summed over its restarts; seconds are means over the processes.

    Attributes:
      buckets: seconds per bucket (``BUCKETS`` and ``lost``; see the module docstring).
      wall: their sum.
      ratio: ``productive / wall``.
      lost_steps, lost_secs: steps recomputed after failures, and their time.
      runs: training runs recorded (one per start of a training loop).
      processes: processes that wrote records.
      steps: training steps kept (productive).
      step_secs: mean seconds per productive step.
      step_sd: standard deviation of the per-loop mean step time over every process's loops.
      slowest: (process, first step, last step, seconds per step) of the slowest loop, or None.
      per_process: ``{process: mean seconds per step}``.
    """

    buckets: dict[str, float]
    wall: float
    ratio: float
    lost_steps: int
    lost_secs: float
    runs: int
    processes: int
    steps: int
    step_secs: float
    step_sd: float
    slowest: tuple[int, int, int, float] | None
    per_process: dict[int, float]


def _read_lines(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        raw = f.read().split("\n")
    lines = []
    for number, text in enumerate(raw, 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
            if not isinstance(line, dict) or not isinstance(line.get("secs", {}), dict):
                raise ValueError("not a record line")
        except ValueError:
            if number >= len(raw) - 1:  # a torn last line: the process was killed writing it
                break
            raise ValueError(
                f"the goodput record {path} is damaged at line {number}: not a JSON record "
                "line; remove that file to summarize the others."
            ) from None
        lines.append(line)
    return lines


def _process_of(path: str) -> int:
    stem = os.path.basename(path).rsplit("-p", 1)[-1].split(".")[0]
    return int(stem) if stem.isdigit() else -1


def summarize(model_dir: str) -> Goodput:
    """Reads every process's record in ``model_dir``; the job's buckets, lost steps, step times.

    Raises:
      ValueError: there is no record, or a file is damaged (other than a torn last line).
    """
    folder = os.path.join(os.fspath(model_dir), SUBDIR)
    if not os.path.isdir(folder):
        raise ValueError(
            f"no goodput record in {model_dir}: {folder} does not exist (a training run writes "
            "it; object stores such as gs:// get TensorBoard scalars only)."
        )
    files: dict[int, list[str]] = {}
    for name in sorted(os.listdir(folder)):  # names start with the time: sorted = in order
        if name.endswith(".jsonl"):
            files.setdefault(_process_of(name), []).append(os.path.join(folder, name))
    if not files:
        raise ValueError(f"no goodput record in {model_dir}: {folder} has no .jsonl file.")
    totals = dict.fromkeys((*BUCKETS, "lost"), 0.0)
    lost_steps, runs, steps = 0, 0, 0
    loops: list[tuple[int, int, int, float]] = []  # (process, begin, end, secs per step)
    per_process: dict[int, float] = {}
    for process, paths in files.items():
        buckets, kept, p_lost, p_runs = _one_process(paths)
        for k, v in buckets.items():
            totals[k] += v
        lost_steps, runs = max(lost_steps, p_lost), max(runs, p_runs)
        p_steps = sum(e - b for b, e, _ in kept)
        steps = max(steps, p_steps)
        if p_steps:
            per_process[process] = sum(s for _, _, s in kept) / p_steps
        loops.extend((process, b, e, s / (e - b)) for b, e, s in kept if e > b)
    count = len(files)
    buckets = {k: v / count for k, v in totals.items()}
    wall = sum(buckets.values())
    times = [t for *_, t in loops]
    mean = sum(times) / len(times) if times else 0.0
    sd = math.sqrt(sum((t - mean) ** 2 for t in times) / len(times)) if times else 0.0
    slow = max(loops, key=lambda x: x[3]) if loops else None
    return Goodput(
        buckets=buckets,
        wall=wall,
        ratio=buckets["productive"] / wall if wall > 0 else 0.0,
        lost_steps=lost_steps,
        lost_secs=buckets["lost"],
        runs=runs,
        processes=count,
        steps=steps,
        step_secs=buckets["productive"] / steps if steps else 0.0,
        step_sd=sd,
        slowest=None if slow is None else (slow[0], slow[1] + 1, slow[2], slow[3]),
        per_process=dict(sorted(per_process.items())),
    )


def _one_process(paths: list[str]) -> tuple[dict[str, float], list[list], int, int]:
    """One process's files in order: (buckets with ``lost``, kept loops [begin, end, secs],
    lost steps, training runs)."""
    buckets = dict.fromkeys((*BUCKETS, "lost"), 0.0)
    kept: list[list] = []  # productive loops still in the model: [begin, end, secs]
    lost_steps = runs = 0
    for path in paths:
        for line in _read_lines(path):
            for k, v in line.get("secs", {}).items():
                if k in buckets:
                    buckets[k] += float(v)
            if line.get("event") == "train":
                runs += 1
                restart = int(line["step"])
                # Loops past the checkpoint this run starts from are trained again: lost.
                for loop in kept:
                    begin, end, secs = loop
                    if end <= restart:
                        continue
                    part = (end - max(begin, restart)) / (end - begin)
                    lost_steps += end - max(begin, restart)
                    buckets["lost"] += secs * part
                    buckets["productive"] -= secs * part
                    loop[1], loop[2] = restart, secs * (1 - part)
                kept = [loop for loop in kept if loop[1] > loop[0]]
            elif "begin" in line:
                kept.append(
                    [
                        int(line["begin"]),
                        int(line["end"]),
                        float(line["secs"].get("productive", 0.0)),
                    ]
                )
    return buckets, kept, lost_steps, runs


_LABELS = {
    "productive": "productive steps",
    "lost": "lost (steps recomputed)",
    "compile": "compilation",
    "input": "input waits",
    "save": "checkpoint saves",
    "restore": "checkpoint restores",
    "eval": "evaluation",
    "startup": "start-up",
    "other": "other",
}


def table(summary: Goodput, model_dir: str) -> str:
    """The summary as ``estimax goodput`` prints it."""
    lines = [
        f"Goodput of {model_dir}: {summary.runs} training run(s), {summary.processes} "
        f"process(es), {summary.steps} steps kept",
        f"{'bucket':<26}{'seconds':>12}{'share':>9}",
    ]
    wall = summary.wall or 1.0
    for key in (
        "productive",
        "lost",
        "compile",
        "input",
        "save",
        "restore",
        "eval",
        "startup",
        "other",
    ):
        secs = summary.buckets[key]
        lines.append(f"{_LABELS[key]:<26}{secs:>12.3f}{100 * secs / wall:>8.1f}%")
    lines.append(f"{'wall':<26}{summary.wall:>12.3f}{100.0:>8.1f}%")
    lines.append(f"goodput ratio (productive / wall): {summary.ratio:.3f}")
    lines.append(f"lost: {summary.lost_steps} steps, {summary.lost_secs:.3f} s")
    if summary.steps:
        line = (
            f"step time: mean {1e3 * summary.step_secs:.3f} ms, sd {1e3 * summary.step_sd:.3f} "
            "ms over loops"
        )
        if summary.slowest is not None:
            p, first, last, secs = summary.slowest
            line += f"; slowest: process {p}, steps {first}..{last}, {1e3 * secs:.3f} ms"
        lines.append(line)
        if len(summary.per_process) > 1:
            means = summary.per_process
            fastest = min(means.values()) or 1e-12
            lines.append(
                "per process (ms/step): "
                + ", ".join(f"p{p} {1e3 * s:.3f}" for p, s in means.items())
                + f"; slowest/fastest {max(means.values()) / fastest:.2f}"
            )
    return "\n".join(lines)
