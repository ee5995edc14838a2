"""A convolution that runs fast on XLA:CPU, forward and both gradients (oneDNN where built).

XLA:CPU lowers the backward convolutions of a convnet to its generic convolution
kernels, which reach only 3-40 GFLOP/s for the filter gradient (against ~190 GFLOP/s
for a plain fp32 matmul on the same cores), and it lowers max-pool's backward to
``select_and_scatter``, which takes ~100 ms of a 330 ms MNIST step (see
``bench/results/conv_cpu.md``). XLA's oneDNN and XNNPACK flags do not change that in jaxlib
0.10; its YNNPACK fusions (on by default) speed its convolutions and dots up, and the pure-XLA
strategies below keep them on (``cpu_runtime.xla_cpu_conv_setting`` says why).

The drop-in here is a ``jax.custom_vjp`` around ``lax.conv_general_dilated`` whose
CPU lowering, where estimax's oneDNN library is built (``estimax.ops.native``), calls
oneDNN's convolutions (forward, input and filter gradients) through XLA's FFI: the kernels
PyTorch uses on CPUs. Each convolution is first probed (``native.probe``): oneDNN creates
its primitive for those shapes on this CPU, or says why it cannot. fp32 runs natively; bf16
runs natively where the CPU has bf16 convolutions (AVX-512 with AMX or bf16), and elsewhere
(AVX2-only CPUs such as AMD Zen 2, or ``ONEDNN_MAX_CPU_ISA=AVX2``) as oneDNN's fp32 kernels on
values cast up, one rounding back to bf16 at the end (``bench/results/train_cpu.md`` measures
this against XLA's own bf16). A piece oneDNN cannot serve at all, and every piece without the
library (or with ``ESTIMAX_ONEDNN=0``, or inside ``native.native_kernels(False)``, as exports
are traced), uses the pure-XLA strategies, computed in fp32 for bf16/fp16 operands: 1x1
convolutions (forward and both gradients) as dots, the gradients of larger kernels, where
measured faster, as matrix products over shifted, strided views of the input (the im2col
formulation) plus elementwise pads and adds that XLA fuses, and XLA's own convolution for the
rest (``_default_strategy`` has the rules).

The strategies per direction (``conv_strategies`` reports them, ``conv_with_strategy`` forces
them): forward ``xla`` | ``im2col`` | ``onednn`` | ``onednn_f32``; input gradient ``xla`` |
``matmul`` | ``onednn`` | ``onednn_f32``; filter gradient ``xla`` | ``im2col`` | ``offsets`` |
``im2col_t`` | ``onednn`` | ``onednn_f32``. They are chosen when the convolution is traced
(oneDNN's probe per shape and dtype); whether the CPU kernels run at all is chosen at lowering
time with ``jax.lax.platform_dependent``, so a program traced on a host and run on GPU/TPU
lowers to exactly the standard ``jax.vjp`` of the reference op there.

Why by hand: no maintained library provides a JAX convolution or pooling VJP
tuned for XLA:CPU, and no package ships oneDNN for JAX; the formulations are ~150
lines of lax and the oneDNN glue ~330 lines of C++ (``native/onednn_conv.cc``).

Supported fast path: 2 spatial dims, NHWC/HWIO/NHWC layout, floating point operands of one
dtype, any strides, 'SAME', 'VALID' or explicit padding, any kernel size (1x1, 3x3, 5x5, 7x7,
1x7, 7x1, ...), ``feature_group_count == batch_group_count == 1``, no dilation, no
``preferred_element_type``. Anything else falls back to ``lax.conv_general_dilated`` unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from estimax.ops import manual_axes, native

Array = jax.Array

# Fast-path strategies, per direction. "xla" keeps XLA's own convolution for that piece;
# "im2col", "matmul", "offsets" and "im2col_t" are the matrix-product formulations below;
# "onednn" runs oneDNN's kernel in the operands' dtype, "onednn_f32" its fp32 kernel on
# operands cast up (bf16 on CPUs without bf16 convolutions).
_FWD_STRATEGIES = ("xla", "im2col", "onednn", "onednn_f32")
_DX_STRATEGIES = ("xla", "matmul", "onednn", "onednn_f32")
_DW_STRATEGIES = ("xla", "im2col", "offsets", "im2col_t", "onednn", "onednn_f32")

_NHWC = ("NHWC", "HWIO", "NHWC")


class _ConvSpec(NamedTuple):
    """Static description of one 2-D NHWC/HWIO convolution (hashable)."""

    strides: tuple[int, int]
    pads: tuple[tuple[int, int], tuple[int, int]]
    precision: Any
    fwd: str
    dx: str
    dw: str


def _default_strategy(
    kh: int, kw: int, cin: int, cout: int, strides: tuple[int, int]
) -> tuple[str, str, str]:
    """Picks the pure-XLA (fwd, dx, dw) strategies for a kernel shape.

    These serve the directions oneDNN does not (no library, turned off, or its probe refuses
    the shape/dtype); ``_onednn_strategy`` replaces them where it can. From the per-layer
    measurements in bench/results/conv_cpu.md (ResNet-50 at 224, batch 16; MNIST CNN at batch
    128):
    * 1x1 convolutions are plain matrix products; XLA:CPU's own convolutions for them
      run at 4-40 GFLOP/s against 100-200 as dots, in all three directions.
    * For larger kernels XLA's forward convolution is as fast as the im2col product
      (the patch matrix costs memory traffic), so it is kept.
    * Input gradient: col2im's elementwise work scales with Cin, the product with
      Cin * Cout, so the product wins for wide or strided layers (XLA lowers strided
      input gradients to a convolution over a zero-dilated cotangent).
    * Filter gradient: XLA's is slow but so is a patch matrix for narrow layers; the
      per-offset products win from 128 input channels, im2col for tiny inputs
      (MNIST's first layer: Cin*KH*KW = 25).
    """
    if kh == 1 and kw == 1:
        return ("im2col", "matmul", "im2col")
    strided = max(strides) > 1
    dx = "matmul" if min(cin, cout) >= 256 or (strided and cin >= 128) else "xla"
    if cin * kh * kw <= 32:
        dw = "im2col"
    elif cin >= 128:
        dw = "offsets"
    else:
        dw = "xla"
    return ("xla", dx, dw)


def _normalize(
    lhs: Array | jax.ShapeDtypeStruct,
    rhs: Array | jax.ShapeDtypeStruct,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None,
    rhs_dilation: Sequence[int] | None,
    dimension_numbers: Any,
    feature_group_count: int,
    batch_group_count: int,
    preferred_element_type: Any,
    precision: Any,
) -> _ConvSpec | None:
    """Returns the static spec of a supported convolution, or None to fall back."""
    if lhs.ndim != 4 or rhs.ndim != 4 or dimension_numbers is None:
        return None
    if feature_group_count != 1 or batch_group_count != 1:
        return None
    if preferred_element_type is not None:
        return None
    if any(d != 1 for d in (lhs_dilation or (1, 1))):
        return None
    if any(d != 1 for d in (rhs_dilation or (1, 1))):
        return None
    try:
        dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    except (TypeError, ValueError):
        return None
    if dn != lax.conv_dimension_numbers(lhs.shape, rhs.shape, _NHWC):
        return None
    if lhs.dtype != rhs.dtype or not jnp.issubdtype(lhs.dtype, jnp.floating):
        return None
    kh, kw, cin, _ = rhs.shape
    if lhs.shape[3] != cin:
        return None
    strides_any = tuple(int(s) for s in window_strides)
    pads_any: Sequence[tuple[int, int]]
    if isinstance(padding, str):
        pads_any = lax.padtype_to_pads(lhs.shape[1:3], (kh, kw), strides_any, padding)
    else:
        pads_any = padding
    pads_all = tuple((int(lo), int(hi)) for lo, hi in pads_any)
    if len(strides_any) != 2 or len(pads_all) != 2 or any(p < 0 for pr in pads_all for p in pr):
        return None
    strides = (strides_any[0], strides_any[1])
    pads = (pads_all[0], pads_all[1])
    fwd, dx, dw = _default_strategy(kh, kw, cin, rhs.shape[3], strides)
    if native.enabled():
        fwd, dx, dw = (
            _onednn_strategy(kind, lhs.shape, rhs.shape, strides, pads, lhs.dtype, xla)
            for kind, xla in zip(native.CONV_KINDS, (fwd, dx, dw), strict=True)
        )
    return _ConvSpec(strides, pads, precision, fwd, dx, dw)


def _onednn_strategy(
    kind: str,
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    strides: tuple[int, int],
    pads: tuple[tuple[int, int], tuple[int, int]],
    dtype: Any,
    xla_strategy: str,
) -> str:
    """Whether oneDNN serves one direction of a convolution on this CPU, and in which dtype.

    oneDNN, measured per layer (bench/results/conv_cpu.md) against the XLA rules: 200-370
    GFLOP/s fp32 in all three directions, where XLA's convolutions reach 11-250 and the
    1x1-as-dot formulations 60-250. The primitive is created now (``native.probe``), so a
    convolution it cannot run (bf16 on an AVX2-only CPU) never reaches it at run time.
    """
    b, h, w, cin = x_shape
    kh, kw, _, cout = w_shape
    (sh, sw), ((pt, pb), (pl, pr)) = strides, pads
    dims = tuple(
        int(d)
        for d in (
            b,
            cin,
            h,
            w,
            cout,
            kh,
            kw,
            _out_size(h, kh, sh, pt, pb),
            _out_size(w, kw, sw, pl, pr),
            sh,
            sw,
            pt,
            pb,
            pl,
            pr,
        )
    )
    name = jnp.dtype(dtype).name
    if native.probe(kind, name, dims) is None:
        return "onednn"
    if name in ("bfloat16", "float16") and native.probe(kind, "float32", dims) is None:
        # Measured on an AVX2-only CPU (bench/results/train_cpu.md, its AVX2 EPYC section):
        # oneDNN's fp32 kernels on upcast values beat XLA's formulations, which compute in
        # fp32 there as well.
        return "onednn_f32"
    return xla_strategy


def conv_general_dilated(
    lhs: Array,
    rhs: Array,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> Array:
    """``lax.conv_general_dilated`` with a CPU-fast backward pass.

    Same signature and the same values (to floating-point rounding) as
    ``jax.lax.conv_general_dilated``; pass it to Flax as
    ``nn.Conv(..., conv_general_dilated=estimax.ops.conv_general_dilated)``. On the CPU backend
    the forward pass and both gradients run oneDNN's convolutions where the library is built and
    serves the shape, else the pure-XLA strategies (dots, matrix products over shifted views, or
    XLA's own convolution; see the module docstring and ``conv_strategies``). On other backends,
    and for convolutions outside the fast path (grouped, dilated, non-NHWC/HWIO,
    ``preferred_element_type``), it is exactly ``lax.conv_general_dilated``.

    Args:
      lhs: input, ``[B, H, W, Cin]`` for the fast path (``dimension_numbers``
        ``('NHWC', 'HWIO', 'NHWC')`` or Flax's equivalent ``ConvDimensionNumbers``).
      rhs: kernel, ``[KH, KW, Cin, Cout]``.
      window_strides: ``(sh, sw)``.
      padding: ``'SAME'``, ``'VALID'`` or ``((top, bottom), (left, right))``.
      lhs_dilation: must be None or all ones for the fast path.
      rhs_dilation: must be None or all ones for the fast path.
      dimension_numbers: as in ``lax.conv_general_dilated``.
      feature_group_count: must be 1 for the fast path.
      batch_group_count: must be 1 for the fast path.
      precision: passed to XLA's convolutions and the matrix products of the XLA strategies;
        oneDNN's kernels compute in the operands' dtype (or fp32) whatever it says.
      preferred_element_type: must be None for the fast path.

    Returns:
      ``[B, Ho, Wo, Cout]``, the convolution of ``lhs`` with ``rhs``.
    """
    spec = _normalize(
        lhs,
        rhs,
        window_strides,
        padding,
        lhs_dilation,
        rhs_dilation,
        dimension_numbers,
        feature_group_count,
        batch_group_count,
        preferred_element_type,
        precision,
    )
    if spec is None:
        return lax.conv_general_dilated(
            lhs,
            rhs,
            window_strides,
            padding,
            lhs_dilation=lhs_dilation,
            rhs_dilation=rhs_dilation,
            dimension_numbers=dimension_numbers,
            feature_group_count=feature_group_count,
            batch_group_count=batch_group_count,
            precision=precision,
            preferred_element_type=preferred_element_type,
        )
    return _conv(lhs, rhs, spec)


def conv_strategies(
    lhs_shape: Sequence[int],
    rhs_shape: Sequence[int],
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    dtype: Any = jnp.float32,
) -> tuple[str, str, str] | None:
    """The CPU kernels ``conv_general_dilated`` would choose now, as ``(fwd, dx, dw)``.

    Each is one of the strategies of ``conv_with_strategy``; None if the convolution is outside
    the fast path (it then runs as ``lax.conv_general_dilated``). Follows
    ``estimax.ops.native.native_kernels`` (oneDNN off: the pure-XLA strategies).

    Args:
      lhs_shape: ``[B, H, W, Cin]``.
      rhs_shape: ``[KH, KW, Cin, Cout]``.
      window_strides: ``(sh, sw)``.
      padding: ``'SAME'``, ``'VALID'`` or explicit pairs.
      dtype: of both operands.
    """
    lhs = jax.ShapeDtypeStruct(tuple(lhs_shape), dtype)
    rhs = jax.ShapeDtypeStruct(tuple(rhs_shape), dtype)
    spec = _normalize(lhs, rhs, window_strides, padding, None, None, _NHWC, 1, 1, None, None)
    return None if spec is None else (spec.fwd, spec.dx, spec.dw)


def conv_with_strategy(
    lhs: Array,
    rhs: Array,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    *,
    fwd: str,
    dx: str,
    dw: str,
) -> Array:
    """NHWC/HWIO convolution with explicitly chosen CPU strategies (for benches).

    Args:
      lhs: ``[B, H, W, Cin]``.
      rhs: ``[KH, KW, Cin, Cout]``.
      window_strides: ``(sh, sw)``.
      padding: ``'SAME'``, ``'VALID'`` or explicit pairs.
      fwd: one of ``_FWD_STRATEGIES``.
      dx: one of ``_DX_STRATEGIES``.
      dw: one of ``_DW_STRATEGIES``. The "onednn" strategies are used as asked, without
        asking oneDNN first: for benchmarks and tests of the kernels themselves.

    Returns:
      ``[B, Ho, Wo, Cout]``.
    """
    for name, value, allowed in (
        ("fwd", fwd, _FWD_STRATEGIES),
        ("dx", dx, _DX_STRATEGIES),
        ("dw", dw, _DW_STRATEGIES),
    ):
        if value not in allowed:
            raise ValueError(f"conv_with_strategy: {name}={value!r}, expected one of {allowed}")
    spec = _normalize(lhs, rhs, window_strides, padding, None, None, _NHWC, 1, 1, None, None)
    if spec is None:
        raise ValueError(
            f"conv_with_strategy: unsupported shapes lhs={lhs.shape} {lhs.dtype}, "
            f"rhs={rhs.shape} {rhs.dtype}, padding={padding}"
        )
    if any(v.startswith("onednn") for v in (fwd, dx, dw)) and not native.available():
        raise ValueError(f"conv_with_strategy: oneDNN requested but {native.status()}")
    return _conv(lhs, rhs, spec._replace(fwd=fwd, dx=dx, dw=dw))


# ----------------------------------------------------------------------------
# Reference pieces (used on non-CPU backends, and for "xla" strategies).


def _ref_conv(x: Array, w: Array, spec: _ConvSpec) -> Array:
    return lax.conv_general_dilated(
        x, w, spec.strides, spec.pads, dimension_numbers=_NHWC, precision=spec.precision
    )


def _ref_bwd(spec: _ConvSpec, x: Array, w: Array, g: Array) -> tuple[Array, Array]:
    _, vjp = jax.vjp(functools.partial(_ref_conv, spec=spec), x, w)
    return vjp(g)


# ----------------------------------------------------------------------------
# Matmul formulations (CPU).


def _out_size(size: int, k: int, s: int, lo: int, hi: int) -> int:
    return (size + lo + hi - k) // s + 1


def _shifted_views(
    x: Array, kh: int, kw: int, spec: _ConvSpec, pad_value: float = 0.0
) -> tuple[list[Array], int, int]:
    """Strided views ``xpad[:, i::sh, j::sw]`` for every kernel offset, row-major.

    Returns the KH*KW views, each ``[B, Ho, Wo, C]``, and ``(Ho, Wo)``.
    """
    (sh, sw), ((pt, pb), (pl, pr)) = spec.strides, spec.pads
    b, h, w_, c = x.shape
    ho, wo = _out_size(h, kh, sh, pt, pb), _out_size(w_, kw, sw, pl, pr)
    xp = x
    if pt or pb or pl or pr:
        xp = lax.pad(
            x, jnp.asarray(pad_value, x.dtype), ((0, 0, 0), (pt, pb, 0), (pl, pr, 0), (0, 0, 0))
        )
    views = []
    for i in range(kh):
        for j in range(kw):
            views.append(
                lax.slice(
                    xp,
                    (0, i, j, 0),
                    (b, i + (ho - 1) * sh + 1, j + (wo - 1) * sw + 1, c),
                    (1, sh, sw, 1),
                )
            )
    return views, ho, wo


def _shifted_views_cfirst(
    xt: Array, kh: int, kw: int, spec: _ConvSpec
) -> tuple[list[Array], int, int]:
    """``_shifted_views`` for a channel-first ``[C, B, H, W]`` input; views ``[C, B, Ho, Wo]``."""
    (sh, sw), ((pt, pb), (pl, pr)) = spec.strides, spec.pads
    c, b, h, w_ = xt.shape
    ho, wo = _out_size(h, kh, sh, pt, pb), _out_size(w_, kw, sw, pl, pr)
    xp = xt
    if pt or pb or pl or pr:
        xp = lax.pad(xt, jnp.zeros((), xt.dtype), ((0, 0, 0), (0, 0, 0), (pt, pb, 0), (pl, pr, 0)))
    views = []
    for i in range(kh):
        for j in range(kw):
            views.append(
                lax.slice(
                    xp,
                    (0, 0, i, j),
                    (c, b, i + (ho - 1) * sh + 1, j + (wo - 1) * sw + 1),
                    (1, 1, sh, sw),
                )
            )
    return views, ho, wo


def _scatter_views(
    parts: Sequence[Array], x_shape: Sequence[int], kh: int, kw: int, spec: _ConvSpec
) -> Array:
    """Adjoint of ``_shifted_views``: adds each ``[B, Ho, Wo, C]`` part back.

    Each part is placed with an interior pad (stride - 1 zeros between elements),
    so the whole sum is elementwise work that XLA fuses into one loop.
    """
    (sh, sw), ((pt, pb), (pl, pr)) = spec.strides, spec.pads
    _, h, w_, _ = x_shape
    hp, wp = h + pt + pb, w_ + pl + pr
    total = None
    for idx, part in enumerate(parts):
        i, j = divmod(idx, kw)
        _, ho, wo, _ = part.shape
        hi_h = hp - (i + (ho - 1) * sh + 1)
        hi_w = wp - (j + (wo - 1) * sw + 1)
        placed = lax.pad(
            part,
            jnp.zeros((), part.dtype),
            ((0, 0, 0), (i, hi_h, sh - 1), (j, hi_w, sw - 1), (0, 0, 0)),
        )
        total = placed if total is None else total + placed
    assert total is not None
    if pt or pb or pl or pr:
        # Crop the padding back off (negative pads crop).
        total = lax.pad(
            total, jnp.zeros((), total.dtype), ((0, 0, 0), (-pt, -pb, 0), (-pl, -pr, 0), (0, 0, 0))
        )
    return total


def _matmul(a: Array, b: Array, contract: tuple[int, int], precision: Any, out_dtype: Any) -> Array:
    """2-D ``dot_general`` accumulating in fp32 (bf16 sums over B*H*W lose digits)."""
    acc = jnp.float32 if a.dtype in (jnp.bfloat16, jnp.float16) else None
    out = lax.dot_general(
        a,
        b,
        (((contract[0],), (contract[1],)), ((), ())),
        precision=precision,
        preferred_element_type=acc,
    )
    return out.astype(out_dtype)


def _cpu_fwd(spec: _ConvSpec, x: Array, w: Array) -> Array:
    if spec.fwd == "xla":
        return _ref_conv(x, w, spec)
    kh, kw, cin, cout = w.shape
    views, ho, wo = _shifted_views(x, kh, kw, spec)
    b = x.shape[0]
    patches = views[0] if len(views) == 1 else jnp.concatenate(views, axis=-1)
    y = _matmul(
        patches.reshape(b * ho * wo, kh * kw * cin),
        w.reshape(kh * kw * cin, cout),
        (1, 0),
        spec.precision,
        x.dtype,
    )
    return y.reshape(b, ho, wo, cout)


def _cpu_dx(spec: _ConvSpec, x: Array, w: Array, g: Array) -> Array:
    if spec.dx == "xla":
        return _ref_bwd(spec, x, w, g)[0]
    kh, kw, cin, cout = w.shape
    b, ho, wo, _ = g.shape
    # dcols[n, (i, j, c)] = sum_o g[n, o] w[i, j, c, o]; then col2im.
    dcols = _matmul(
        g.reshape(b * ho * wo, cout),
        w.reshape(kh * kw * cin, cout),
        (1, 1),
        spec.precision,
        x.dtype,
    )
    dcols = dcols.reshape(b, ho, wo, kh * kw, cin)
    parts = [dcols[:, :, :, k, :] for k in range(kh * kw)]
    return _scatter_views(parts, x.shape, kh, kw, spec)


def _cpu_dw(spec: _ConvSpec, x: Array, w: Array, g: Array) -> Array:
    if spec.dw == "xla":
        return _ref_bwd(spec, x, w, g)[1]
    kh, kw, cin, cout = w.shape
    b, ho, wo, _ = g.shape
    n = b * ho * wo
    g2 = g.reshape(n, cout)
    if spec.dw == "im2col_t":
        # Patches built channel-major, [KH*KW*Cin, N]: each view is then a copy of
        # contiguous rows, and the product is a plain row-major [K, N] @ [N, Cout],
        # which XLA:CPU runs ~2x faster than contracting a [N, K] matrix's dim 0.
        xt = jnp.transpose(x, (3, 0, 1, 2))
        views, _, _ = _shifted_views_cfirst(xt, kh, kw, spec)
        patches_t = views[0] if len(views) == 1 else jnp.stack(views)
        dw = _matmul(patches_t.reshape(kh * kw * cin, n), g2, (1, 0), spec.precision, w.dtype)
        return dw.reshape(kh, kw, cin, cout)
    views, _, _ = _shifted_views(x, kh, kw, spec)
    if spec.dw == "im2col" or len(views) == 1:
        patches = views[0] if len(views) == 1 else jnp.concatenate(views, axis=-1)
        dw = _matmul(patches.reshape(n, kh * kw * cin), g2, (0, 0), spec.precision, w.dtype)
        return dw.reshape(kh, kw, cin, cout)
    # "offsets": one [Cin, Cout] product per kernel offset, no patch matrix.
    dws = [_matmul(v.reshape(n, cin), g2, (0, 0), spec.precision, w.dtype) for v in views]
    return jnp.stack(dws).reshape(kh, kw, cin, cout)


def _cpu_bwd(spec: _ConvSpec, x: Array, w: Array, g: Array) -> tuple[Array, Array]:
    if spec.dx == "xla" and spec.dw == "xla":
        return _ref_bwd(spec, x, w, g)
    return _cpu_dx(spec, x, w, g), _cpu_dw(spec, x, w, g)


def _in_fp32(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Runs a CPU kernel in fp32 for half-precision operands, casting results back.

    Wraps every pure-XLA strategy: XLA:CPU's half-precision convolutions are no faster than
    its fp32 ones, and the patch matrices these formulations build cost more than the bf16 dots
    save. Wraps oneDNN's kernels as "onednn_f32", for CPUs without bf16 convolutions (AVX2-only,
    measured faster than XLA's bf16 in ``bench/results/train_cpu.md``); "onednn" runs bf16
    natively where the CPU can (AVX-512 bf16 or AMX). Converting costs one elementwise pass.
    Values are at least as accurate as bf16 arithmetic (fp32 accumulation, one final rounding).
    """

    @functools.wraps(fn)
    def wrapped(spec: _ConvSpec, *args: Array) -> Any:
        dtype = args[0].dtype
        if dtype not in (jnp.bfloat16, jnp.float16):
            return fn(spec, *args)
        out = fn(spec, *(a.astype(jnp.float32) for a in args))
        return jax.tree.map(lambda o: o.astype(dtype), out)

    return wrapped


# ----------------------------------------------------------------------------
# oneDNN (estimax.ops.native): in the operands' dtype where the CPU has the kernel ("onednn"), else
# its fp32 kernel on operands cast up ("onednn_f32", through _in_fp32).


def _onednn_call(
    kind: str, out_shape: Sequence[int], dtype: Any, a: Array, b: Array, spec: _ConvSpec
) -> Array:
    # oneDNN sizes outputs as XLA does, out = (in + lo + hi - k) // stride + 1, so the pads
    # pass through unchanged.
    (pt, pb), (pl, pr) = ((np.int64(lo), np.int64(hi)) for lo, hi in spec.pads)
    call = jax.ffi.ffi_call(
        f"estimax_onednn_conv_{kind}",
        jax.ShapeDtypeStruct(tuple(out_shape), dtype),
        vmap_method="sequential",
    )
    out = call(
        a, b, sh=np.int64(spec.strides[0]), sw=np.int64(spec.strides[1]), pt=pt, pb=pb, pl=pl, pr=pr
    )
    # Inside shard_map the result varies over the mesh axes its operands vary over; ffi_call
    # types it as invariant, so say so (the other branch of platform_dependent must match).
    return manual_axes.vary(out, manual_axes.varying(a, b))


def _onednn_fwd(spec: _ConvSpec, x: Array, w: Array) -> Array:
    kh, kw, _, cout = w.shape
    (sh, sw), ((pt, pb), (pl, pr)) = spec.strides, spec.pads
    ho = _out_size(x.shape[1], kh, sh, pt, pb)
    wo = _out_size(x.shape[2], kw, sw, pl, pr)
    return _onednn_call("forward", (x.shape[0], ho, wo, cout), x.dtype, x, w, spec)


def _onednn_dx(spec: _ConvSpec, x: Array, w: Array, g: Array) -> Array:
    return _onednn_call("backward_data", x.shape, x.dtype, g.astype(x.dtype), w, spec)


def _onednn_dw(spec: _ConvSpec, x: Array, w: Array, g: Array) -> Array:
    return _onednn_call("backward_weights", w.shape, w.dtype, x, g.astype(w.dtype), spec)


_cpu_fwd_fp32 = _in_fp32(_cpu_fwd)
_cpu_dx_fp32 = _in_fp32(_cpu_dx)
_cpu_dw_fp32 = _in_fp32(_cpu_dw)
_cpu_bwd_fp32 = _in_fp32(_cpu_bwd)


_FWD_KERNELS = {"onednn": _onednn_fwd, "onednn_f32": _in_fp32(_onednn_fwd)}
_DX_KERNELS = {"onednn": _onednn_dx, "onednn_f32": _in_fp32(_onednn_dx)}
_DW_KERNELS = {"onednn": _onednn_dw, "onednn_f32": _in_fp32(_onednn_dw)}


def _cpu_fwd_any(spec: _ConvSpec, x: Array, w: Array) -> Array:
    return _FWD_KERNELS.get(spec.fwd, _cpu_fwd_fp32)(spec, x, w)


def _cpu_bwd_any(spec: _ConvSpec, x: Array, w: Array, g: Array) -> tuple[Array, Array]:
    if spec.dx not in _DX_KERNELS and spec.dw not in _DW_KERNELS:
        return _cpu_bwd_fp32(spec, x, w, g)
    dx = _DX_KERNELS.get(spec.dx, _cpu_dx_fp32)(spec, x, w, g)
    dw = _DW_KERNELS.get(spec.dw, _cpu_dw_fp32)(spec, x, w, g)
    return dx, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _conv(x: Array, w: Array, spec: _ConvSpec) -> Array:
    # Inside shard_map: both branches see (and return) values varying over the same axes.
    axes = manual_axes.varying(x, w)
    x, w = manual_axes.vary((x, w), axes)
    return lax.platform_dependent(
        x,
        w,
        cpu=_typed(functools.partial(_cpu_fwd_any, spec), axes),
        default=_typed(functools.partial(_ref_conv, spec=spec), axes),
    )


def _conv_fwd(x: Array, w: Array, spec: _ConvSpec) -> tuple[Array, tuple[Array, Array]]:
    return _conv(x, w, spec), (x, w)


def _conv_bwd(spec: _ConvSpec, res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    x, w = res
    # Inside shard_map, a replicated filter's gradient is summed over the batch's axes, as
    # JAX's own transpose does (estimax.ops.manual_axes); one psum after either branch.
    axes = manual_axes.varying(x, w, g)
    dx, dw = lax.platform_dependent(
        *manual_axes.vary((x, w, g), axes),
        cpu=_typed(functools.partial(_cpu_bwd_any, spec), axes),
        default=_typed(functools.partial(_ref_bwd, spec), axes),
    )
    return manual_axes.reduce_to(dx, x), manual_axes.reduce_to(dw, w)


def _typed(fn: Callable[..., Any], axes: frozenset[str]) -> Callable[..., Any]:
    """``fn`` with its outputs cast to vary over ``axes`` (every branch the same type)."""
    return lambda *args: manual_axes.vary(fn(*args), axes)


_conv.defvjp(_conv_fwd, _conv_bwd)
