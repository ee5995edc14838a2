"""Orbax checkpoints on ``s3://``: the TensorStore spec and commit protocol Orbax lacks there.

The path side of checkpoints (``estimax.storage`` knows paths and clients, not Orbax): which
kvstore an ``s3://`` checkpoint's arrays go to, and which atomicity protocol its directories use.
"""

from __future__ import annotations

import os
from typing import Any

from estimax import storage

_orbax_s3_enabled = False


def _s3_kvstore(path: str) -> dict:
    bucket, _, key = path[len("s3://") :].partition("/")
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    return spec


def enable_s3() -> None:
    """Lets Orbax write checkpoint arrays to ``s3://`` through TensorStore's ``s3`` driver.

    Orbax 0.12.8 builds TensorStore kvstore specs for ``gs://`` and local paths only: an
    ``s3://`` checkpoint fails with "Checkpoint path should be absolute" (google/orbax#359,
    #872; PR #2739 adding S3 is unmerged). Its spec builder is three module-level functions
    (``_use_gcs_driver``, ``_normalize_path``, ``gcs_utils.get_kvstore_for_gcs``); this wraps
    them so ``s3://`` paths get ``{"driver": "s3", "bucket", "path", "endpoint"}`` and every
    other path gets exactly what Orbax built before. Idempotent. Remove when Orbax supports S3.
    """
    global _orbax_s3_enabled
    if _orbax_s3_enabled:
        return
    from orbax.checkpoint._src.path import gcs_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as tsu

    # Private Orbax functions, wrapped on purpose (see the docstring): noqa SLF001 below.
    use_gcs, normalize, gcs_kvstore = (
        tsu._use_gcs_driver,  # noqa: SLF001
        tsu._normalize_path,  # noqa: SLF001
        gcs_utils.get_kvstore_for_gcs,
    )
    tsu._use_gcs_driver = lambda d: str(d).startswith("s3://") or use_gcs(d)  # noqa: SLF001
    # os.path.normpath turns "s3://b/k" into "s3:/b/k"; Orbax repairs only "gs:/".
    tsu._normalize_path = lambda p: (  # noqa: SLF001
        normalize(p).replace("s3:/", "s3://", 1) if str(p).startswith("s3://") else normalize(p)
    )
    gcs_utils.get_kvstore_for_gcs = lambda p: (
        _s3_kvstore(p) if str(p).startswith("s3://") else gcs_kvstore(p)
    )
    _orbax_s3_enabled = True


def manager_options(directory: str) -> dict[str, Any]:
    """Extra ``CheckpointManagerOptions`` fields for a checkpoint ``directory`` (may be empty).

    On ``s3://``: the commit-file protocol (write in place, ``commit_success.txt`` last, only
    steps that have it count), which is what Orbax chooses on GCS by itself; S3 has no atomic
    directory rename. Also points TensorStore at the emulators (:func:`configure`).
    """
    storage.configure()
    if storage.scheme(directory) != "s3":
        return {}
    enable_s3()
    from orbax.checkpoint import options as ocp_options

    return {
        "atomicity_options": ocp_options.AtomicityOptions(
            mode=ocp_options.AtomicityMode.COMMIT_FILE
        )
    }
