"""What every estimax command line shares: its entry point, settings from the environment, checks.

* ``main(define_flags, run_from_flags, doc)`` is each console script (``resnet``,
  ``inception_v3``, ``inception_v4``, ``estimax-mnist``): it defines the program's flags, makes
  ``--help`` list them (also when started as a console script, whose ``__main__`` is not the
  program's module), fills flags from the environment, and turns a ``UsageError`` -- a user's
  mistake -- into one ``FATAL: ...`` line and exit status 2. Tracebacks are left to bugs.
* Settings from the environment: every flag ``--name`` can also be given as ``ESTIMAX_NAME``
  (upper case, e.g. ``ESTIMAX_MODEL_DIR=gs://bucket/run``); a flag on the command line wins. A
  job runner's ``TPU_MODEL_DIR`` fills ``--model_dir`` when neither gives it; ``TPU_NAME`` and
  ``TPU_GRPC_URL`` fill ``--tpu`` and ``--master``, which estimax does not need (JAX finds its
  devices), so they are only logged.
* ``check_location``: empty paths (an unset ``$MODEL_DIR``) are refused, paths directly under
  ``/`` (an unset ``${STORAGE_BUCKET}/inception``) are warned about before anything is written.
* ``check_model_dir``: the run's model-shaping flags are kept in ``model_dir/flags.json``; a later
  run that differs is stopped with the flag's name before any checkpoint is read.
* Many hosts (``define_cluster_flags``): ``--coordinator_address --num_processes --process_id``
  (or ``ESTIMAX_*``/``$JAX_COORDINATOR_ADDRESS``, a Vertex AI ``$CLUSTER_SPEC`` or a
  ``$TF_CONFIG``, or ``auto``) join JAX's multi-process runtime before anything touches the
  devices (``estimax.parallel.launch``: what was found is logged, and the processes check
  within ``--launch_timeout`` that they see the same job); then they compare their flags, data
  files and code (the pre-flight check) and any difference is one ``FATAL`` line on every
  process.
* A preemption notice (SIGTERM) ends training after a checkpoint at the current step: the
  program prints ``Preempted (SIGTERM): saved a checkpoint at step N ...`` and exits 0.
"""

from __future__ import annotations

import functools
import json
import os
import posixpath
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import fsspec
from absl import app, flags, logging

from estimax.programs import flagspec

ENV_PREFIX = "ESTIMAX_"
# Job runners' variables (the Paperspace Gradient README's $TPU_MODEL_DIR, $TPU_GRPC_URL, and the
# Cloud TPU tools' $TPU_NAME), as the flag each stands for.
JOB_RUNNER_ENV = {"TPU_MODEL_DIR": "model_dir", "TPU_NAME": "tpu", "TPU_GRPC_URL": "master"}
FLAGS_FILE = "flags.json"


class UsageError(ValueError):
    """A mistake in the command line or its setting: shown as one line, without a traceback."""


# Flags that differ between the processes of one job by design: not compared by the pre-flight.
PER_PROCESS_FLAGS = ("process_id",)


# The many-hosts flags (jax.distributed) and the hang watchdog's, which every program has.
CLUSTER_FLAGS = (
    flagspec.Str(
        "coordinator_address",
        None,
        "Many hosts: HOST:PORT of process 0's coordination service, the same on every process "
        "(JAX's jax.distributed); 'auto' also lets JAX detect the cluster (Cloud TPU VM pods, "
        "SLURM, Open MPI 4, Kubernetes). Default: $CLUSTER_SPEC (Vertex AI) or $TF_CONFIG (Cloud "
        "ML Engine) if set, else $JAX_COORDINATOR_ADDRESS if set, else one process.",
    ),
    flagspec.Float(
        "launch_timeout",
        300.0,
        "Many hosts: seconds for every process to reach the coordinator and agree on the job "
        "(kind, coordinator, process count, ids) before JAX joins them; a process that "
        "disagrees or never comes ends every process with one line.",
        lower=1.0,
    ),
    flagspec.Int(
        "num_processes",
        None,
        "Many hosts: how many processes the job has (one per host). Default: detected by JAX.",
        lower=1,
    ),
    flagspec.Int(
        "process_id",
        None,
        "Many hosts: this process's index, 0 .. num_processes - 1. Default: detected by JAX.",
        lower=0,
    ),
    flagspec.Float(
        "peer_timeout",
        60.0,
        "Many hosts: seconds without a heartbeat from another process (killed, hung, "
        "unreachable) after which every other process prints one line naming it and the last "
        "checkpoint step and exits with status 75 (EX_TEMPFAIL: restart the same command to "
        "resume from that checkpoint), within this many seconds plus 5; 0 leaves it to JAX "
        "(which aborts them after 100 s).",
        lower=0.0,
    ),
    flagspec.Float(
        "watchdog_timeout",
        1800.0,
        "Seconds without a completed training step after which the process logs the stacks of "
        "all its threads and its last step and exits with status 75 (so a job runner restarts "
        "it from the last checkpoint); 0 disables the watchdog.",
        lower=0.0,
    ),
    flagspec.Str(
        "profile_steps",
        None,
        "START,STOP: capture a jax.profiler trace of training steps START..STOP (with step "
        "markers) under --model_dir/plugins/profile/, where TensorBoard's profile plugin finds it.",
    ),
    flagspec.Int(
        "steps_per_device_call",
        1,
        "Training steps per device call: k > 1 runs k steps in one call on k stacked batches (a "
        "loop on the device, as TPUEstimator's iterations_per_loop did), for small models whose "
        "steps cost less than the host's dispatch; at most the steps per loop. 1: one call per "
        "step (XLA:CPU runs convolution gradients inside a device loop much slower).",
        lower=1,
    ),
    flagspec.Int(
        "gradient_accumulation_steps",
        1,
        "Split each replica's share of the train batch into this many micro-batches, run one "
        "after the other inside the step, and make one optimizer update with their mean "
        "gradient: the activation memory of a batch this many times smaller. The train batch "
        "size stays the optimizer's batch, and steps, schedules and checkpoints count optimizer "
        "steps; it must divide the per-replica train batch. Batch-norm statistics are per "
        "micro-batch. 1: no accumulation.",
        lower=1,
    ),
)


def define_cluster_flags(fv: flags.FlagValues) -> None:
    """Defines the many-hosts flags (``jax.distributed``) and the hang watchdog's on ``fv``."""
    flagspec.define(fv, CLUSTER_FLAGS)


def profile_steps(fv: flags.FlagValues) -> tuple[int, int] | None:
    """``RunConfig.profile_steps`` from ``--profile_steps`` (or resnet's
    ``--profile_every_n_steps=N``: one trace of step N); a bad value is a ``UsageError``."""
    from estimax.estimator.hooks import parse_profile_steps

    try:
        steps = parse_profile_steps(fv.profile_steps)
    except ValueError as e:
        raise UsageError(f"--profile_steps: {e}") from e
    every = fv["profile_every_n_steps"].value if "profile_every_n_steps" in fv else 0
    return steps if steps is not None or not every else (every, every)


def main(
    define_flags: Callable[[flags.FlagValues], None],
    run_from_flags: Callable[[flags.FlagValues], Any],
    doc: str | None,
    config: tuple[str, Mapping[str, Any]] | None = None,
) -> None:
    """Console-script entry point of a program.

    Args:
      define_flags: defines the program's flags on the ``FlagValues`` it is given.
      run_from_flags: runs the program from the parsed flags.
      doc: the program's module docstring (``--help`` shows it).
      config: ``(program name, its config keys)`` where the program takes the original's
        ``--config_file``/``--params_override`` (``estimax.programs.config_file``).
    """
    fv = flags.FLAGS
    before = set(fv)
    define_flags(fv)
    # absl's --help lists the key flags of the module named by sys.argv[0]: for a console script
    # that is the pip-made wrapper, which defines none, so the program's flags are declared here.
    program_flags = sorted(set(fv) - before)
    for name in program_flags:
        fv.register_key_flag_for_module(sys.argv[0], fv[name])
    main_module = sys.modules["__main__"]
    if not main_module.__doc__:
        main_module.__doc__ = doc
    app.run(
        functools.partial(_run, run_from_flags, fv, program_flags, config),
        flags_parser=functools.partial(_parse, fv),
    )


def _parse(fv: flags.FlagValues, argv: list[str]) -> list[str]:
    # absl's own parser prints the error and a second line of advice; one line is enough.
    try:
        return fv(argv)
    except flags.Error as e:
        _fatal(f"{e} (see --help).")
        raise  # unreachable: _fatal exits


def _run(
    run_from_flags: Callable[[flags.FlagValues], Any],
    fv: flags.FlagValues,
    program_flags: list[str],
    config: tuple[str, Mapping[str, Any]] | None,
    argv: list[str],
) -> None:
    from estimax import storage
    from estimax.data import bigtable, loader, tfrecord
    from estimax.estimator.estimator import Preempted
    from estimax.estimator.label_check import InvalidLabelError
    from estimax.estimator.loop import Interrupted
    from estimax.migrate.tf_checkpoint import TFCheckpointError
    from estimax.parallel import preflight, replication
    from estimax.state import checkpoints, lock

    try:
        if len(argv) > 1:
            raise UsageError(
                f"unexpected arguments {argv[1:]}: every setting is a --flag (see --help)."
            )
        env_used = apply_environment(fv, os.environ)
        if config is not None:
            _apply_config(fv, program_flags, config, env_used)
        _keep_cuda_out(fv)
        join_processes(fv, program_flags)
        results = run_from_flags(fv)
        if "mode" in fv and fv.mode == "eval" and results is None:
            raise UsageError(
                f"no checkpoint appeared in --model_dir={fv.model_dir} within "
                f"--eval_timeout={fv.eval_timeout} s: is it the training job's "
                "--model_dir?"
            )
    except (UsageError, app.UsageError, lock.LockError) as e:
        _fatal(str(e))
    except bigtable.BigtableError as e:
        # A table that cannot be read is a setup problem: its message, without a traceback.
        _fatal(f"Cloud Bigtable input: {e}")
    except (loader.SourceError, tfrecord.ShardChangedError) as e:
        # The input cannot go on (a worker process died, a shard changed while read): it says
        # why and what to do; its traceback is not the user's to read.
        _fatal(f"input: {e}")
    except storage.StorageError as e:
        # The clients' retries ran out; the message names the path (no traceback: not a bug).
        _fatal(str(e))
    except (preflight.PreflightError, checkpoints.ModelMismatchError) as e:
        _fatal(str(e))
    except replication.BatchSplitError as e:
        # A batch size, or a checkpoint resumed on a host/device count that does not divide it.
        import jax

        _fatal(
            f"{e} This job: {jax.process_count()} process(es), {jax.device_count()} device(s); "
            "a run resumes on any number of hosts and devices that divides its global batch."
        )
    except (InvalidLabelError, TFCheckpointError) as e:
        # TFCheckpointError: --warm_start_from names no readable checkpoint, or one whose
        # variables do not map (the message names the path or the variables).
        _fatal(str(e))
    except Preempted as e:
        # The job runner's preemption notice: saved, and a clean exit (status 0).
        print(str(e), flush=True)
        sys.exit(0)
    except Interrupted as e:
        # Ctrl-C: saved; the shell's status for an interrupted command.
        print(str(e), flush=True)
        sys.exit(130)
    sys.stdout.flush()


def _apply_config(
    fv: flags.FlagValues,
    program_flags: list[str],
    config: tuple[str, Mapping[str, Any]],
    env_used: Mapping[str, str],
) -> None:
    """The original's ``--config_file``/``--params_override`` under the flags given (and the
    environment); ``--print_config`` prints the result and exits 0 before any device is used."""
    from estimax.programs import config_file

    program, keys = config
    effective = config_file.apply(fv, program, keys, env_used, program_flags)
    if fv.print_config:
        print(config_file.format_effective(effective), flush=True)
        sys.exit(0)


def _keep_cuda_out(fv: flags.FlagValues) -> None:
    """``--compile_for`` naming a GPU runs nothing: JAX is kept from starting CUDA before
    anything looks for devices (``gpu_compile.keep_cuda_out``: without a GPU, JAX's CUDA
    plugin would fail its version check and take XLA's GPU compiler with it)."""
    value = fv["compile_for"].value if "compile_for" in fv else None
    if value:
        from estimax.compile import gpu_compile

        if gpu_compile.is_gpu_target(value):
            try:
                gpu_compile.keep_cuda_out(value)
            except gpu_compile.GpuTargetError as e:
                raise UsageError(f"--compile_for={value}: {e}") from None


def join_processes(fv: flags.FlagValues, program_flags: list[str]) -> None:
    """Joins a multi-process job if the flags (or environment) ask for one; pre-flight check.

    Runs before the program touches JAX's devices. With many processes every process then
    compares its program flags, the files under ``--data_dir`` (names and sizes) and the code.

    Raises:
      UsageError: bad cluster flags (the message says which).
      PreflightError: the processes differ.
    """
    from estimax.parallel import distributed, launch, preflight

    if "coordinator_address" not in fv:
        return
    try:
        many = distributed.initialize(
            fv.coordinator_address,
            fv.num_processes,
            fv.process_id,
            timeout=fv.launch_timeout,
            peer_timeout=fv.peer_timeout if "peer_timeout" in fv else 60.0,
        )
    except launch.LaunchError as e:
        raise UsageError(f"could not join the multi-process job: {e}") from None
    except ValueError as e:
        raise UsageError(
            f"could not join the multi-process job: {e} Give --coordinator_address=HOST:PORT "
            "--num_processes=N --process_id=I (or 'auto' where JAX detects the cluster)."
        ) from None
    if not many:
        return
    model_dir = fv["model_dir"].value if "model_dir" in fv else None
    if model_dir:
        from estimax.state import checkpoints

        distributed.watch_peers(None, checkpoint_dir=checkpoints.checkpoint_dir(model_dir))
    compared = {
        name: fv[name].value
        for name in program_flags
        if name not in PER_PROCESS_FLAGS and name in fv
    }
    facts: dict[str, Any] = {"flags": compared}
    data_dir = fv["data_dir"].value if "data_dir" in fv else None
    if data_dir:
        facts["data_files"] = _file_sizes(data_dir)
    preflight.check(facts)


def _file_sizes(data_dir: str) -> dict[str, Any]:
    """``{file name: size}`` of the files directly in ``data_dir`` (empty if unreadable)."""
    try:
        fs, path = fsspec.core.url_to_fs(data_dir)
        entries = fs.ls(path, detail=True)
    except (OSError, ValueError):
        return {}
    return {
        posixpath.basename(e["name"].rstrip("/")): e.get("size")
        for e in entries
        if e.get("type") == "file"
    }


def _fatal(message: str) -> None:
    sys.stdout.flush()
    print(f"FATAL: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def apply_environment(fv: flags.FlagValues, environ: Mapping[str, str]) -> dict[str, str]:
    """Fills flags not given on the command line from ``ESTIMAX_<NAME>`` and the job runner's.

    Args:
      fv: parsed flags; a flag given on the command line is left as it is.
      environ: the environment (``os.environ``).

    Returns:
      ``{flag name: variable}`` for every flag the environment set.

    Raises:
      UsageError: a variable's value is not valid for its flag (the message names both).
    """
    used: dict[str, str] = {}
    for name in list(fv):
        var = ENV_PREFIX + name.upper()
        if var in environ and not fv[name].present:
            _set_from_env(fv, name, var, environ[var])
            used[name] = var
    for var, name in JOB_RUNNER_ENV.items():
        if var in environ and name in fv and not fv[name].present and name not in used:
            _set_from_env(fv, name, var, environ[var])
            used[name] = var
    for name in ("tpu", "master"):
        if used.get(name) in JOB_RUNNER_ENV:
            logging.info(
                "$%s=%s (the Cloud TPU the job runner gave this job): not needed; "
                "estimax runs on the JAX devices it finds.",
                used[name],
                fv[name].value,
            )
    if used:
        logging.info(
            "From the environment: %s", ", ".join(f"--{n}=${v}" for n, v in sorted(used.items()))
        )
    return used


def _set_from_env(fv: flags.FlagValues, name: str, var: str, value: str) -> None:
    try:
        fv.set_default(name, value)
    except (flags.IllegalFlagValueError, ValueError) as e:
        raise UsageError(f"${var}={value!r} is not a valid --{name}: {e}") from None


def check_location(name: str, value: str | None, *, required: bool = False) -> str | None:
    """Checks a location flag (``--model_dir``, ``--data_dir``, ``--export_dir``) before use.

    Args:
      name: the flag's name.
      value: its value (a local path, ``gs://...`` or ``s3://...``).
      required: refuse None too.

    Returns:
      ``value``.

    Raises:
      UsageError: the value is empty (a variable in the command line was unset), names no
        bucket (``gs:///x``), or is missing though required.
    """
    hint = (
        f"an environment variable in the command line (such as $MODEL_DIR, $DATA_DIR or "
        f"$STORAGE_BUCKET) or ${ENV_PREFIX}{name.upper()} is probably unset"
    )
    if value is None:
        if required:
            raise UsageError(
                f"--{name} is required (a local path, gs:// or s3://); it can "
                f"also come from ${ENV_PREFIX}{name.upper()}."
            )
        return None
    if not value.strip():
        raise UsageError(f"--{name} is empty: {hint}. Set it to a local path, gs:// or s3://.")
    protocol, sep, rest = value.partition("://")
    if sep and (not rest or rest.startswith("/")):
        raise UsageError(f"--{name}={value} names no bucket: {hint}.")
    if not sep and os.path.isabs(value) and os.path.dirname(value.rstrip("/")) == "/":
        logging.warning(
            "*** --%s=%s is directly under the filesystem root: %s (an unset "
            "${STORAGE_BUCKET} turns ${STORAGE_BUCKET}/inception into /inception). "
            "Continuing with %s. ***",
            name,
            value,
            hint,
            value,
        )
    return value


def check_given(fv: flags.FlagValues, names: tuple[str, ...]) -> None:
    """Refuses a flag of ``names`` given as '' (``--bigtable_instance=$INSTANCE``, unset)."""
    for name in names:
        if fv[name].present and not (fv[name].value or "").strip():
            raise UsageError(
                f"--{name} is empty: an environment variable in the command line "
                f"is probably unset. Give --{name} a value or leave the flag out."
            )


def check_model_dir(
    model_dir: str, program: str, model_flags: Mapping[str, Any], *, write: bool
) -> None:
    """Compares the flags that shape the model with those of the run that wrote ``model_dir``.

    ``model_dir/flags.json`` holds the program and the model-shaping flags of the last training
    run (``write=True`` records them). A checkpoint of another shape cannot be resumed or
    evaluated; this says which flag differs before any checkpoint is read.

    Args:
      model_dir: the run's ``--model_dir``.
      program: the program's name (``resnet``, ``inception_v3``...).
      model_flags: ``{flag name: value}`` of the flags that decide the checkpoint's shape.
      write: record them (a training run).

    Raises:
      UsageError: ``model_dir`` was written by another program or with other values.
    """
    path = posixpath.join(model_dir, FLAGS_FILE)
    fs, fs_path = fsspec.core.url_to_fs(path)
    try:
        with fs.open(fs_path, "r") as f:
            before = json.load(f)
    except FileNotFoundError:
        before = None
    except ValueError as e:  # not JSON (edited by hand?): nothing to compare with
        logging.warning(
            "%s is not readable JSON (%s); the model's flags are not compared.", path, e
        )
        before = None
    if before is not None:
        if before.get("program", program) != program:
            raise UsageError(
                f"--model_dir={model_dir} holds a {before['program']} model (see "
                f"{path}), not {program}: use another --model_dir."
            )
        for name, value in model_flags.items():
            old = before.get("flags", {}).get(name, value)
            if old != value:
                raise UsageError(
                    f"--{name}={value}, but the checkpoints in --model_dir={model_dir} were "
                    f"written with --{name}={old} (see {path}): use another --model_dir to "
                    f"train a new model, or --{name}={old} to continue this one."
                )
    if write:
        fs.makedirs(posixpath.dirname(fs_path), exist_ok=True)
        record = {"program": program, "flags": dict(model_flags), "written": time.time()}
        # Written aside and moved into place, so an eval job reading it never sees half of it.
        tmp = f"{fs_path}.tmp-{os.getpid()}"
        fs.pipe_file(tmp, json.dumps(record, indent=1).encode())
        fs.mv(tmp, fs_path)
