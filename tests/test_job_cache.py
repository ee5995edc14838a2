"""tests/job_cache.py: every process of a CPU test job reads process 0's compiled programs."""

from __future__ import annotations

import os
import re

import multihost_helpers as mh
import zygote

# One process of a 2-process CPU job: a program over both processes' devices (a sum across
# them), keyed as the test jobs key theirs.
SCRIPT = """\
import sys
import job_cache
job_cache.share_compiled_programs()
job_cache.share_compiled_programs()  # a second call changes nothing
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
mesh = jax.make_mesh((2,), ("x",))
local = np.full((1, 3), jax.process_index() + 1.0, np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
def total(v):
    return jnp.sum(v, axis=0)
out = jax.jit(total, out_shardings=NamedSharding(mesh, P()))(x)
print(np.asarray(out.addressable_data(0)).tolist(), flush=True)
"""


def _run(tmp_path, run: int) -> list[str]:
    """One 2-process job; each process's compiler log."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = mh._job_env(str(tmp_path / "data"), 1)  # noqa: SLF001 (the jobs' environment)
    env.update(
        PYTHONPATH=os.pathsep.join((os.path.dirname(os.path.abspath(__file__)), mh.ROOT)),
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
        JAX_DEBUG_LOG_MODULES="jax._src.compiler",
    )
    port = str(mh._free_port())  # noqa: SLF001
    specs = [
        zygote.Spec(
            (str(script), f"localhost:{port}", str(i)),
            env,
            str(tmp_path / f"{run}.{i}.out"),
            str(tmp_path / f"{run}.{i}.err"),
        )
        for i in range(2)
    ]
    procs = zygote.start(env, specs)
    logs = []
    for p in procs:
        code = p.wait(300)
        out, err = p.communicate()
        assert code == 0, err[-3000:]
        # 1 + 2: the program ran over both processes (after Gloo's line on connecting).
        assert out.splitlines()[-1] == "[3.0, 3.0, 3.0]"
        logs.append(err)
    return logs


def _keys(log: str, verdict: str) -> set[str]:
    return set(re.findall(rf"{verdict} for 'jit_total' with key '([^']+)'", log))


def test_the_second_run_of_a_job_reads_process_0s_program_in_every_process(tmp_path):
    first = _run(tmp_path, 1)
    # One key for the program in both processes; process 0 writes its entry, process 1 not.
    missed = [_keys(log, "PERSISTENT COMPILATION CACHE MISS") for log in first]
    assert len(missed[0]) == 1 and missed[0] == missed[1]
    assert "Not writing persistent cache entry since process_id != 0" in first[1]
    # The next run: both processes load that one entry, neither compiles the program.
    second = _run(tmp_path, 2)
    for log in second:
        assert _keys(log, "Persistent compilation cache hit") == missed[0]
        assert not _keys(log, "PERSISTENT COMPILATION CACHE MISS")
