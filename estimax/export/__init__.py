"""Exports: the format of a served model, publishing it as a checked version, exporters.

| who owns what | where |
|---|---|
| loading one export (``jax.export`` artifact + weights), any fsspec path | ``artifact`` |
| ``serving.json``, the export record (preprocessing, top-k, class names) | ``record`` |
| image preprocessing recorded with an export, applied by the server | ``preprocess`` |
| TF Serving's warm-up records written into a version (``assets.extra/``) | ``warmup`` |
| request values -> features, padding to compiled batch sizes | ``servable`` |
| versions on disk: listing, fingerprints, the stored parity check | ``versions`` |
| the skew check's model inputs, check images drawn across classes | ``skew`` |
| ``export_version``: an Estimator's model, checked, as ``<base>/<version>/`` | ``publish`` |
| Latest/Best/Final exporters of ``train_and_evaluate`` | ``exporters`` |
| ``estimax export-check``, ``predict``, ``export-savedmodel``, ``export-onnx`` | ``cli`` |
| a version as a TF SavedModel or an ONNX model | ``formats`` |

The layers inside (``pyproject.toml``'s import contract): ``formats`` and ``cli`` > ``exporters``
> ``publish`` > ``versions`` | ``skew`` > ``servable`` > ``artifact`` | ``record`` |
``preprocess`` | ``warmup``. Only ``publish`` and ``exporters`` import the estimator; the server
(``estimax.serving``) imports the modules below them, so a serving image leaves training out.
Public names are imported on first use, so that importing ``estimax.export.servable`` (as the
server does) does not import the estimator through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from estimax.export.artifact import ExportedModel, load
    from estimax.export.preprocess import (
        Preprocessing,
        image_preprocessing,
        inception_eval,
        resnet_eval,
    )
    from estimax.export.publish import export_version
    from estimax.export.record import ExportRecord, class_names_from_manifest
    from estimax.export.servable import InvalidInput, Servable
    from estimax.export.skew import check_images
    from estimax.export.versions import ExportCheckError, check_version, list_versions

# Public name -> module that defines it (imported on first use).
_EXPORTS = {
    "ExportedModel": "estimax.export.artifact",
    "load": "estimax.export.artifact",
    "Preprocessing": "estimax.export.preprocess",
    "image_preprocessing": "estimax.export.preprocess",
    "inception_eval": "estimax.export.preprocess",
    "resnet_eval": "estimax.export.preprocess",
    "export_version": "estimax.export.publish",
    "ExportRecord": "estimax.export.record",
    "class_names_from_manifest": "estimax.export.record",
    "InvalidInput": "estimax.export.servable",
    "Servable": "estimax.export.servable",
    "check_images": "estimax.export.skew",
    "ExportCheckError": "estimax.export.versions",
    "check_version": "estimax.export.versions",
    "list_versions": "estimax.export.versions",
}

__all__ = [
    "ExportCheckError",
    "ExportRecord",
    "ExportedModel",
    "InvalidInput",
    "Preprocessing",
    "Servable",
    "check_images",
    "check_version",
    "class_names_from_manifest",
    "export_version",
    "image_preprocessing",
    "inception_eval",
    "list_versions",
    "load",
    "resnet_eval",
]

# Hidden from type checkers, which would otherwise take any `estimax.export.<name>` as valid.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        """Imports a public name's module on first use (PEP 562)."""
        if name in _EXPORTS:
            return getattr(importlib.import_module(_EXPORTS[name]), name)
        raise AttributeError(f"module 'estimax.export' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
