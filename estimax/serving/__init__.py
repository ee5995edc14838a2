"""The server: published versions (``estimax.export``) served over HTTP and gRPC.

| who owns what | where |
|---|---|
| one server's lifetime: the REST app, gRPC services and JSON workers, together | ``server`` |
| polling, load + warm before unload, failed loads reported | ``manager`` |
| the one polling thread (a model's versions, the model config file) | ``poller`` |
| several models: ``--model_config_file``, ``HandleReloadConfigRequest`` | ``registry`` |
| model control: v2 repository index/load/unload, ``--model_control_mode`` | ``control`` |
| dynamic batching (TF Serving's knobs), 429 on a full queue | ``batching`` |
| one model manager, limits, batching for every protocol | ``core`` |
| the server's limits and behaviour (``ServerOptions``, one field per flag) | ``options`` |
| errors and their HTTP/gRPC codes, echoes of what a client sent, the dtype table | ``protocol`` |
| TensorFlow's ``TensorProto`` to and from columns (gRPC Predict, warm-up records) | ``tensors`` |
| a version's TF Serving warm-up records, replayed before it is served | ``warmup`` |
| one request's record and its access-log line | ``tracking`` |
| Prometheus metrics (TF Serving's names), Triton's statistics | ``metrics`` |
| class names in answers: TF Serving's classify, v2's classification extension | ``classes`` |
| v2 tensors: JSON, binary extension, gRPC raw contents (decode/encode) | ``v2`` |
| large JSON bodies parsed in worker processes | ``bodies`` |
| connections: timeouts, header limits, the connection cap (uvicorn's protocol) | ``transport`` |
| TF Serving REST API + Open Inference Protocol v2 over HTTP (FastAPI) | ``rest`` |
| TF Serving gRPC (Predict, Classify, metadata, status), v2 + Triton's | ``grpc_server`` |
| messages generated from the published .proto files | ``protos`` |
| ``estimax serve``'s flags, Vertex AI's ``AIP_*`` | ``cli`` |
| the quick start's client: one image sent over REST and gRPC | ``demo`` |

Inside, ``grpc_server`` imports ``core``, which imports ``warmup``, which imports ``tensors``,
``classes`` and ``v2`` import ``protocol``, and ``options`` and ``protocol`` import none of them:
a ``layers`` contract of ``make lint`` keeps that order, so no import circle comes back.

The server needs JAX and the export directory only: it imports none of ``estimax.estimator``,
``estimax.models``, ``estimax.programs``, optax or orbax (a ``forbidden`` contract of ``make
lint`` checks it), so a serving image can leave training out. Public names are imported on
first use, so that ``import estimax.serving`` loads no FastAPI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from estimax.serving.options import ServerOptions
    from estimax.serving.protocol import ApiError
    from estimax.serving.server import Server

_EXPORTS = {
    "ApiError": "estimax.serving.protocol",
    "ServerOptions": "estimax.serving.options",
    "Server": "estimax.serving.server",
}

__all__ = ["ApiError", "Server", "ServerOptions"]

# Hidden from type checkers, which would otherwise take any `estimax.serving.<name>` as valid.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        """Imports a public name's module on first use (PEP 562)."""
        if name in _EXPORTS:
            return getattr(importlib.import_module(_EXPORTS[name]), name)
        raise AttributeError(f"module 'estimax.serving' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
