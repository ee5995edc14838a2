"""Per-layer convolution and max-pool timings on the CPU: XLA vs estimax.ops vs PyTorch.

For every distinct convolution of ResNet-50 (224x224, batch 16) and the seeds'
MNIST CNN (batch 128), times the forward pass, the input gradient (dx) and the
filter gradient (dw):

* ``jax``       -- ``lax.conv_general_dilated`` and its ``jax.vjp`` under ``jit``;
* ``ops:*``     -- the matmul formulations of ``estimax.ops.cpu_conv``;
* ``onednn *``  -- estimax's oneDNN kernels through XLA's FFI (``estimax.ops.native``,
                   built by ``make native``), NaN when the library is not built; with
                   ``--dtype bfloat16`` also ``onednn_f32 *``: oneDNN's fp32 kernels on
                   values cast up (what estimax runs where a CPU has no bf16 kernels);
* ``torch``     -- ``torch.ops.aten.convolution[_backward]`` (oneDNN, channels_last),
                   run by ``bench/.venv-torch/bin/python`` in a subprocess so PyTorch
                   never enters estimax's environment.

``--ynn both`` (the default) times the XLA columns (``jax *`` and ``ops *``) twice, in two
worker processes: with XLA:CPU's YNNPACK fusions as jaxlib 0.10.2 has them by default, and
with them off (``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=``, read once, before JAX
starts: hence the processes). The ``ynn`` section compares the two for the fallback path.

Usage (from the repo root)::

    .venv/bin/python bench/conv_cpu.py [--dtype float32|bfloat16] [--reps 5]
        [--only mnist|resnet50] [--ynn both|on|off] [--out FILE.json]

Writes this CPU's and dtype's section of ``bench/results/conv_cpu.{json,md}`` (one file for
every CPU kind, ``bench/result_sections.py``), or ``--out`` and a Markdown table beside it.
Times are medians (ms) of ``--reps`` calls after one warm-up; the machine may be shared, so
compare columns within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from result_sections import cpu_kind, slug, write_section

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_PY = os.path.join(HERE, ".venv-torch", "bin", "python")

# (name, model, count in the model, batch, H, W, Cin, Cout, KH, KW, stride, padding)
# ResNet-50 v1.5 as in flax/examples/imagenet: stride on the 3x3 of the first block of
# a stage, 1x1 projection with the same stride. "count" = times the layer appears,
# so count-weighted sums give the whole network's convolution time.
LAYERS: list[tuple[Any, ...]] = [
    ("mnist.conv1 5x5 1->32", "mnist", 1, 128, 28, 28, 1, 32, 5, 5, 1, "SAME"),
    ("mnist.conv2 5x5 32->64", "mnist", 1, 128, 14, 14, 32, 64, 5, 5, 1, "SAME"),
    ("r50.stem 7x7/2 3->64", "resnet50", 1, 16, 224, 224, 3, 64, 7, 7, 2, "SAME"),
    ("r50.s1 1x1 64->64", "resnet50", 1, 16, 56, 56, 64, 64, 1, 1, 1, "SAME"),
    ("r50.s1 1x1 256->64", "resnet50", 2, 16, 56, 56, 256, 64, 1, 1, 1, "SAME"),
    ("r50.s1 3x3 64->64", "resnet50", 3, 16, 56, 56, 64, 64, 3, 3, 1, "SAME"),
    ("r50.s1 1x1 64->256 (+proj)", "resnet50", 4, 16, 56, 56, 64, 256, 1, 1, 1, "SAME"),
    ("r50.s2 1x1 256->128", "resnet50", 1, 16, 56, 56, 256, 128, 1, 1, 1, "SAME"),
    ("r50.s2 3x3/2 128->128", "resnet50", 1, 16, 56, 56, 128, 128, 3, 3, 2, "SAME"),
    ("r50.s2 proj 1x1/2 256->512", "resnet50", 1, 16, 56, 56, 256, 512, 1, 1, 2, "SAME"),
    ("r50.s2 1x1 512->128", "resnet50", 3, 16, 28, 28, 512, 128, 1, 1, 1, "SAME"),
    ("r50.s2 3x3 128->128", "resnet50", 3, 16, 28, 28, 128, 128, 3, 3, 1, "SAME"),
    ("r50.s2 1x1 128->512", "resnet50", 4, 16, 28, 28, 128, 512, 1, 1, 1, "SAME"),
    ("r50.s3 1x1 512->256", "resnet50", 1, 16, 28, 28, 512, 256, 1, 1, 1, "SAME"),
    ("r50.s3 3x3/2 256->256", "resnet50", 1, 16, 28, 28, 256, 256, 3, 3, 2, "SAME"),
    ("r50.s3 proj 1x1/2 512->1024", "resnet50", 1, 16, 28, 28, 512, 1024, 1, 1, 2, "SAME"),
    ("r50.s3 1x1 1024->256", "resnet50", 5, 16, 14, 14, 1024, 256, 1, 1, 1, "SAME"),
    ("r50.s3 3x3 256->256", "resnet50", 5, 16, 14, 14, 256, 256, 3, 3, 1, "SAME"),
    ("r50.s3 1x1 256->1024", "resnet50", 6, 16, 14, 14, 256, 1024, 1, 1, 1, "SAME"),
    ("r50.s4 1x1 1024->512", "resnet50", 1, 16, 14, 14, 1024, 512, 1, 1, 1, "SAME"),
    ("r50.s4 3x3/2 512->512", "resnet50", 1, 16, 14, 14, 512, 512, 3, 3, 2, "SAME"),
    ("r50.s4 proj 1x1/2 1024->2048", "resnet50", 1, 16, 14, 14, 1024, 2048, 1, 1, 2, "SAME"),
    ("r50.s4 1x1 2048->512", "resnet50", 2, 16, 7, 7, 2048, 512, 1, 1, 1, "SAME"),
    ("r50.s4 3x3 512->512", "resnet50", 2, 16, 7, 7, 512, 512, 3, 3, 1, "SAME"),
    ("r50.s4 1x1 512->2048", "resnet50", 3, 16, 7, 7, 512, 2048, 1, 1, 1, "SAME"),
]

# (name, model, count, batch, H, W, C, window, stride, padding)
POOLS: list[tuple[Any, ...]] = [
    ("mnist.pool1 2x2/2", "mnist", 1, 128, 28, 28, 32, 2, 2, "VALID"),
    ("mnist.pool2 2x2/2", "mnist", 1, 128, 14, 14, 64, 2, 2, "VALID"),
    ("r50.stem pool 3x3/2", "resnet50", 1, 16, 112, 112, 64, 3, 2, "SAME"),
]


def _set_ynn(setting: str) -> None:
    """YNNPACK's fusions off (an empty list) in XLA_FLAGS, before JAX starts; on = default."""
    if setting == "off":
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_experimental_ynn_fusion_type=".strip()


def _same_pads(size: int, k: int, s: int) -> tuple[int, int]:
    out = -(-size // s)
    total = max((out - 1) * s + k - size, 0)
    return total // 2, total - total // 2


def _time(fn, reps: int) -> float:
    """Median wall time in ms of fn() (fn blocks until its result is ready)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _conv_flops(layer) -> float:
    _, _, _, b, h, w, cin, cout, kh, kw, s, _ = layer
    return 2.0 * b * (-(-h // s)) * (-(-w // s)) * cin * cout * kh * kw


# ---------------------------------------------------------------------------- torch


def run_torch(layers, pools, dtype: str, reps: int) -> dict[str, dict[str, float]]:
    import torch  # Only in bench/.venv-torch.

    torch.manual_seed(0)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    out: dict[str, dict[str, float]] = {}
    cl = torch.channels_last
    for layer in layers:
        name, _, _, b, h, w, cin, cout, kh, kw, s, _ = layer
        x = torch.randn(b, cin, h, w, dtype=dt).to(memory_format=cl)
        wt = torch.randn(cout, cin, kh, kw, dtype=dt).to(memory_format=cl)
        ph, pw = _same_pads(h, kh, s), _same_pads(w, kw, s)
        if ph[0] != ph[1] or pw[0] != pw[1]:
            # PyTorch's symmetric padding; pad the input by hand for odd 'SAME' cases.
            x = torch.nn.functional.pad(x, (pw[0], pw[1], ph[0], ph[1])).contiguous(
                memory_format=cl
            )
            pad = [0, 0]
        else:
            pad = [ph[0], pw[0]]
        conv = lambda: torch.ops.aten.convolution(
            x, wt, None, [s, s], pad, [1, 1], False, [0, 0], 1
        )
        with torch.no_grad():
            y = conv()
            g = torch.randn_like(y).contiguous(memory_format=cl)
            bwd = lambda mask: torch.ops.aten.convolution_backward(
                g, x, wt, None, [s, s], pad, [1, 1], False, [0, 0], 1, mask
            )
            out[name] = {
                "fwd": _time(conv, reps),
                "dx": _time(lambda: bwd([True, False, False]), reps),
                "dw": _time(lambda: bwd([False, True, False]), reps),
            }
    for pool in pools:
        name, _, _, b, h, w, c, k, s, padding = pool
        x = torch.randn(b, c, h, w, dtype=dt).relu().to(memory_format=cl).requires_grad_(True)
        pad = k // 2 if padding == "SAME" else 0
        y = torch.nn.functional.max_pool2d(x, k, s, pad)
        g = torch.randn_like(y)

        def fwd_bwd():
            yy = torch.nn.functional.max_pool2d(x, k, s, pad)
            return torch.autograd.grad(yy, x, g)

        with torch.no_grad():
            t_f = _time(lambda: torch.nn.functional.max_pool2d(x, k, s, pad), reps)
        out[name] = {"fwd": t_f, "bwd": max(_time(fwd_bwd, reps) - t_f, 0.0)}
    return out


# ---------------------------------------------------------------------------- jax


def run_jax(layers, pools, dtype: str, reps: int) -> dict[str, dict[str, float]]:
    import functools

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from estimax import ops
    from estimax.ops import cpu_conv, native

    dt = jnp.dtype(dtype)
    rng = np.random.default_rng(0)
    out: dict[str, dict[str, float]] = {}
    block = jax.block_until_ready
    for layer in layers:
        name, _, _, b, h, w, cin, cout, kh, kw, s, padding = layer
        x = jnp.asarray(rng.standard_normal((b, h, w, cin)), dt)
        wt = jnp.asarray(rng.standard_normal((kh, kw, cin, cout)), dt)
        spec = cpu_conv._normalize(
            x, wt, (s, s), padding, None, None, cpu_conv._NHWC, 1, 1, None, None
        )
        ref = functools.partial(cpu_conv._ref_conv, spec=spec)
        y = jax.jit(ref)(x, wt)
        g = jnp.asarray(rng.standard_normal(y.shape), dt)
        ref_dx = jax.jit(lambda x, w, g: jax.vjp(lambda x: ref(x, w), x)[1](g)[0])
        ref_dw = jax.jit(lambda x, w, g: jax.vjp(lambda w: ref(x, w), w)[1](g)[0])
        res = {
            "jax fwd": _time(lambda: block(jax.jit(ref)(x, wt)), reps),
            "jax dx": _time(lambda: block(ref_dx(x, wt, g)), reps),
            "jax dw": _time(lambda: block(ref_dw(x, wt, g)), reps),
        }
        for label, impl, s_ in (
            ("ops fwd im2col", cpu_conv._cpu_fwd, spec._replace(fwd="im2col")),
            ("ops dx matmul", cpu_conv._cpu_dx, spec._replace(dx="matmul")),
            ("ops dw im2col", cpu_conv._cpu_dw, spec._replace(dw="im2col")),
            ("ops dw offsets", cpu_conv._cpu_dw, spec._replace(dw="offsets")),
            ("ops dw im2col_t", cpu_conv._cpu_dw, spec._replace(dw="im2col_t")),
        ):
            f = jax.jit(functools.partial(impl, s_))
            args = (x, wt) if "fwd" in label else (x, wt, g)
            res[label] = _time(lambda f=f, args=args: block(f(*args)), reps)
        onednn = spec._replace(fwd="onednn", dx="onednn", dw="onednn")
        for label, fn, args in (
            ("onednn fwd", functools.partial(cpu_conv._onednn_fwd, onednn), (x, wt)),
            ("onednn dx", functools.partial(cpu_conv._onednn_dx, onednn), (x, wt, g)),
            ("onednn dw", functools.partial(cpu_conv._onednn_dw, onednn), (x, wt, g)),
        ):
            if native.available():
                f = jax.jit(fn)
                res[label] = _time(lambda f=f, args=args: block(f(*args)), reps)
            else:
                res[label] = float("nan")
        if dtype == "bfloat16" and native.available():
            up = spec._replace(fwd="onednn_f32", dx="onednn_f32", dw="onednn_f32")
            for label, fn, args in (
                ("onednn_f32 fwd", functools.partial(cpu_conv._cpu_fwd_any, up), (x, wt)),
                ("onednn_f32 dx", functools.partial(cpu_conv._DX_KERNELS["onednn_f32"], up),
                 (x, wt, g)),
                ("onednn_f32 dw", functools.partial(cpu_conv._DW_KERNELS["onednn_f32"], up),
                 (x, wt, g)),
            ):  # fmt: skip
                f = jax.jit(fn)
                res[label] = _time(lambda f=f, args=args: block(f(*args)), reps)
        out[name] = res
    for pool in pools:
        name, _, _, b, h, w, c, k, s, padding = pool
        x = jnp.maximum(jnp.asarray(rng.standard_normal((b, h, w, c)), dt), 0)
        ref = lambda x: nn.max_pool(x, (k, k), (s, s), padding)
        mine = lambda x: ops.max_pool(x, (k, k), (s, s), padding)
        y = ref(x)
        g = jnp.asarray(rng.standard_normal(y.shape), dt)
        f_ref = jax.jit(ref)
        b_ref = jax.jit(lambda x, g: jax.vjp(ref, x)[1](g)[0])
        b_ops = jax.jit(lambda x, g: jax.vjp(mine, x)[1](g)[0])
        out[name] = {
            "jax fwd": _time(lambda: block(f_ref(x)), reps),
            "jax bwd": _time(lambda: block(b_ref(x, g)), reps),
            "ops bwd": _time(lambda: block(b_ops(x, g)), reps),
        }
    return out


# ---------------------------------------------------------------------------- report


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Per-layer convolution times on the CPU ({result['dtype']})",
        "",
        f"{result['note']} JAX allocator: {result.get('malloc', 'default')}.",
        "",
        "Median ms per call. `ops dx/dw`: estimax.ops matmul formulations; "
        "GF/s = GFLOP/s of that column. `best ops` picks the fastest of the "
        "estimax strategies (XLA kept where it wins).",
        "",
    ]
    hdr = (
        "| layer | n | GFLOP | torch fwd | torch dx | torch dw | jax fwd | jax dx | jax dw "
        "| ops fwd im2col | ops dx matmul | ops dw im2col | ops dw offsets | ops dw im2col_t "
        "| onednn fwd | onednn dx | onednn dw |"
    )
    lines += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    totals: dict[str, dict[str, float]] = {}
    for layer in LAYERS:
        name, model, count = layer[0], layer[1], layer[2]
        if name not in result["jax"]:
            continue
        j, t = result["jax"][name], result.get("torch", {}).get(name, {})
        gf = _conv_flops(layer) / 1e9
        cells = [f"{t.get(k, float('nan')):.1f}" for k in ("fwd", "dx", "dw")]
        cells += [
            f"{j[k]:.1f} ({gf / j[k] * 1e3:.0f} GF/s)" for k in ("jax fwd", "jax dx", "jax dw")
        ]
        cells += [
            f"{j[k]:.1f}"
            for k in (
                "ops fwd im2col",
                "ops dx matmul",
                "ops dw im2col",
                "ops dw offsets",
                "ops dw im2col_t",
            )
        ]
        cells += [
            f"{j.get(k, float('nan')):.1f} ({gf / j.get(k, float('nan')) * 1e3:.0f} GF/s)"
            for k in ("onednn fwd", "onednn dx", "onednn dw")
        ]
        lines.append(f"| {name} | {count} | {gf:.2f} | " + " | ".join(cells) + " |")
        tot = totals.setdefault(model, {})
        best = {
            "fwd": min(j["jax fwd"], j["ops fwd im2col"]),
            "dx": min(j["jax dx"], j["ops dx matmul"]),
            "dw": min(j["jax dw"], j["ops dw im2col"], j["ops dw offsets"], j["ops dw im2col_t"]),
        }
        nan = float("nan")
        for key, val in (
            ("torch fwd", t.get("fwd", 0)),
            ("torch dx", t.get("dx", 0)),
            ("torch dw", t.get("dw", 0)),
            ("jax fwd", j["jax fwd"]),
            ("jax dx", j["jax dx"]),
            ("jax dw", j["jax dw"]),
            ("ops dx matmul", j["ops dx matmul"]),
            ("ops dw im2col", j["ops dw im2col"]),
            ("ops dw im2col_t", j["ops dw im2col_t"]),
            ("best fwd", best["fwd"]),
            ("best dx", best["dx"]),
            ("best dw", best["dw"]),
            ("onednn fwd", j.get("onednn fwd", nan)),
            ("onednn dx", j.get("onednn dx", nan)),
            ("onednn dw", j.get("onednn dw", nan)),
        ):
            tot[key] = tot.get(key, 0.0) + count * val
    lines += [
        "",
        "## Count-weighted totals over all convolutions of each model (ms per step)",
        "",
        "| model | torch fwd | torch dx | torch dw | jax fwd | jax dx | jax dw "
        "| ops dx matmul | ops dw im2col | ops dw im2col_t | best fwd | best dx | best dw "
        "| onednn fwd | onednn dx | onednn dw |",
        "|---|" + "---|" * 15,
    ]
    for model, tot in totals.items():
        keys = (
            "torch fwd",
            "torch dx",
            "torch dw",
            "jax fwd",
            "jax dx",
            "jax dw",
            "ops dx matmul",
            "ops dw im2col",
            "ops dw im2col_t",
            "best fwd",
            "best dx",
            "best dw",
            "onednn fwd",
            "onednn dx",
            "onednn dw",
        )
        lines.append(f"| {model} | " + " | ".join(f"{tot[k]:.0f}" for k in keys) + " |")
    if "jax_no_ynn" in result:
        lines += _ynn_markdown(result)
    if any("onednn_f32 fwd" in v for v in result["jax"].values()):
        lines += _bf16_markdown(result)
    lines += [
        "",
        "## Max-pool (ms)",
        "",
        "| pool | torch fwd | torch bwd | jax fwd | jax bwd | ops bwd |",
        "|---|---|---|---|---|---|",
    ]
    for pool in POOLS:
        name = pool[0]
        if name not in result["jax"]:
            continue
        j, t = result["jax"][name], result.get("torch", {}).get(name, {})
        lines.append(
            f"| {name} | {t.get('fwd', float('nan')):.2f} | {t.get('bwd', float('nan')):.2f} "
            f"| {j['jax fwd']:.2f} | {j['jax bwd']:.2f} | {j['ops bwd']:.2f} |"
        )
    return "\n".join(lines) + "\n"


_XLA_KEYS = {
    "fwd": ("jax fwd", "ops fwd im2col"),
    "dx": ("jax dx", "ops dx matmul"),
    "dw": ("jax dw", "ops dw im2col", "ops dw offsets", "ops dw im2col_t"),
}


def _ynn_markdown(result: dict[str, Any]) -> list[str]:
    """XLA's own convolutions and estimax's XLA formulations with YNNPACK on and off."""
    on, off = result["jax"], result["jax_no_ynn"]
    lines = [
        "",
        "## The XLA fallback with XLA:CPU's YNNPACK fusions on (jaxlib's default) and off",
        "",
        "ms per call; `best` = the fastest XLA strategy of that direction (what the fallback "
        "can pick), `chosen` = what `_default_strategy` picks. Off = "
        "`XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=`.",
        "",
        "| layer | n | jax fwd on / off | jax dx on / off | jax dw on / off | best fwd on / off "
        "| best dx on / off | best dw on / off | chosen on / off |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    totals: dict[str, dict[str, float]] = {}
    for layer in LAYERS:
        name, model, count = layer[0], layer[1], layer[2]
        if name not in on or name not in off:
            continue
        _, _, _, b, h, w, cin, cout, kh, kw, s, _ = layer
        chosen = (
            _chosen_time(on[name], kh, kw, cin, cout, s),
            _chosen_time(off[name], kh, kw, cin, cout, s),
        )
        best = {
            d: (min(on[name][k] for k in ks), min(off[name][k] for k in ks))
            for d, ks in _XLA_KEYS.items()
        }
        cells = [f"{on[name][k]:.1f} / {off[name][k]:.1f}" for k in ("jax fwd", "jax dx", "jax dw")]
        cells += [f"{best[d][0]:.1f} / {best[d][1]:.1f}" for d in ("fwd", "dx", "dw")]
        cells.append(f"{chosen[0]:.1f} / {chosen[1]:.1f}")
        lines.append(f"| {name} | {count} | " + " | ".join(cells) + " |")
        tot = totals.setdefault(model, {})
        for key, val in (
            ("jax on", sum(on[name][k] for k in ("jax fwd", "jax dx", "jax dw"))),
            ("jax off", sum(off[name][k] for k in ("jax fwd", "jax dx", "jax dw"))),
            ("best on", sum(v[0] for v in best.values())),
            ("best off", sum(v[1] for v in best.values())),
            ("chosen on", chosen[0]),
            ("chosen off", chosen[1]),
        ):
            tot[key] = tot.get(key, 0.0) + count * val
    lines += [
        "",
        "Count-weighted totals, fwd + dx + dw over all convolutions (ms per step):",
        "",
        "| model | XLA's convs, YNN on | off | best XLA strategies, on | off | chosen, on | off |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, tot in totals.items():
        keys = ("jax on", "jax off", "best on", "best off", "chosen on", "chosen off")
        lines.append(f"| {model} | " + " | ".join(f"{tot[k]:.0f}" for k in keys) + " |")
    return lines


def _chosen_time(r: dict[str, float], kh: int, kw: int, cin: int, cout: int, s: int) -> float:
    """fwd + dx + dw time of the pure-XLA strategies estimax's fallback picks for a layer."""
    from estimax.ops import cpu_conv

    fwd, dx, dw = cpu_conv._default_strategy(kh, kw, cin, cout, (s, s))
    key = {"xla": "jax", "im2col": "ops", "matmul": "ops", "offsets": "ops", "im2col_t": "ops"}
    return (
        r["jax fwd" if fwd == "xla" else "ops fwd im2col"]
        + r["jax dx" if dx == "xla" else "ops dx matmul"]
        + r["jax dw" if dw == "xla" else f"{key[dw]} dw {dw}"]
    )


def _bf16_markdown(result: dict[str, Any]) -> list[str]:
    """oneDNN's native bf16 kernels against its fp32 kernels on values cast up."""
    lines = [
        "",
        "## oneDNN bf16 kernels vs its fp32 kernels on upcast values (ms)",
        "",
        "| layer | n | fwd bf16 / f32 | dx bf16 / f32 | dw bf16 / f32 |",
        "|---|---|---|---|---|",
    ]
    totals: dict[str, list[float]] = {}
    for layer in LAYERS:
        name, model, count = layer[0], layer[1], layer[2]
        r = result["jax"].get(name)
        if not r or "onednn_f32 fwd" not in r:
            continue
        cells = [
            f"{r[f'onednn {d}']:.1f} / {r[f'onednn_f32 {d}']:.1f}" for d in ("fwd", "dx", "dw")
        ]
        lines.append(f"| {name} | {count} | " + " | ".join(cells) + " |")
        t = totals.setdefault(model, [0.0, 0.0])
        t[0] += count * sum(r[f"onednn {d}"] for d in ("fwd", "dx", "dw"))
        t[1] += count * sum(r[f"onednn_f32 {d}"] for d in ("fwd", "dx", "dw"))
    lines += ["", "| model | all convolutions, bf16 kernels | fp32 kernels on upcast values |"]
    lines += ["|---|---|---|"]
    lines += [f"| {m} | {t[0]:.0f} | {t[1]:.0f} |" for m, t in totals.items()]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", choices=("mnist", "resnet50"), default=None)
    parser.add_argument(
        "--out",
        default=None,
        help="a JSON file of its own (and .md beside it); default: this CPU's and dtype's "
        "section of bench/results/conv_cpu.{json,md}",
    )
    parser.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jax-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--ynn",
        choices=("both", "on", "off"),
        default="both",
        help="XLA:CPU's YNNPACK fusions for the XLA columns: jaxlib's default (on), off, or both",
    )
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument(
        "--malloc",
        choices=("default", "tuned"),
        default="tuned",
        help="tuned: estimax.ops.tune_cpu_allocator() before the JAX timings",
    )
    args = parser.parse_args()
    layers = [layer for layer in LAYERS if args.only in (None, layer[1])]
    pools = [p for p in POOLS if args.only in (None, p[1])]
    if args.torch_worker:
        json.dump(run_torch(layers, pools, args.dtype, args.reps), sys.stdout)
        return
    result: dict[str, Any] = {
        "dtype": args.dtype,
        "reps": args.reps,
        "note": (
            f"{os.cpu_count()} CPU cores, shared with other jobs while measured "
            "(timings noisy; compare within a run). "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}."
        ),
    }
    if not args.no_torch and not args.jax_worker:
        if not os.path.exists(TORCH_PY):
            sys.exit(
                f"conv_cpu.py: {TORCH_PY} not found; create it with "
                "`python3 -m venv bench/.venv-torch && bench/.venv-torch/bin/pip install "
                "torch==2.13.0 numpy`, or pass --no-torch"
            )
        cmd = [
            TORCH_PY,
            os.path.abspath(__file__),
            "--torch-worker",
            "--dtype",
            args.dtype,
            "--reps",
            str(args.reps),
        ] + (["--only", args.only] if args.only else [])
        result["torch"] = json.loads(
            subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        )
    if args.jax_worker:
        _set_ynn(args.ynn)
        if args.malloc == "tuned":
            from estimax import ops

            ops.tune_cpu_allocator()
        json.dump(run_jax(layers, pools, args.dtype, args.reps), sys.stdout)
        return
    result["malloc"] = args.malloc
    result["load"] = {"start": os.getloadavg()[0]}
    for setting, key in (("on", "jax"), ("off", "jax_no_ynn")):
        if args.ynn in (setting, "both"):
            cmd = [sys.executable, os.path.abspath(__file__), "--jax-worker", "--no-torch"]
            cmd += ["--ynn", setting]
            cmd += ["--dtype", args.dtype, "--reps", str(args.reps), "--malloc", args.malloc]
            cmd += ["--only", args.only] if args.only else []
            proc = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
            result[key] = json.loads(proc.stdout)
    if "jax" not in result:  # --ynn off alone: its numbers are the main table
        result["jax"] = result.pop("jax_no_ynn")
    result["load"]["end"] = os.getloadavg()[0]
    from estimax.ops import native

    result["native"] = native.status()
    result["note"] += (
        f" 1-minute load average {result['load']['start']:.2f} at the start, "
        f"{result['load']['end']:.2f} at the end (the bench alone keeps it near 1-2)."
        f" XLA columns: YNNPACK {args.ynn}. CPU convolutions: {result['native']}."
    )
    md = _markdown(result)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(md)
    else:  # one file for every CPU kind: this run replaces its CPU's and dtype's section
        label = f"{cpu_kind()}, {args.dtype}"
        report = f"# {label}" + md[md.index("\n") :]  # its section's heading
        title = "Per-layer convolution times on the CPU (bench/conv_cpu.py)"
        write_section("conv_cpu", slug(label), report, result, title)
    print(md)


if __name__ == "__main__":
    main()
