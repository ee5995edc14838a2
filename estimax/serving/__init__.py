"""Serving exported models: versions on disk, an HTTP server, and the command line.

| who owns what | where |
|---|---|
| loading one export (``jax.export`` artifact + weights), any fsspec path | ``artifact`` |
| image preprocessing recorded with an export, applied by the server | ``preprocess`` |
| request values -> features, padding to compiled batch sizes | ``servable`` |
| ``serving.json``, the export record (preprocessing, top-k, class names) | ``record`` |
| ``export_version``: atomic ``<base>/<version>/``, parity check | ``versions`` |
| polling, load + warm before unload, failed loads reported | ``manager`` |
| dynamic batching (TF Serving's knobs), 429 on a full queue | ``batching`` |
| one model manager, limits, batching, errors, dtype table for every protocol | ``core`` |
| one request's record and its access-log line | ``tracking`` |
| Prometheus metrics (TF Serving's names), Triton's statistics | ``metrics`` |
| class names in answers: TF Serving's classify, v2's classification extension | ``classes`` |
| v2 tensors: JSON, binary extension, gRPC raw contents (decode/encode) | ``v2`` |
| TF Serving REST API + Open Inference Protocol v2 over HTTP (FastAPI) | ``rest`` |
| TF Serving gRPC (Predict, Classify, metadata, status), v2 + Triton's | ``grpc_server`` |
| messages generated from the published .proto files | ``protos`` |
| the ``estimax`` subcommands (serve, predict, export-*), Vertex AI's ``AIP_*`` | ``cli`` |
| a version as a TF SavedModel, preprocessing in TF ops | ``savedmodel``, ``tf_preprocess`` |
| a version as an ONNX model: StableHLO -> ONNX op by op | ``onnx_export``, ``stablehlo_onnx`` |
| what both read: the export, names, check inputs, comparison | ``export_formats`` |

Serving needs JAX and the export directory only: nothing here imports the model's code
(``estimax.models``, ``estimax.programs``); only ``export_version`` imports the estimator.
"""

from estimax.serving.artifact import ExportedModel, load
from estimax.serving.preprocess import (
    Preprocessing,
    image_preprocessing,
    inception_eval,
    resnet_eval,
)
from estimax.serving.record import ExportRecord, class_names_from_manifest
from estimax.serving.servable import InvalidInput, Servable
from estimax.serving.versions import ExportCheckError, check_version, export_version, list_versions

__all__ = [
    "ExportCheckError",
    "ExportRecord",
    "ExportedModel",
    "InvalidInput",
    "Preprocessing",
    "Servable",
    "check_version",
    "class_names_from_manifest",
    "export_version",
    "image_preprocessing",
    "inception_eval",
    "list_versions",
    "load",
    "resnet_eval",
]
