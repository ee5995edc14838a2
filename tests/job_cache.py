"""A CPU test job's processes share one persistent-cache entry per program (process 0's).

JAX's persistent compilation cache keys an entry by the program, the compile options and the
fingerprint of the devices' topology. On CPU that topology is the process's own devices, so in
a job of N CPU processes each process computes another key for the same program, and JAX writes
only process 0's entries ("Not writing persistent cache entry since process_id != 0"): the
other N-1 compile every program again on every run, however warm the cache. Measured here
(2-core AVX2 EPYC, warm cache, the 8-process MNIST job of the pod tests): 41 CPU-s per job,
5.1 a process, a sixth of it in XLA's CPU compiler; with this module, 22 CPU-s.

``share_compiled_programs()`` keys a CPU program by its device assignment instead (platform,
kind, id and process of each device: what every process of the job agrees on), so process 0's
entry is every process's. A CPU executable holds no per-process state (the collectives go
through the client), so another process loads process 0's as its own (JAX's
``jax_share_binary_between_hosts`` also assumes one key per program across processes). Only
test jobs do this: each process of a job calls it as ``tests/multihost_worker.py`` starts,
forked from the zygote or not; the programs under test are unchanged, and other platforms keep
JAX's key.
"""

from __future__ import annotations

from typing import Any

_PATCHED = "_estimax_tests_shared"


def share_compiled_programs() -> None:
    """Keys CPU programs by their device assignment (idempotent; a JAX without the hook this
    replaces fails here, loudly, rather than compile silently in every process)."""
    from jax._src import cache_key  # noqa: PLC0415 (private: JAX offers no setting for this)

    topology_hash = cache_key._hash_accelerator_config  # noqa: SLF001
    if getattr(topology_hash, _PATCHED, False):
        return

    def by_assignment(hash_obj: Any, devices: Any) -> None:
        flat = list(devices.flat)
        if any(d.platform != "cpu" for d in flat):
            topology_hash(hash_obj, devices)
            return
        for d in flat:
            hash_obj.update(f"{d.platform}:{d.device_kind}:{d.id}:{d.process_index};".encode())

    setattr(by_assignment, _PATCHED, True)
    cache_key._hash_accelerator_config = by_assignment  # noqa: SLF001
