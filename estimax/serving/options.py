"""``ServerOptions``: the limits and behaviour of ``estimax serve``, one field per flag.

Below the server's modules (``estimax.serving.core`` and what it uses read it), and the one
definition ``estimax.serving.cli`` builds its flags from.
"""

from __future__ import annotations

import dataclasses

from estimax.serving.batching import BatchingOptions
from estimax.serving.transport import ConnectionLimits

__all__ = ["READINESS", "ServerOptions"]

# The server's readiness policies (``ServerOptions.readiness``).
READINESS = ("all", "any")


@dataclasses.dataclass
class ServerOptions:
    """Limits and behaviour of the server (the ``estimax serve`` flags).

    Attributes:
      enable_batching: merge concurrent requests (``BatchingOptions``).
      batching: the batching knobs (also give the compiled batch sizes without batching).
      rest_api_timeout_in_ms: a request taking longer answers 504 (gRPC: DEADLINE_EXCEEDED);
        0 or less: no deadline (TF Serving's meaning).
      max_body_bytes: larger bodies answer 413 (gRPC messages: RESOURCE_EXHAUSTED).
      max_body_bytes_in_flight: the HTTP request bodies held at once (received, not yet
        answered), at most; a body that would pass it answers 503 with Retry-After.
      max_instances: more instances in one request answer 400.
      max_image_pixels: larger images (by their header) answer 400.
      grpc_port: the gRPC port (TF Serving's ``--port``); 0: no gRPC.
      grpc_host: the address the gRPC port binds.
      metrics_paths: HTTP paths answering Prometheus text (none: no metrics endpoint).
      access_log: write one ``estimax.serving.access`` line per request.
      access_log_format: ``text`` or ``json`` (JSON lines).
      vertex_predict_route, vertex_health_route: Vertex AI's ``AIP_PREDICT_ROUTE`` and
        ``AIP_HEALTH_ROUTE`` (empty: not served).
      limits: the connections' timeouts and caps (``estimax.serving.transport``; gRPC: its
        handshake timeout and connection cap).
      api_docs: serve ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc); their pages load scripts
        from a public CDN, so they are off unless asked for.
      enable_model_warmup: replay a version's ``assets.extra/tf_serving_warmup_requests``
        before it is served (``estimax.serving.warmup``), each record ``warmup_iterations``
        times.
      rest: serve HTTP (False: gRPC only, TF Serving's ``--rest_api_port=0``).
      grpc_max_concurrent_rpcs: gRPC calls in progress at once, at most (TF Serving's
        ``--grpc_max_threads``); past it a call answers RESOURCE_EXHAUSTED at once. 0: no bound.
      grpc_arguments: more gRPC server arguments (TF Serving's ``--grpc_channel_arguments``),
        ``(name, int or str)``; they replace estimax's own of the same name.
      readiness: the server's readiness (gRPC health ``""`` and the services', v2's
        ``/v2/health/ready``, ``ServerReady``, Vertex AI's health route): ``all`` (TF Serving's
        and the default: every model has a version available) or ``any`` (at least one: a
        broken model does not take the others out of a load balancer). Each model's own
        readiness (gRPC health of its name, ``/v2/models/NAME/ready``) is always its own.
      json_workers: the processes that parse large HTTP bodies and write large answers
        (``estimax.serving.bodies``; TF Serving's ``--rest_api_num_threads``). 0: its default.
      priority_levels, default_priority_level, priority_aging_ms: a request's priority levels
        (1 the highest), the level of one that gives none, and the aging step that keeps low
        levels from starving (``estimax.serving.admission``).
      max_concurrent_per_model: run threads one model may hold at once (0: no cap).
      response_cache_models, response_cache_bytes: the models whose answers are cached, and
        the cache's bound for the server (``estimax.serving.response_cache``).
    """

    enable_batching: bool = False
    batching: BatchingOptions = dataclasses.field(default_factory=BatchingOptions)
    rest_api_timeout_in_ms: int = 30_000
    max_body_bytes: int = 64 << 20
    max_body_bytes_in_flight: int = 1 << 30
    max_instances: int = 1024
    max_image_pixels: int = 1 << 26
    grpc_port: int = 0
    grpc_host: str = "127.0.0.1"
    metrics_paths: tuple[str, ...] = ()
    access_log: bool = True
    access_log_format: str = "text"
    vertex_predict_route: str = ""
    vertex_health_route: str = ""
    limits: ConnectionLimits = dataclasses.field(default_factory=ConnectionLimits)
    api_docs: bool = False
    enable_model_warmup: bool = True
    warmup_iterations: int = 1
    rest: bool = True
    grpc_max_concurrent_rpcs: int = 0
    grpc_arguments: tuple[tuple[str, int | str], ...] = ()
    json_workers: int = 0
    readiness: str = "all"
    priority_levels: int = 3
    default_priority_level: int = 2
    priority_aging_ms: int = 100
    max_concurrent_per_model: int = 0
    response_cache_models: tuple[str, ...] = ()
    response_cache_bytes: int = 64 << 20

    def validate(self) -> None:
        """Raises ValueError naming the flag of a body limit that cannot hold (or a readiness
        policy that is not one)."""
        if self.readiness not in READINESS:
            raise ValueError(f"--readiness={self.readiness!r}: give one of {', '.join(READINESS)}")
        if self.priority_levels < 1 or not 1 <= self.default_priority_level <= self.priority_levels:
            raise ValueError(
                f"--default_priority_level={self.default_priority_level} must be from 1 to "
                f"--priority_levels={self.priority_levels} (and that at least 1)"
            )
        if self.priority_aging_ms < 0 or self.max_concurrent_per_model < 0:
            raise ValueError("--priority_aging_ms and --max_concurrent_per_model must be >= 0")
        if self.response_cache_bytes < 0:
            raise ValueError("--response_cache_bytes must be >= 0")
        if self.max_body_bytes <= 0:
            raise ValueError("--max_body_bytes must be > 0")
        if self.max_body_bytes_in_flight < self.max_body_bytes:
            raise ValueError(
                f"--max_body_bytes_in_flight={self.max_body_bytes_in_flight} is less than "
                f"--max_body_bytes={self.max_body_bytes}: no body that large could ever arrive"
            )
