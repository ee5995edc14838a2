"""TensorBoard event files, the durable record of evaluations, and the original's log lines."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from absl import logging
from google.protobuf.message import DecodeError

from estimax import storage

EVALUATIONS_FILE = "evaluations.json"
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class Summaries:
    """Writes scalars to TensorBoard event files under one directory, lazily opened.

    Events are written synchronously, in the caller's thread, with tensorboardX's own event and
    record writers (``EventsWriter``), not its ``SummaryWriter``: that one writes from a thread
    whose death on a write error (disk full) goes unnoticed, after which ``add_scalar`` blocks
    forever on its full queue, and whose ``flush`` does not wait for the queue (a process killed
    right after it left an event file with only its 40-byte header). Here a failed write raises
    at once, naming the directory, and ``flush`` makes everything written durable (fsync).

    With ``unique_steps`` (evaluation directories) a scalar already in the directory's event
    files at the same step is not written again: a redone evaluation (its first run was killed
    before it was recorded as done) adds no second point for that step.
    """

    def __init__(self, logdir: str, unique_steps: bool = False):
        self.logdir = logdir
        self._writer: Any = None  # tensorboardX.event_file_writer.EventsWriter
        self._unique_steps = unique_steps
        self._written: set[tuple[str, int]] | None = None  # (tag, step) already in the files

    def _open(self) -> Any:
        storage.register_summary_writers()  # before tensorboardX: its clients stay out
        from tensorboardX.event_file_writer import EventsWriter

        storage.makedirs(self.logdir)
        with self._errors("open an event file"):
            # tensorboardX names a file by the second and truncates an existing one: the name
            # must be unique (a second writer in the same second) and sort in time order.
            return EventsWriter(
                storage.join(self.logdir, "events"),
                filename_suffix=f".{time.time_ns()}.{os.getpid()}",
            )

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Writes each named scalar at ``step``.

        Raises:
          OSError: the event file could not be written (names the directory).
        """
        storage.register_summary_writers()  # before tensorboardX: its clients stay out
        from tensorboardX import summary as tbx_summary
        from tensorboardX.proto import event_pb2

        if self._unique_steps and self._written is None:
            self._written = scalar_steps(self.logdir)
        if self._writer is None:
            self._writer = self._open()
        for name, value in values.items():
            if self._written is not None:
                if (name, int(step)) in self._written:
                    logging.info(
                        "%s at step %d is already in %s; not written again.",
                        name,
                        step,
                        self.logdir,
                    )
                    continue
                self._written.add((name, int(step)))
            event = event_pb2.Event(
                wall_time=time.time(),
                step=int(step),
                summary=tbx_summary.scalar(name, float(np.asarray(value))),
            )
            with self._errors("write summaries"):
                self._writer.write_event(event)

    def summaries(self, step: int, values: Mapping[str, Any]) -> None:
        """Writes image, histogram and text summaries (``estimax.summary``, reduced) at ``step``.

        Raises:
          OSError: the event file could not be written (names the directory).
        """
        storage.register_summary_writers()  # before tensorboardX: its clients stay out
        from tensorboardX.proto import event_pb2

        if self._writer is None:
            self._writer = self._open()
        for name, value in values.items():
            for summary in value.events(name):
                event = event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary)
                with self._errors("write summaries"):
                    self._writer.write_event(event)

    def tables(self, step: int, values: Mapping[str, Any]) -> None:
        """Writes each matrix (a confusion matrix: rows labels, columns predictions) as a
        TensorBoard text summary, a markdown table, at ``step``.

        Raises:
          OSError: the event file could not be written (names the directory).
        """
        storage.register_summary_writers()  # before tensorboardX: its clients stay out
        from tensorboardX import summary as tbx_summary
        from tensorboardX.proto import event_pb2

        if values and self._writer is None:
            self._writer = self._open()
        for name, matrix in values.items():
            rows = np.asarray(matrix)
            header = "| label \\ predicted | " + " | ".join(str(j) for j in range(rows.shape[1]))
            lines = [header + " |", "|---" * (rows.shape[1] + 1) + "|"]
            lines += [
                f"| {i} | " + " | ".join(f"{v:g}" for v in row) + " |" for i, row in enumerate(rows)
            ]
            event = event_pb2.Event(
                wall_time=time.time(),
                step=int(step),
                summary=tbx_summary.text(name, "\n".join(lines)),
            )
            with self._errors("write summaries"):
                self._writer.write_event(event)

    def flush(self) -> None:
        """Makes everything written so far durable (flushed, fsynced) and visible to readers.

        Raises:
          OSError: the event file could not be written (names the directory).
        """
        if self._writer is not None:
            with self._errors("write summaries"):
                self._writer.flush()

    def close(self) -> None:
        """Writes out, fsyncs and closes the event file."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            with self._errors("write summaries"):
                writer.close()

    @contextlib.contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        """Names the directory in a write error; the event file is given up (a torn last record
        ends it for readers) and the next write opens a new one."""
        try:
            yield
        except OSError as e:
            writer, self._writer = self._writer, None
            if writer is not None:
                with contextlib.suppress(OSError):
                    writer.close()
            raise storage.StorageError(
                e.errno,
                f"Could not {action} in {self.logdir}: {e.strerror or e}"
                + (
                    " (the disk is full or a file size limit was reached; free space and "
                    "run again: checkpoints are unaffected)"
                    if e.errno in _DISK_FULL_ERRNOS
                    else ""
                ),
            ) from e


def scalar_steps(logdir: str) -> set[tuple[str, int]]:
    """The (tag, step) pairs of the scalars in the event files directly in ``logdir``."""
    return {(tag, step) for step, values in scalar_values(logdir).items() for tag in values}


def scalar_values(logdir: str) -> dict[int, dict[str, float]]:
    """``{step: {tag: value}}`` of the scalars in the event files directly in ``logdir``.

    Event files are TFRecord files of ``Event`` protos (read with estimax's TFRecord reader and
    tensorboardX's proto: TensorBoard itself is only a test dependency). A torn last record (a
    writer killed mid-write) ends a file's events, as in TensorBoard. Text summaries (confusion
    matrices) are included with the value NaN: their tag and step are known, not a number.
    """
    storage.register_summary_writers()  # before tensorboardX: its clients stay out
    from tensorboardX.proto import event_pb2

    from estimax.data import tfrecord

    found: dict[int, dict[str, float]] = {}
    if not storage.isdir(logdir):
        return found
    fs, path = storage.filesystem(logdir)
    for name in sorted(fs.ls(path, detail=False)):
        if "tfevents" not in os.path.basename(name):
            continue
        full = storage.join(logdir, os.path.basename(name))
        try:
            for record in tfrecord.read_records(full):
                event = event_pb2.Event.FromString(record)
                for value in event.summary.value:
                    number = value.simple_value if value.HasField("simple_value") else math.nan
                    found.setdefault(int(event.step), {})[value.tag] = number
        except tfrecord.CorruptRecordError:
            continue  # its records before the torn one are counted
        except DecodeError:
            continue  # not an event file after all (a damaged one): TensorBoard skips it too
    return found


@dataclasses.dataclass(frozen=True)
class Evaluations:
    """The evaluations of an eval directory, as far as they can be verified.

    Attributes:
      evaluations: ``{global_step: results}``.
      damage: why ``evaluations.json`` was not used as written (it does not parse, or does not
        agree with TensorBoard's event files): ``evaluations`` were then rebuilt from the event
        files. None: the record is sound (or there is none).
    """

    evaluations: dict[int, dict[str, Any]]
    damage: str | None = None


# Event files hold float32: a recorded value and its event agree to float32's precision. The
# margin also covers a redone evaluation (killed after its summaries, before its record) whose
# reductions ran in another order.
_AGREE_RTOL = 1e-4
_AGREE_ATOL = 1e-6
_warned: set[str] = set()


def read_evaluations(logdir: str) -> Evaluations:
    """The evaluations recorded in ``logdir``, checked against its event files.

    ``evaluations.json`` is used as written when it parses as estimax writes it and agrees with
    the event files (each recorded step has its scalars there, with the same values). Otherwise
    (a damaged disk, a hand edit, a copy from another run) it is one WARNING, and the
    evaluations are rebuilt from the event files: every evaluation whose summaries were
    flushed, which is every one ever recorded. A record is trusted as is only where there are no
    event files to check it against.
    """
    path = storage.join(logdir, EVALUATIONS_FILE)
    if not storage.exists(path):
        return Evaluations({})
    events = scalar_values(logdir)
    try:
        with storage.open_file(path, "rb") as f:
            recorded = _parse_record(f.read())
        damage = _disagreement(recorded, events) if events else None
    except ValueError as e:
        damage = str(e)
    if damage is None:
        return Evaluations(recorded)
    rebuilt = _from_events(events)
    message = (
        f"{path} is damaged ({damage}): rebuilt from TensorBoard's event files in {logdir} "
        f"({len(rebuilt)} evaluation(s): steps {_steps(rebuilt)}); the next evaluation's "
        f"record replaces it (the damaged one is kept as {EVALUATIONS_FILE}.damaged)."
    )
    if message not in _warned:  # read at every check and save: said once
        _warned.add(message)
        logging.warning("%s", message)
    return Evaluations(rebuilt, damage)


def recorded_evaluations(logdir: str) -> dict[int, dict[str, Any]]:
    """``{global_step: results}`` of the evaluations durably recorded in ``logdir``
    (``read_evaluations``: a damaged record is rebuilt from the event files)."""
    return read_evaluations(logdir).evaluations


def _steps(evaluations: Mapping[int, Any]) -> str:
    steps = sorted(evaluations)
    shown = ", ".join(str(s) for s in steps[:8])
    return (shown + (f", ... {steps[-1]}" if len(steps) > 8 else "")) or "none"


def _parse_record(data: bytes) -> dict[int, dict[str, Any]]:
    """``evaluations.json`` as ``{step: results}``; ValueError saying what is wrong with it."""
    value = storage.load_json(data)
    table = value.get("evaluations") if isinstance(value, dict) else None
    if not isinstance(table, dict):
        raise ValueError('not {"evaluations": {step: results}}')
    recorded: dict[int, dict[str, Any]] = {}
    for key, results in table.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 18):
            raise ValueError(f"step {key[:20]!r} is not a global step")
        if not isinstance(results, dict):
            raise ValueError(f"step {key}: results are a {type(results).__name__}, not an object")
        for name, v in results.items():
            if not (_is_number(v) or isinstance(v, list)):
                raise ValueError(f"step {key}: {name[:40]!r} = {str(v)[:20]!r} is not a number")
        if results.get("global_step", int(key)) != int(key):
            raise ValueError(
                f"step {key} holds the results of global_step {results['global_step']}"
            )
        recorded[int(key)] = dict(results)
    return recorded


def _is_number(value: Any) -> bool:
    """A JSON number a metric can be: not a bool, and (an integer) within float's range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        float(value)
    except OverflowError:  # 10**400: no metric, and every comparison with it raises
        return False
    return True


def _event_tag(name: str) -> str:
    """The event files' tag of result ``name`` (``Estimator._write_eval``)."""
    return "eval/invalid_labels" if name == "invalid_labels" else name


def _disagreement(
    recorded: Mapping[int, Mapping[str, Any]], events: Mapping[int, Mapping[str, float]]
) -> str | None:
    """Where the record and the event files disagree (the first place), or None."""
    for step, results in sorted(recorded.items()):
        written = events.get(step)
        if written is None:
            return f"step {step} is recorded, but the event files have no evaluation at it"
        for name, value in results.items():
            if name in ("global_step", "num_examples") or not _is_number(value):
                continue
            event = written.get(_event_tag(name))
            if event is None:
                return f"step {step}: {name} is recorded, but not in the event files"
            if not (
                (math.isnan(value) and math.isnan(event))
                or math.isclose(value, event, rel_tol=_AGREE_RTOL, abs_tol=_AGREE_ATOL)
            ):
                return f"step {step}: {name} is recorded as {value}, the event files say {event}"
    return None


def _from_events(events: Mapping[int, Mapping[str, float]]) -> dict[int, dict[str, Any]]:
    """The evaluations the event files hold: each step's scalars (matrices are text there)."""
    rebuilt: dict[int, dict[str, Any]] = {}
    inverse = {_event_tag("invalid_labels"): "invalid_labels"}
    for step, values in sorted(events.items()):
        results: dict[str, Any] = {
            inverse.get(tag, tag): value for tag, value in values.items() if not math.isnan(value)
        }
        if results:
            rebuilt[step] = {**results, "global_step": step}
    return rebuilt


def record_evaluation(logdir: str, results: Mapping[str, Any]) -> None:
    """Adds ``results`` (with their ``global_step``) to ``logdir/evaluations.json``, durably.

    Call after the evaluation's summaries are flushed (``Summaries.flush``): an evaluation
    recorded here is one TensorBoard holds. A damaged record (``read_evaluations``) is kept
    beside it as ``evaluations.json.damaged`` before the rebuilt one replaces it.
    """
    found = read_evaluations(logdir)
    recorded = dict(found.evaluations)
    path = storage.join(logdir, EVALUATIONS_FILE)
    if found.damage is not None:
        _keep_damaged(path)
    recorded[int(results["global_step"])] = {k: _plain(v) for k, v in results.items()}
    write_json(
        path,
        {"evaluations": {str(k): recorded[k] for k in sorted(recorded)}},
        "record the evaluation",
    )


def _keep_damaged(path: str) -> None:
    """Copies a damaged record to ``<path>.damaged`` (replacing an older one): the evidence."""
    with storage.open_file(path, "rb") as f:
        data = f.read()
    with storage.open_file(path + ".damaged", "wb") as f:
        f.write(data)


def write_json(final: str, value: Any, action: str) -> None:
    """Writes ``value`` as JSON to ``final`` durably: whole or not at all.

    Local: written beside, fsynced, renamed into place (and the directory fsynced); object
    stores: one upload.

    Raises:
      StorageError: it could not be written (names the file and ``action``).
    """
    data = json.dumps(value, indent=1).encode()
    logdir = os.path.dirname(final)
    if storage.is_remote(final):
        with storage.open_file(final, "wb") as f:
            f.write(data)
        return
    os.makedirs(logdir, exist_ok=True)
    tmp = final + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise storage.StorageError(
            e.errno, f"Could not {action} in {final}: {e.strerror or e}"
        ) from e
    fd = os.open(logdir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _plain(value: Any) -> Any:
    """A result value as JSON: a number, or nested lists (a confusion matrix)."""
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    array = np.asarray(value)
    return array.item() if array.ndim == 0 else array.tolist()


def log_step(step: int, loss: float) -> None:
    """Logs the original's ``LoggingTensorHook`` line: ``loss = X, step = N``."""
    logging.info("loss = %s, step = %d", _fmt(loss), step)


def log_speed(steps_per_sec: float, examples_per_sec: float) -> None:
    """Logs the original's ``ExamplesPerSecondHook`` lines."""
    logging.info("global_step/sec: %g", steps_per_sec)
    logging.info("examples/sec: %g", examples_per_sec)


def _fmt(x: float) -> str:
    return np.format_float_positional(np.float32(x), precision=7, trim="-")
