"""What every protocol of ``estimax serve`` shares: the served models, one way to take a version.

The HTTP routes (TF Serving REST, Open Inference Protocol v2 with its binary extension) and the
gRPC services (TF Serving's ``PredictionService``/``ModelService``, v2's
``GRPCInferenceService``) all turn their requests into ``{input name: batch}`` columns and call
``ServingCore.infer`` inside ``ServingCore.servable``: the same limits, the same batching queue
per model (one asyncio loop serves both ports), the same hot reload (a version being unloaded
finishes the requests that hold it), the same errors. ``ApiError`` carries the HTTP status TF
Serving gives an error; ``ApiError.grpc_code`` is the gRPC code of the same error (TF Serving's
``ToHTTPStatusCode`` read backwards).

Several models may be served (``--model_config_file``): each is a ``ServedModel`` (its own
``ModelManager``, batching queue and version labels) found by name in one dict, so a request
costs the same whatever the number of models. The dict is replaced whole when a model is added
or removed (``estimax.serving.registry``), never changed in place: requests read it unlocked.

Every request is also *tracked* here, in one place for every protocol (``track``/``finish``,
``estimax.serving.tracking``): counted in ``ServingMetrics`` (Prometheus, Triton's statistics),
written to the access log (``estimax.serving.access``), and, when it fails, logged with its cause
at WARNING (ERROR for an internal error, 500) on ``estimax.serving.core``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from prometheus_client import Counter

from estimax.export.servable import InvalidInput, RequestCancelled, Servable
from estimax.export.versions import MAX_VERSION, version_number
from estimax.serving import admission, memory, model_settings, response_cache, tracking, warmup
from estimax.serving.batching import Batcher, BatchingOptions, QueueFullError
from estimax.serving.manager import ModelManager, VersionPolicy, VersionState
from estimax.serving.metrics import ServingMetrics

# The options and the protocols' vocabulary live below this module (estimax.serving.options,
# estimax.serving.protocol); imported from here too, as they were before they moved.
from estimax.serving.options import ServerOptions
from estimax.serving.protocol import (
    BY_NUMPY,
    BY_TF,
    BY_V2,
    DTYPES,
    ECHO_CHARS,
    ECHO_NAMES,
    HTTP_STATUS,
    MESSAGE_CHARS,
    ApiError,
    DType,
    ascii_int,
    clip,
    cut,
    dtype_of,
    echo,
    echo_names,
    grpc_code_of,
    numpy_dtype,
    refuse_repeated,
)
from estimax.serving.tracking import RequestRecord

__all__ = [
    "BY_NUMPY",
    "BY_TF",
    "BY_V2",
    "DTYPES",
    "ECHO_CHARS",
    "ECHO_NAMES",
    "HTTP_STATUS",
    "MESSAGE_CHARS",
    "PREDICT_METHOD",
    "RETRY_AFTER_SECONDS",
    "SIGNATURE_NAME",
    "SIGNATURE_NAMES",
    "TRIM_AFTER_BYTES",
    "ApiError",
    "BodyBudget",
    "DType",
    "ServedModel",
    "ServerOptions",
    "ServingCore",
    "ascii_int",
    "clip",
    "cut",
    "dtype_of",
    "echo",
    "echo_names",
    "grpc_code_of",
    "numpy_dtype",
    "refuse_repeated",
]

log = logging.getLogger(__name__)
access_log = logging.getLogger("estimax.serving.access")

SIGNATURE_NAME = "serving_default"
PREDICT_METHOD = "tensorflow/serving/predict"
# Accepted signature names: TF Serving's default key and the names exports are often given.
SIGNATURE_NAMES = (SIGNATURE_NAME, "classify", "predict", "")


# A 429's Retry-After (HTTP) and grpc-retry-pushback-ms (gRPC): a full queue drains in about a
# batch's run; one second is the smallest Retry-After can say.
RETRY_AFTER_SECONDS = 1
# A request whose body held this many bytes hands the freed memory back to the system when it
# ends (estimax.serving.memory).
TRIM_AFTER_BYTES = 8 << 20


class BodyBudget:
    """The bytes of HTTP request bodies the server holds at once, bounded.

    A body is charged as its bytes arrive (never by what its ``Content-Length`` declares: 40
    connections declaring 64 MiB and sending a byte each once made the server allocate 2 GiB)
    and released when its request is answered. Used on the event loop only: no lock.
    """

    def __init__(self, limit: int):
        """At most ``limit`` bytes held at once."""
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        """Charges ``n`` more bytes; False (nothing charged) if that would pass the limit."""
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        """Releases ``n`` bytes charged before."""
        self.held -= n


@dataclasses.dataclass
class ServedModel:
    """One model of the server: its versions, its batching queue and its version labels.

    Attributes:
      manager: loads and swaps its versions.
      batcher: its own batching queue (None without ``--enable_batching``).
      labels: version label -> version (TF Serving's ``version_labels``); replaced whole.
      gate: its share of the run threads without batching (``--max_concurrent_per_model``;
        None: no cap).
      settings: its response cache and priority levels (``estimax.serving.model_settings``).
    """

    manager: ModelManager
    batcher: Batcher | None
    labels: dict[str, int] = dataclasses.field(default_factory=dict)
    gate: admission.Gate | None = None
    settings: model_settings.ModelSettings = model_settings.ModelSettings()

    @property
    def name(self) -> str:
        """The model's name (``/v1/models/NAME``)."""
        return self.manager.name

    @property
    def policy(self) -> VersionPolicy:
        """Which versions are served."""
        return self.manager.policy


class ServingCore:
    """The served models, the limits and the batching queues behind every route and service."""

    def __init__(self, manager: ModelManager | Sequence[ModelManager], options: ServerOptions):
        """``manager``: the model's (or each model's) manager, started by the caller."""
        options.batching.validate()
        options.validate()
        self.models: dict[str, ServedModel] = {}
        self.bodies_in_flight = BodyBudget(options.max_body_bytes_in_flight)
        self.options = options
        self._run_pool = ThreadPoolExecutor(
            max_workers=options.batching.num_batch_threads, thread_name_prefix="run"
        )
        self._decode_pool = ThreadPoolExecutor(
            max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="decode"
        )
        # Unbatched runs given to the run threads and not ended: below their count, a request
        # decodes and runs on one run thread (``_prepare_and_run``).
        self._unbatched = 0
        self._unbatched_lock = threading.Lock()
        self.metrics = ServingMetrics(
            self._served,
            version_states=lambda: [
                (m.name, str(s.version), s.state)
                for m in self.models.values()
                for s in m.manager.states()
            ],
            queued=lambda: [
                (m.name, m.batcher.queued if m.batcher is not None else 0)
                for m in self.models.values()
            ],
        )
        # Admission (estimax.serving.admission) and the response cache, counted beside the rest.
        self.response_cache = response_cache.ResponseCache(
            options.response_cache_bytes, self.metrics.registry
        )
        self.deadlines_exceeded = Counter(
            "estimax_serving_deadline_exceeded",
            "Requests answered with the deadline error, by stage (queued: the model never ran "
            "for it; running: it ran, too late).",
            ["model_name", "stage"],
            registry=self.metrics.registry,
        )
        managers = [manager] if isinstance(manager, ModelManager) else list(manager)
        for m in managers:
            self.add(m)
        # The model Vertex AI's predict route answers for: the first configured.
        self.name = managers[0].name if managers else ""
        # Applies a ModelServerConfig message (gRPC HandleReloadConfigRequest); returns what
        # changed, raises ValueError for a config refused. None: not offered.
        self.reload_config: Callable[[Any], list[str]] | None = None
        # Model control (``estimax.serving.control.ModelControl``: the v2 repository
        # extension); None: its calls answer as --model_control_mode=none. Typed Any: the
        # control module sits above this one.
        self.control: Any = None

    # ---------------------------------------------------------------- the models
    def add(self, manager: ModelManager) -> ServedModel:
        """Serves ``manager``'s model (replacing one of that name), with its own batching queue.

        Called before the manager starts: its loads are measured and warmed up here.
        """
        return self.publish(self.prepare(manager))

    def publish(self, model: ServedModel) -> ServedModel:
        """Serves ``model`` (``prepare``'s), replacing the model of its name at once."""
        self.models = {**self.models, model.name: model}
        return model

    def prepare(
        self,
        manager: ModelManager,
        batching: BatchingOptions | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> ServedModel:
        """``manager``'s model, its loads measured and warmed, its queue made; not served yet.

        A model whose ``base_path`` changes loads its new versions this way while the old
        model serves on (``estimax.serving.registry``), then ``publish`` swaps them.
        ``batching``: the model's own batching options (a load's config override,
        ``estimax.serving.control``); None: the server's. ``overrides``: the settings a
        load's config override gives (``model_settings.parse``), over those of the model's
        ``config.json`` and the server's flags.

        Raises:
          ValueError: the model's ``config.json`` or its settings are not valid (one line).
        """
        settings = model_settings.resolve(
            manager.name,
            self.options,
            overrides or {},
            model_settings.read_file(manager.base_path),
        )
        manager.on_load = functools.partial(self._loaded, manager, settings)
        if self.options.enable_model_warmup:
            manager.warmup = functools.partial(
                warmup.replay, core=self, iterations=self.options.warmup_iterations
            )
        options = self.options
        aging_s = options.priority_aging_ms / 1000
        batcher = (
            Batcher(
                batching or options.batching,
                self._run_pool,
                slots=options.max_concurrent_per_model,
                aging_s=aging_s,
            )
            if options.enable_batching
            else None
        )
        gate = (
            admission.Gate(options.max_concurrent_per_model, aging_s)
            if options.max_concurrent_per_model and batcher is None
            else None
        )
        return ServedModel(manager, batcher, gate=gate, settings=settings)

    def _loaded(
        self,
        manager: ModelManager,
        settings: model_settings.ModelSettings,
        path: str,
        seconds: float,
        ok: bool,
    ) -> None:
        """A version's load ended: counted; one line if its model asks the cache of a version
        that declares random answers (which is never cached)."""
        self.metrics.loaded(path, seconds, ok)
        if not ok or not settings.response_cache:
            return
        for state in manager.states():
            if state.path == path and self.response_cache.random(state.servable):
                log.warning(
                    "Model %s: version %d declares random answers (serving.json): its answers "
                    "are never cached, though the model's config enables response_cache",
                    manager.name,
                    state.version,
                )

    def priority_levels(self, name: str) -> int:
        """Model ``name``'s priority levels (the server's for a model not served)."""
        model = self.models.get(name)
        return model.settings.priority_levels if model else self.options.priority_levels

    def cache_state(self, model: ServedModel, servable: Any) -> str:
        """Whether ``model``'s ``servable``'s answers are cached: ``"on"``, or ``"off: why"``."""
        if not model.settings.response_cache:
            return "off: not enabled for this model (response_cache, --response_cache_models)"
        if self.response_cache.max_bytes <= 0:
            return "off: --response_cache_bytes=0"
        if self.response_cache.random(servable):
            return "off: this version declares random answers (serving.json)"
        return "on"

    def remove(self, name: str) -> ServedModel | None:
        """Stops serving ``name`` (new requests answer 404); returns it, to be closed."""
        model = self.models.get(name)
        if model is not None:
            self.models = {n: m for n, m in self.models.items() if n != name}
            self.metrics.forget(name)
        return model

    def ready_all(self) -> bool:
        """The server's readiness (gRPC health ``""``, ``/v2/health/ready``): whether every
        model served (``--readiness=all``, TF Serving's) or at least one (``any``) has ended its
        first poll with a version available."""
        models = self.models.values()
        if self.options.readiness == "any":
            return any(m.manager.ready() for m in models)
        return all(m.manager.ready() for m in models)

    def _served(self, name: str, version: str) -> tuple[bool, bool]:
        model = self.models.get(name)
        if model is None:
            return False, False
        return True, bool(version) and model.manager.knows(version)

    def model(self, name: str, what: str) -> ServedModel:
        """The model named ``name``; 404 with ``what`` (TF Serving's message) if none."""
        model = self.models.get(name)
        if model is None:
            raise ApiError(404, what)
        return model

    # ---------------------------------------------------------------- tracking
    @contextlib.contextmanager
    def track(self, record: RequestRecord) -> Iterator[RequestRecord]:
        """Makes ``record`` the current request's for the block, then ``finish``es it.

        The caller sets its outcome (``record.fail``) before the block ends.
        """
        token = tracking.CURRENT.set(record)
        try:
            yield record
        finally:
            tracking.CURRENT.reset(token)
            # Its body is let go with the request (read_body charged it as it arrived).
            self.bodies_in_flight.give(record.body_bytes)
            if record.body_bytes >= TRIM_AFTER_BYTES:
                memory.give_back_soon()
            record.body_bytes = 0
            self.finish(record)

    def finish(self, record: RequestRecord) -> None:
        """Counts a finished request, writes its access-log line and logs why it failed."""
        record.end = time.perf_counter()
        self.metrics.request(record)
        if self.options.access_log:
            access_log.info(record.access_line(self.options.access_log_format == "json"))
        if record.status >= 400:
            # The route and the error may carry what a client wrote: one escaped, bounded line.
            where = tracking.printable(
                f"{record.method or record.transport.upper()} {record.route}"
            )
            # A server error (500) is the server's fault; the rest answer what was asked.
            level = logging.ERROR if record.status == 500 else logging.WARNING
            log.log(
                level,
                "%s -> %d %s: %s",
                where,
                record.status,
                record.code,
                tracking.printable(record.error) or "(no message)",
            )

    def label_version(self, model: ServedModel, label: str) -> int:
        """The version ``label`` names; 400 with TF Serving's message for an unknown label."""
        version = model.labels.get(label)
        if version is None:
            raise ApiError(400, f"Unrecognized servable version label: {cut(label)}")
        return version

    @contextlib.contextmanager
    def servable(
        self, name: str, version: str | int | None, label: str | None = None
    ) -> Iterator[Servable]:
        """Holds a version (or the one ``label`` names) for one request (it is not unloaded
        before the block ends).

        Raises:
          ApiError: 404 for an unknown model or version, 400 for a malformed version or an
            unknown label, 503 if versions keep being retired under the request.
        """
        record = _noted(name, version)
        req = f"Specific({name}, {version})" if version is not None else f"Latest({name})"
        model = self.model(name, f"Servable not found for request: {cut(req)}")
        number = (
            self.label_version(model, label) if label is not None else self.parse_version(version)
        )
        for _ in range(3):  # a version may be retired between get() and acquire()
            servable = model.manager.get(number)
            if servable is None:
                req = f"Specific({name}, {number})" if number is not None else f"Latest({name})"
                raise ApiError(404, f"Servable not found for request: {cut(req)}")
            if servable.acquire():
                record.version = str(servable.version if servable.version is not None else "")
                try:
                    yield servable
                finally:
                    servable.release()
                return
        raise ApiError(503, f"Model {name} is being reloaded; retry")

    @staticmethod
    def parse_version(version: str | int | None) -> int | None:
        """A request's version (None: the latest); 400 unless an integer of ASCII digits."""
        if version is None or isinstance(version, int):
            return version
        # Leading zeros are fine in a request ("01" asks for version 1).
        number = (
            version_number(version.lstrip("0") or "0") if version.isascii() and version else None
        )
        if number is None:
            raise ApiError(
                400,
                f"Invalid version {clip(version)}: versions are integers from 0 to "
                f"{MAX_VERSION} in ASCII digits",
            )
        return number

    def count(self, n: int) -> None:
        """Refuses more than ``max_instances`` instances in one request (400)."""
        record = tracking.current()
        record.instances = max(record.instances, n)
        if n > self.options.max_instances:
            raise ApiError(
                400,
                f"{n} instances in one request; this server accepts at most "
                f"{self.options.max_instances} (see --max_instances)",
            )

    def check_signature(self, signature: str) -> None:
        """400 for a signature name the export does not have."""
        if signature not in SIGNATURE_NAMES:
            raise ApiError(
                400, f'Serving signature name: "{cut(signature)}" not found in signature def'
            )

    def states(
        self, name: str, version: str | int | None = None, label: str | None = None
    ) -> list[VersionState]:
        """The versions of ``name`` (one if ``version`` or ``label``), newest first; 404 if none."""
        _noted(name, version)
        model = self.model(name, f"Could not find any versions of model {cut(name)}")
        if label is not None:
            version = self.label_version(model, label)
        states = model.manager.states()
        if version is not None:
            states = [s for s in states if str(s.version) == str(version)]
            if not states:
                raise ApiError(
                    404, f"Could not find version {cut(str(version))} of model {cut(name)}"
                )
        if not states:
            raise ApiError(404, f"Could not find any versions of model {cut(name)}")
        return states

    def ready(self, name: str, version: str | int | None) -> bool:
        """Whether the model (or that version) is available; 404 for an unknown one."""
        _noted(name, version)
        model = self.model(name, f"Model {cut(name)} is not served here")
        number = self.parse_version(version)
        if number is None:
            return model.manager.ready()
        ok = model.manager.available(number)
        if not ok and not model.manager.knows(str(number)):
            raise ApiError(404, f"Model {cut(name)} has no version {cut(str(version))}")
        return ok

    def available_versions(self, name: str) -> list[str]:
        """The available versions of model ``name``, newest first (none: an unknown model)."""
        model = self.models.get(name)
        if model is None:
            return []
        return [str(s.version) for s in model.manager.states() if s.state == "AVAILABLE"]

    def check_outputs(self, servable: Servable, wanted: list[str]) -> None:
        """400 naming the outputs the model does not have, or that are asked for twice.

        Each output is answered once: a request repeating one 200,000 times would otherwise
        make the server write it 200,000 times.
        """
        unknown = sorted(set(wanted) - set(servable.outputs))
        if unknown:
            raise ApiError(
                400,
                f"unknown outputs {echo_names(unknown)}; the model's outputs are "
                f"{sorted(servable.outputs)}",
            )
        refuse_repeated(wanted)

    def statistics(self, name: str | None, version: str | None) -> dict[str, Any]:
        """Triton's statistics extension: ``{"model_stats": [...]}`` per version.

        ``name`` None: every model; ``version`` None: every version seen.
        """
        if name is None:
            versions = [
                (m.name, str(s.version)) for m in self.models.values() for s in m.manager.states()
            ]
        else:
            versions = [(name, str(s.version)) for s in self.states(name, version)]
        return {"model_stats": self.metrics.statistics(versions)}

    def model_config(self, name: str, version: str | None) -> dict[str, Any]:
        """Triton's model configuration (``ModelConfig`` as JSON) of the model or one version."""
        model = self.model(name, f"Servable not found for request: Latest({cut(name)})")
        manager = model.manager
        with self.servable(name, version) as servable:
            config: dict[str, Any] = {
                "name": name,
                "platform": "estimax_jax_export",
                "backend": "estimax",
                "version_policy": manager.policy.json(),
                # Any request of up to --max_instances runs (in chunks of the largest
                # compiled size): that is the batch a client may send.
                "max_batch_size": self.options.max_instances,
                "input": [_config_tensor(n, s) for n, s in servable.inputs.items()],
                "output": [_config_tensor(n, s) for n, s in servable.outputs.items()],
                "parameters": {"global_step": {"string_value": str(servable.global_step)}},
            }
            # The model's effective settings (estimax.serving.model_settings). Triton's
            # config has them under dynamic_batching, given with batching only; the
            # parameters say them in any case, and why the cache is off.
            settings = model.settings
            config["response_cache"] = {"enable": self.cache_state(model, servable) == "on"}
            config["parameters"].update(
                {
                    "response_cache": {"string_value": self.cache_state(model, servable)},
                    "priority_levels": {"string_value": str(settings.priority_levels)},
                    "default_priority_level": {
                        "string_value": str(settings.default_priority_level)
                    },
                }
            )
        if self.options.enable_batching:
            batching = model.batcher.options if model.batcher else self.options.batching
            config["dynamic_batching"] = {
                "preferred_batch_size": list(manager.batch_sizes),
                "max_queue_delay_microseconds": batching.batch_timeout_micros,
                "priority_levels": settings.priority_levels,
                "default_priority_level": settings.default_priority_level,
            }
        return config

    async def infer(self, servable: Servable, columns: dict[str, Any]) -> dict[str, np.ndarray]:
        """Prepares (decodes images) in a thread, runs (batched or not); bounded in time.

        A request past its time stops its work too: its images stop decoding at the next one,
        and a run that has not started yet never starts. The request's record gets the time
        each step took (Triton's statistics).
        """
        cancelled = threading.Event()  # set: the threads working for the request stop
        started = threading.Event()  # set: the model started running for the request
        timeout_ms = self.options.rest_api_timeout_in_ms
        # <= 0: no deadline, as TF Serving (not a deadline already past).
        limit = timeout_ms / 1000 if timeout_ms > 0 else None
        # The request's own deadline (v2 parameters.timeout, a gRPC deadline), if earlier.
        ticket = admission.current()
        own = False
        if ticket.deadline is not None:
            left = ticket.deadline - time.monotonic()
            if limit is None or left < limit:
                limit, own = left, True
        record = tracking.current()
        try:
            if limit is not None and limit <= 0:  # past already: not even decoded
                raise TimeoutError
            return await asyncio.wait_for(
                self._prepare_and_run(servable, columns, record, cancelled, started), limit
            )
        except TimeoutError:
            cancelled.set()
            stage = "running" if started.is_set() else "queued"
            self.deadlines_exceeded.labels(record.model, stage).inc()
            if own:
                raise ApiError(
                    504,
                    f"{admission.DEADLINE_MESSAGE} ({ticket.source}"
                    + (", before the model ran)" if stage == "queued" else ")"),
                ) from None
            raise ApiError(
                504,
                "Request timed out after "
                f"{self.options.rest_api_timeout_in_ms} ms (--rest_api_timeout_in_ms)",
            ) from None
        except asyncio.CancelledError:  # the server stops, or the client went away
            cancelled.set()
            if ticket.deadline is not None and time.monotonic() >= ticket.deadline:
                # gRPC ended the call at the client's deadline before our timer fired.
                stage = "running" if started.is_set() else "queued"
                self.deadlines_exceeded.labels(record.model, stage).inc()
            raise

    async def _prepare_and_run(
        self,
        servable: Servable,
        columns: dict[str, Any],
        record: RequestRecord,
        cancelled: threading.Event,
        started: threading.Event | None = None,
    ) -> dict[str, np.ndarray]:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        started = started if started is not None else threading.Event()
        model = self.models.get(record.model)
        settings = model.settings if model is not None else model_settings.ModelSettings()
        level = admission.level_of(admission.current().priority, settings.default_priority_level)
        # A cached model's answer may come from memory, a capped model waits for its share
        # first: neither takes a run thread before it knows it runs.
        cached = self.response_cache.caches(settings.response_cache, servable)
        if (
            (model is None or (model.batcher is None and model.gate is None))
            and not cached
            and self._claim_run_thread()
        ):
            # Unbatched with a run thread free: decode and run there, one hand-off from the
            # event loop instead of two. Each is a thread's wake-up, milliseconds apiece on a
            # loaded machine (measured: 4.4-5.9 ms for the decoding's at load 12 on 2 cores,
            # where ONNX Runtime's HTTP wrapper decodes and runs on its request's own thread).
            try:
                return await self._on_run_thread(
                    functools.partial(
                        self._prepare_then_run, servable, columns, record, cancelled, start, started
                    )
                )
            except InvalidInput as e:
                raise ApiError(400, str(e)) from None
        try:
            features = await loop.run_in_executor(
                self._decode_pool,
                functools.partial(
                    _stoppable,
                    servable.prepare,
                    record,
                    columns,
                    self.options.max_image_pixels,
                    cancelled,
                ),
            )
        except InvalidInput as e:
            raise ApiError(400, str(e)) from None
        record.prepare_s = time.perf_counter() - start
        key = None
        if cached:
            key = response_cache.request_key(
                record.model, servable.version, servable.path, features
            )
            hit = self.response_cache.get(record.model, key)
            if hit is not None:
                return hit
        submitted = time.perf_counter()
        # The model is the one the request named (``servable`` noted it); one removed since
        # runs its last requests unbatched.
        model = self.models.get(record.model)
        batcher = model.batcher if model is not None else None
        run = functools.partial(self._execute, record.model, batcher is not None, servable)
        if batcher is not None:
            size = int(next(iter(features.values())).shape[0])

            def dequeued(wait: float) -> None:
                started.set()
                record.queue_s = wait
                self.metrics.dequeued(wait, size)

            try:
                outputs = await batcher.submit(
                    servable, run, features, on_start=dequeued, level=level
                )
            except QueueFullError as e:
                raise ApiError(429, str(e)) from None
        else:

            def direct() -> dict[str, np.ndarray]:
                record.queue_s = time.perf_counter() - submitted  # waiting for a run thread
                if cancelled.is_set():  # timed out while waiting: nobody reads the answer
                    return _stoppable(_never_run, record)
                started.set()
                return run(features)

            gate = model.gate if model is not None else None
            if gate is not None:  # cancelled while waiting: it leaves, holding nothing
                await gate.enter(level)
            with self._unbatched_lock:
                self._unbatched += 1
            outputs = await self._on_run_thread(direct, gate)
        record.run_end = time.perf_counter()
        record.run_s = record.run_end - submitted - record.queue_s
        if key is not None:
            self.response_cache.put(record.model, key, outputs)
        return outputs

    def _claim_run_thread(self) -> bool:
        """Counts an unbatched run in if a run thread is free for it (else claims nothing)."""
        with self._unbatched_lock:
            if self._unbatched >= self.options.batching.num_batch_threads:
                return False
            self._unbatched += 1
            return True

    async def _on_run_thread(
        self, work: Callable[[], dict[str, np.ndarray]], gate: admission.Gate | None = None
    ) -> dict:
        """``work()`` on a run thread, an unbatched run counted in (``_claim_run_thread``) until
        it ends, or is cancelled before it starts (its request timed out or went away); then
        ``gate`` (entered by the caller) is left, on the loop."""
        future = self._run_pool.submit(work)
        future.add_done_callback(lambda _: self._release_run_thread())
        if gate is not None:
            loop = asyncio.get_running_loop()
            future.add_done_callback(lambda _: loop.call_soon_threadsafe(gate.leave))
        return await asyncio.wrap_future(future)

    def _release_run_thread(self) -> None:
        with self._unbatched_lock:
            self._unbatched -= 1

    def _prepare_then_run(
        self,
        servable: Servable,
        columns: dict[str, Any],
        record: RequestRecord,
        cancelled: threading.Event,
        start: float,
        started: threading.Event,
    ) -> dict[str, np.ndarray]:
        """A request decoded and run on one run thread (``_prepare_and_run``), timed as the
        two steps are."""
        features = _stoppable(
            servable.prepare, record, columns, self.options.max_image_pixels, cancelled
        )
        record.prepare_s = time.perf_counter() - start
        submitted = time.perf_counter()
        if cancelled.is_set():  # timed out while decoding: nobody reads the answer
            return _stoppable(_never_run, record)
        started.set()
        outputs = self._execute(record.model, False, servable, features)
        record.run_end = time.perf_counter()
        record.run_s = record.run_end - submitted
        return outputs

    def _execute(
        self, name: str, batched: bool, servable: Servable, features: dict[str, np.ndarray]
    ) -> dict:
        """One run of model ``name`` (a request, or a batch of them), counted as one execution."""
        start = time.perf_counter()
        outputs = servable.run(features)
        n = int(next(iter(features.values())).shape[0])
        self.metrics.execution(
            name,
            servable.version,
            servable.executions(n),
            time.perf_counter() - start,
            batched=batched,
        )
        return outputs


def _stoppable(work: Any, record: RequestRecord, *args: Any) -> Any:
    """``work(*args)`` in a worker thread; when it stops for a timed-out request, says so."""
    try:
        return work(*args)
    except RequestCancelled as e:
        where = f"{record.method or record.transport.upper()} {record.route}"
        log.info("%s: %s", tracking.printable(where), e)
        raise


def _never_run() -> dict[str, np.ndarray]:
    raise RequestCancelled("not run: the request timed out while it waited for a run thread")


def _config_tensor(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One input/output of Triton's ``ModelConfig``: dims without the batch dimension."""
    dims = [-1 if d is None else int(d) for d in spec["shape"][1:]]
    d = dtype_of(spec["dtype"])
    tensor: dict[str, Any] = {
        "name": name,
        "data_type": "TYPE_STRING" if d.v2 == "BYTES" else f"TYPE_{d.v2}",
        "dims": dims or [1],
    }
    if not dims:  # Triton's way to say [batch] alone: dims [1] reshaped to []
        tensor["reshape"] = {"shape": []}
    return tensor


def _noted(name: str, version: str | int | None) -> RequestRecord:
    """The current request's record, with the model (and version) it asks for."""
    record = tracking.current()
    record.model = name
    if version is not None:
        record.version = str(version)
    return record
