"""The conversion as an Apache Beam pipeline: DirectRunner here, Dataflow, Flink or Spark at scale.

``--runner=DirectRunner`` runs on Beam's ``FnApiRunner``, named explicitly (see ``_runner``: no
Prism, no download, works offline), with ``--num_workers`` SDK worker processes; the log names
the runner that ran.

Same plan, shard writer and manifest as the local tool (``convert_shards``), so the output is the
same bytes: the driver lists the inputs, assigns them to shards and drops shards already complete
(resume); the pipeline is::

    Create(shard tasks) | Reshuffle | Map(write_shard) | ToList | Map(write the manifest)

Shards are the unit of work, as in ``jpeg_to_tf_record.py``'s ``WriteToTFRecord`` step, but each
shard is written whole by one worker through the atomic ``TFRecordWriter`` and checksummed, and
the shard count is ours (``--train_shards``), not the runner's. A failed bundle is retried by the
runner; the rename makes a retried shard replace, never duplicate, its file. The manifest is
written by the pipeline's last step, so it also appears when the driver does not wait
(Dataflow). If the pipeline fails, shards already written are redone on the next run (they are
not in the manifest yet).

Runner options pass through: e.g. ``--project --region --temp_location`` (Dataflow),
``--flink_master`` (Flink), ``--spark_master_url`` (Spark). The input paths and ``--output_dir``
must be readable/writable by the workers (``gs://`` for Dataflow).

Requires the optional extra ``estimax[beam]`` (``apache-beam``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from estimax.tools.convert_shards import (
    Manifest,
    finish_manifest,
    load_manifest,
    plan_conversion,
    write_shard,
)
from estimax.tools.convert_sources import Dataset

__all__ = ["RUNNERS", "convert_beam", "index_beam"]

RUNNERS = ("DirectRunner", "DataflowRunner", "FlinkRunner", "SparkRunner")

log = logging.getLogger(__name__)


def convert_beam(
    dataset: Dataset,
    output_dir: str,
    num_shards: dict[str, int],
    *,
    runner: str = "DirectRunner",
    pipeline_args: list[str] | None = None,
    num_workers: int | None = None,
    check: str = "scaled",
    skip_bad: bool = False,
    overwrite: bool = False,
    source: dict | None = None,
) -> Manifest:
    """Converts ``dataset`` with Beam; same arguments and output as ``convert_local``.

    Args:
      runner: one of :data:`RUNNERS` (``DirectRunner``: Beam's FnApiRunner, see ``_runner``).
      pipeline_args: extra Beam pipeline options (``--project=...`` etc.).
      num_workers: local worker processes (default: the usable cores).

    Raises:
      ImportError: apache-beam is not installed (the message says how to install it).
    """
    beam = _beam()
    from apache_beam.options.pipeline_options import PipelineOptions

    if runner not in RUNNERS:
        raise ValueError(f"--runner must be one of local, {', '.join(RUNNERS)}; got {runner!r}")
    plan = plan_conversion(
        dataset, output_dir, num_shards, check, skip_bad, overwrite=overwrite, source=source
    )
    tasks, manifest, todo = plan.tasks, plan.manifest, plan.todo
    workers = num_workers or len(os.sched_getaffinity(0))
    pipeline_runner, described = _runner(runner, workers)
    # multi_processing: one SDK worker process per core (the in-memory mode is one process).
    local = {"direct_num_workers": workers, "direct_running_mode": "multi_processing"}
    extra: dict[str, Any] = local if runner == "DirectRunner" else {"runner": runner}
    log.info("Beam: writing %d shards on %s", len(todo), described)
    with beam.Pipeline(
        runner=pipeline_runner, options=PipelineOptions(pipeline_args or [], **extra)
    ) as p:
        _ = (
            p
            | "Shards" >> beam.Create(todo)
            # Spread the shards over workers (Create's output would otherwise stay in one
            # bundle on some runners).
            | "Spread" >> beam.Reshuffle()
            | "WriteShard" >> beam.Map(write_shard)
            | "Collect" >> beam.combiners.ToList()
            | "WriteManifest"
            >> beam.Map(finish_manifest, manifest.to_json(), output_dir, len(tasks))
        )
    final = load_manifest(output_dir)
    assert final is not None
    log.info("Beam: %s wrote %d shards", described.split(" (")[0], len(todo))
    return final


def _index_one(path: str, verify: bool, index_dir: str | None = None) -> tuple[str, int, int, str]:
    """One shard's index (``estimax-convert index``): ``(path, records, bytes, problem)``."""
    from estimax.data import shard_index

    r = shard_index.index_shard(path, verify_crc=verify, keep_partial=True, index_dir=index_dir)
    return path, len(r.offsets) - 1, r.bytes_read, str(r.error or r.write_error or "")


def index_beam(
    paths: list[str],
    runner: str,
    pipeline_args: list[str],
    *,
    num_workers: int | None = None,
    verify: bool = False,
    index_dir: str | None = None,
) -> list[tuple[str, int, int, str]]:
    """``estimax-convert index --runner=...``: each shard's index written by a Beam worker
    (``Create(shards) | Reshuffle | Map(index one shard)``), for many thousands of shards.

    The workers write the indexes in the hidden folder beside the shards (or in ``index_dir``);
    the driver then reads back which shards have an index that fits them (a runner such as
    Dataflow returns nothing else to it).

    Returns:
      Per shard ``(path, records, bytes_read, problem or "")``; bytes read are not known to the
      driver and given as the shard's size for the shards indexed.
    """
    beam = _beam()
    from apache_beam.options.pipeline_options import PipelineOptions

    from estimax.data import shard_index

    if runner not in RUNNERS:
        raise ValueError(f"--runner must be one of local, {', '.join(RUNNERS)}; got {runner!r}")
    workers = num_workers or len(os.sched_getaffinity(0))
    pipeline_runner, described = _runner(runner, workers)
    local = {"direct_num_workers": workers, "direct_running_mode": "multi_processing"}
    extra: dict[str, Any] = local if runner == "DirectRunner" else {"runner": runner}
    log.info("Beam: indexing %d shards on %s", len(paths), described)
    with beam.Pipeline(
        runner=pipeline_runner, options=PipelineOptions(pipeline_args, **extra)
    ) as p:
        _ = (
            p
            | "Shards" >> beam.Create(paths)
            | "Spread" >> beam.Reshuffle()
            | "Index" >> beam.Map(_index_one, verify, index_dir)
        )
    rows = []
    for path in paths:
        rf, size, why = shard_index.open_indexed(path, False, explicit_dir=index_dir)
        if rf is None:
            rows.append(
                (path, 0, 0, f"{path}: no index written ({why}); index it locally to see why")
            )
        else:
            rows.append((path, len(rf), size, ""))
    return rows


def _beam() -> Any:
    """``apache_beam``, or an ImportError saying how to install it."""
    try:
        import apache_beam
    except ImportError as e:
        raise ImportError(
            "the Beam pipeline needs apache-beam: pip install 'estimax[beam]' "
            f"(or apache-beam==2.77.0); {e}"
        ) from None
    return apache_beam


def _runner(name: str, num_workers: int) -> tuple[Any, str]:
    """The runner to give the pipeline, and a line naming it for the log.

    ``DirectRunner`` is run on Beam's ``FnApiRunner``, named explicitly: in Beam 2.77 the
    DirectRunner is a switching runner that first tries Prism, which downloads its binary from
    GitHub (no timeout: an offline machine waits) and ignores ``direct_num_workers`` when it
    runs. Beam's own advice for local runs is to pin the FnApiRunner (apache/beam PR #34612).
    """
    if name != "DirectRunner":
        return name, name
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    return FnApiRunner(), (
        f"FnApiRunner (Beam's local runner, {num_workers} worker processes; --runner="
        "DirectRunner never tries Prism, which would download its binary from GitHub)"
    )
