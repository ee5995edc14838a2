"""estimax.ops on a CPU without bf16 convolutions, on every machine.

oneDNN caps its instruction set at ``ONEDNN_MAX_CPU_ISA``, read once when the library starts,
so these checks run in a fresh process with ``ONEDNN_MAX_CPU_ISA=AVX2``: there oneDNN behaves
as on an AMD Zen 2 (AVX2 + FMA, no AVX-512, no bf16), whatever this machine is. What they
show: bf16 convolutions are probed before they are chosen and run as oneDNN's fp32 kernels on
upcast values (same values as the reference), fp32 stays native, the status line says so,
and a kernel forced onto an unsupported primitive fails with a message naming the
convolution, the instruction set and the way out, instead of an opaque crash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from estimax.ops import native

_CHILD = textwrap.dedent("""
    import functools, json
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    from estimax import ops
    from estimax.ops import native

    NHWC = ("NHWC", "HWIO", "NHWC")
    out = {"isa": native.isa(), "support": native.dtype_support(), "status": native.status()}
    case = ((2, 9, 9, 5), (3, 3, 5, 4), (2, 2), "SAME")
    out["bf16"] = ops.conv_strategies(*case, jnp.bfloat16)
    out["fp32"] = ops.conv_strategies(*case, jnp.float32)

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(case[0]), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(case[1]), jnp.bfloat16)
    ref = lambda x, w: lax.conv_general_dilated(x, w, case[2], case[3], dimension_numbers=NHWC)
    mine = lambda x, w: ops.conv_general_dilated(x, w, case[2], case[3], dimension_numbers=NHWC)
    def vg(f, x, w):
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(jnp.ones_like(y)))
    f32 = lambda a: a.astype(jnp.float32)
    want = vg(ref, f32(x), f32(w))
    fn = jax.jit(functools.partial(vg, mine))
    out["lowered_to_onednn"] = "estimax_onednn_conv" in fn.lower(x, w).as_text()
    got = fn(x, w)
    out["dtypes"] = [str(a.dtype) for a in got]
    out["rel_err"] = [
        float(np.abs(np.float32(a) - np.float32(b)).max() / np.abs(np.float32(b)).max())
        for a, b in zip(got, want, strict=True)
    ]

    forced = jax.jit(functools.partial(ops.conv_with_strategy, window_strides=case[2],
                                       padding=case[3], fwd="onednn", dx="xla", dw="xla"))
    try:
        forced(x, w).block_until_ready()
        out["forced_error"] = None
    except Exception as e:  # the error a user would see, whatever JAX wraps it in
        out["forced_error"] = str(e)
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def avx2_run():
    if not native.available():
        if os.environ.get("ESTIMAX_REQUIRE_ONEDNN") == "1":
            pytest.fail(f"ESTIMAX_REQUIRE_ONEDNN=1 but {native.status()}")
        pytest.skip(f"oneDNN kernels not built: {native.status()}")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", DNNL_MAX_CPU_ISA="AVX2")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_avx2_cpu_has_fp32_but_no_bf16_convolutions(avx2_run):
    assert avx2_run["isa"] == "avx2"
    assert avx2_run["support"] == {"float32": True, "bfloat16": False}


def test_bf16_runs_on_fp32_kernels_and_fp32_natively(avx2_run):
    assert avx2_run["bf16"] == ["onednn_f32"] * 3
    assert avx2_run["fp32"] == ["onednn"] * 3
    assert avx2_run["lowered_to_onednn"]


def test_bf16_values_and_grads_match_the_reference(avx2_run):
    # bf16 results keep bf16 dtype; error within one bf16 rounding of the fp32 reference.
    assert avx2_run["dtypes"] == ["bfloat16"] * 3
    assert max(avx2_run["rel_err"]) <= 2e-2, avx2_run["rel_err"]


def test_status_line_names_cpu_isa_and_what_bf16_runs_on(avx2_run):
    status = avx2_run["status"]
    assert native.cpu_model() in status and "(avx2 kernels)" in status, status
    assert "fp32 oneDNN" in status and "bf16 oneDNN fp32 kernels on upcast values" in status


def test_a_forced_unsupported_primitive_names_convolution_isa_and_the_way_out(avx2_run):
    message = avx2_run["forced_error"]
    assert message is not None, "bf16 oneDNN convolution unexpectedly ran on AVX2"
    for part in (
        "estimax oneDNN convolution failed",
        "forward bf16 convolution",
        "input [2,9,9,5] (NHWC)",
        "filter [3,3,5,4] (HWIO)",
        "stride 2x2",
        "oneDNN avx2 kernels",
        "ESTIMAX_ONEDNN=0",
        "--nocpu_fast_ops",
    ):
        assert part in message, (part, message)


def test_probe_explains_what_it_cannot_run():
    if not native.available():
        pytest.skip(f"oneDNN kernels not built: {native.status()}")
    dims = (2, 5, 9, 9, 4, 3, 3, 5, 5, 2, 2, 1, 1, 1, 1)
    assert native.probe("forward", "float32", dims) is None
    assert "float32 or bfloat16" in native.probe("forward", "float16", dims)
    with pytest.raises(ValueError, match="kind='sideways'"):
        native.probe("sideways", "float32", dims)
