"""One request's record, from its arrival to its answer, and the access-log line made from it.

Every HTTP request and gRPC call opens a ``RequestRecord`` (``ServingCore.track``: the HTTP
middleware and the gRPC method wrapper); the core fills it in as it learns the model, the
version, the instance count and where the time went (preparing the inputs, waiting in the
batching queue, running the model); when the answer is sent ``ServingCore.finish`` counts it once
in ``ServingMetrics`` (Prometheus and Triton's statistics) and writes one access-log line. The
record of the request being handled is found through a ``ContextVar``: each request runs in its
own asyncio task (uvicorn's and ``grpc.aio``'s), so concurrent requests never see each other's.

Access-log fields (text: ``key=value`` after the time; ``--access_log_format=json``: JSON lines):
``time`` (UTC, ISO 8601), ``client`` (address:port), ``transport`` (``http``/``grpc``),
``protocol`` (``tf_serving``, ``v2``, ``vertex``; empty for an unknown path), ``method`` (HTTP),
``route`` (the path, or ``/package.Service/Method``), ``api`` (``predict``, ``infer``,
``Predict``...), ``model``, ``version``, ``status`` (HTTP status; for gRPC the one its code
stands for), ``code`` (the canonical code name: ``OK``, ``INVALID_ARGUMENT``...), ``latency_ms``,
``instances``.

Every string a client controls (the path, the model name, a gRPC method, the error that echoes
what was sent) reaches the logs through ``printable``: control characters (CR, LF, ESC, the C1
set, Unicode's line separators) and unencodable surrogates escaped, cut to ``LOG_CHARS``. One
request is one line, and a terminal tailing the log runs nothing a client wrote.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import json
import re
import time

# A client-controlled string in a log line, at most (the rest is counted, not written).
LOG_CHARS = 1024
# What a log line must not carry raw: C0 controls (CR, LF, ESC...), DEL, the C1 controls (a
# terminal takes U+009B as ESC [), Unicode's line and paragraph separators (editors and log
# viewers break lines there) and lone surrogates (no UTF-8 log stream can write them: the
# logging module would print a multi-line traceback instead of the line).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    c = match.group()
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (
        f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
    )


def printable(text: str, limit: int = LOG_CHARS) -> str:
    """``text`` safe for one log line: control characters escaped (``\\r``, ``\\x1b``...),
    cut to ``limit`` characters with the original length stated."""
    size = len(text)
    if size > limit:
        text = text[:limit]
    if _UNPRINTABLE.search(text):
        text = _UNPRINTABLE.sub(_escape, text)
    return text if size <= limit else f"{text}... ({size} chars)"


# The APIs that run the model: Triton's statistics and the runtime latency count only these.
INFERENCE_APIS = frozenset({"predict", "classify", "infer", "Predict", "Classify", "ModelInfer"})


@dataclasses.dataclass
class RequestRecord:
    """What is known about one request (module docstring); times from ``time.perf_counter``."""

    transport: str
    route: str
    client: str = ""
    method: str = ""
    protocol: str = ""
    api: str = ""
    model: str = ""
    version: str = ""
    instances: int = 0
    status: int = 200
    code: str = "OK"
    error: str = ""
    start: float = dataclasses.field(default_factory=time.perf_counter)
    wall: float = dataclasses.field(default_factory=time.time)
    end: float = 0.0
    prepare_s: float = 0.0  # decoding and checking the inputs (Triton's compute_input)
    queue_s: float = 0.0  # waiting for a run thread or a batch (Triton's queue)
    run_s: float = 0.0  # the model's run, of the batch it was in (Triton's compute_infer)
    run_end: float = 0.0  # when the outputs came back (0: the model never ran)
    body_bytes: int = 0  # of its body, charged to the server's budget (rest.read_body)

    @property
    def latency_s(self) -> float:
        """Seconds from arrival to the answer (so far, before ``end`` is set)."""
        return (self.end or time.perf_counter()) - self.start

    @property
    def inference(self) -> bool:
        """Whether the request asks the model for an answer (not metadata or health)."""
        return self.api in INFERENCE_APIS

    @property
    def ran(self) -> bool:
        """Whether the model ran for this request."""
        return self.run_end > 0

    def fail(self, status: int, code: str, error: str) -> None:
        """Marks the request failed with an HTTP ``status``, its canonical ``code`` and why."""
        self.status, self.code, self.error = status, code, error

    def fields(self) -> dict[str, object]:
        """The access-log fields, in their order."""
        when = datetime.datetime.fromtimestamp(self.wall, datetime.UTC)
        return {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            # What a client wrote (the path, the model and version it named, the method)
            # is cut: a line is bounded whatever was sent.
            "client": self.client,
            "transport": self.transport,
            "protocol": self.protocol,
            "method": _cut(self.method),
            "route": _cut(self.route),
            "api": self.api,
            "model": _cut(self.model),
            "version": _cut(self.version),
            "status": self.status,
            "code": self.code,
            "latency_ms": round(self.latency_s * 1000, 3),
            "instances": self.instances,
        }

    def access_line(self, json_lines: bool) -> str:
        """One access-log line: JSON, or the time then ``key=value`` pairs (values quoted).

        Either way one line, however the client's strings are made: JSON escapes every control
        and non-ASCII character; the text form writes them as ``printable`` does.
        """
        fields = self.fields()
        if json_lines:
            return json.dumps(fields, separators=(",", ":"))
        when = fields.pop("time")
        return f"{when} " + " ".join(f"{k}={_text(v)}" for k, v in fields.items())


def _cut(text: str) -> str:
    return text if len(text) <= LOG_CHARS else f"{text[:LOG_CHARS]}... ({len(text)} chars)"


def _text(value: object) -> str:
    # Quoted when empty or holding spaces/quotes, so a line always splits into its fields;
    # json.dumps also escapes every control character (a field never breaks or forges a line).
    text = str(value)
    if not text or any(c in text for c in ' "=') or _UNPRINTABLE.search(text):
        return json.dumps(text)
    return text


# The record of the request this task handles.
CURRENT: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "estimax_serving_request", default=None
)


def current() -> RequestRecord:
    """The record of the request being handled (outside one, a record that nothing reads)."""
    return CURRENT.get() or RequestRecord("none", "")
