"""estimax's oneDNN kernels build from the package index alone, as any user.

What this proves, and what it does not: the build runs in a clean environment (``env -i``:
no ``CPATH``, ``LIBRARY_PATH``, ``LD_LIBRARY_PATH``, no ``PYTHONPATH`` but the repository, a
fresh ``HOME``), as an unprivileged user (``setpriv`` to ``nobody`` when the suite runs as
root and nobody can read the checkout, else the suite's own user), with oneDNN found only
under the venv's prefix where ``pip install 'estimax[onednn]'`` put it. The compiler sees
``/usr/include`` as always (a system without root cannot hide it); that no system oneDNN
served the build is shown by the result: the library reports oneDNN 3 (Debian's
``libdnnl-dev`` is 2.6, and the source refuses oneDNN < 3 at compile time) and the process
maps ``libdnnl.so.3`` from the venv's ``lib/``. Where this was written, Debian's
``libdnnl-dev`` 2.6 was installed (``/usr/include/dnnl.hpp`` present) and the test passed:
the build ignores it. The wheels themselves come from the index in ``make`` (the ``onednn``
extra); this test does not download them again.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from estimax.ops import native

REPO = Path(__file__).resolve().parents[1]

_BUILD = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from estimax.ops import native
    onednn = native.find_onednn()
    out = Path(sys.argv[1]) / "libestimax_onednn_test.so"
    native.build(output=out, verbose=True)
    print("RESULT " + json.dumps({"uid": os.getuid(), "prefix": str(onednn.prefix),
                                  "version": onednn.version, "library": str(out)}))
""")

_RUN = textwrap.dedent("""
    import json, os
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    from estimax import ops
    from estimax.ops import native
    NHWC = ("NHWC", "HWIO", "NHWC")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 8, 3)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((3, 3, 3, 4)), jnp.float32)
    f = jax.jit(lambda x, w: ops.conv_with_strategy(x, w, (1, 1), "SAME", fwd="onednn",
                                                     dx="onednn", dw="onednn"))
    want = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC)
    err = float(jnp.abs(f(x, w) - want).max())
    maps = [ln.split()[-1] for ln in open("/proc/self/maps") if "libdnnl" in ln]
    print("RESULT " + json.dumps({"uid": os.getuid(), "version": native.onednn_version(),
                                  "status": native.status(), "err": err,
                                  "libdnnl": sorted(set(maps))}))
""")


@functools.cache
def _as_unprivileged() -> tuple[str, ...]:
    """The command prefix that drops root (nobody:nogroup), or () if we are not root.

    Also () where nobody cannot read this checkout or the venv (a clone under /root): the
    build then runs as root, in the same clean environment.
    """
    if os.getuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return ()
    prefix = (setpriv, "--reuid=65534", "--regid=65534", "--clear-groups")
    readable = subprocess.run(
        ["env", "-i", f"PYTHONPATH={REPO}", *prefix, sys.executable, "-c", "import estimax.ops"],
        capture_output=True,
        timeout=120,
        check=False,
        cwd="/",
    )
    return prefix if readable.returncode == 0 else ()


def _clean_run(code: str, workdir: str, extra_env: dict[str, str] | None = None) -> dict:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "PYTHONPATH": str(REPO),
        "XDG_CACHE_HOME": workdir,
        **(extra_env or {}),
    }
    proc = subprocess.run(
        ["env", "-i", *(f"{k}={v}" for k, v in env.items()), *_as_unprivileged()]
        + [sys.executable, "-c", code, workdir],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=workdir,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    result["stderr"] = proc.stderr
    return result


@pytest.fixture(scope="module")
def onednn() -> native.OneDnn:
    try:
        found = native.find_onednn()
    except RuntimeError as e:
        if os.environ.get("ESTIMAX_REQUIRE_ONEDNN") == "1":
            pytest.fail(f"ESTIMAX_REQUIRE_ONEDNN=1 but {e}")
        pytest.skip(str(e))
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler")
    return found


def test_build_from_the_index_in_a_clean_environment_as_an_unprivileged_user(onednn):
    workdir = tempfile.mkdtemp(prefix="estimax-native-")
    try:
        os.chmod(workdir, 0o777)  # the unprivileged user writes the library here
        built = _clean_run(_BUILD, workdir)
        if _as_unprivileged():
            assert built["uid"] == 65534
        assert built["prefix"] == str(onednn.prefix)
        assert int(built["version"].split(".")[0]) >= 3
        # The compiler was pointed at the venv's headers and library file, never -ldnnl.
        command = next(ln for ln in built["stderr"].splitlines() if "onednn_conv.cc" in ln)
        assert f"-I{onednn.prefix}/include" in command and "-ldnnl" not in command
        ran = _clean_run(_RUN, workdir, {"ESTIMAX_ONEDNN_LIB": built["library"]})
        assert ran["version"].startswith("3."), ran
        assert ran["status"].startswith(f"oneDNN {ran['version']} on "), ran["status"]
        assert ran["libdnnl"] == [str(onednn.library.resolve())] or ran["libdnnl"] == [
            str(onednn.library)
        ], ran["libdnnl"]
        assert ran["err"] < 1e-4
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_makefile_installs_nothing_from_the_system():
    makefile = (REPO / "Makefile").read_text()
    assert "apt-get" not in makefile and "sudo" not in makefile
    assert "'.[onednn]'" in makefile  # oneDNN comes from the index, as the extra


def test_the_onednn_extra_pins_what_the_build_asks_for():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pins = [r.split(";")[0].strip() for r in extras["onednn"]]
    assert pins == list(native.ONEDNN_REQUIREMENTS)
