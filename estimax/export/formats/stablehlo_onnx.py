"""An export's StableHLO (``model.jaxexport``) as an ONNX graph, without the model's code.

Why written here: no maintained converter takes a serialized ``jax.export`` artifact. Measured
(2026-11-25, jax 0.10.2): ``jax2onnx`` 0.17.1 stops at ``call_exported`` ("No plugins registered
for primitive 'call_exported'") on every export, and from the model code it converted a Dense/
LayerNorm/GELU model but not ResNet or the MNIST CNN (its MaxPool nodes are refused by ONNX
Runtime: "Unsupported pooling size") nor Inception (its avg_pool patch raises a TypeError); it
also pins ``orbax-checkpoint<0.11.37`` against estimax's 0.12.8. ``tf2onnx`` 1.17 on the SavedModel
``estimax export-savedmodel`` writes: "pass1 convert failed for name:
StatefulPartitionedCall/XlaCallModule" (it has no handler for that op, which is the whole network
of a jax2tf SavedModel). So the module is walked op by op with JAX's own MLIR bindings and each
StableHLO op becomes its ONNX equivalent.

What it does: the export's weights become initializers (and every computation on weights alone
is folded with numpy: batch-norm scales, transposed kernels); the platform switch of a
multi-platform export takes the CPU branch; shape computations on the symbolic batch size become
ONNX shape ops, so the batch stays dynamic. An op without an ONNX equivalent here is refused
with :class:`UnsupportedOpError` naming it.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from jax.interpreters.mlir import ir, make_ir_context
from jaxlib.mlir.dialects import stablehlo
from onnx import helper, numpy_helper

__all__ = ["OPSET", "UnsupportedOpError", "to_onnx"]

OPSET = 18
IR_VERSION = 10
# Results of folding on weights larger than this stay ONNX ops (the file holds no broadcasts).
_FOLD_LIMIT = 1 << 20

_NP_TYPES = {
    "f16": np.float16,
    "f32": np.float32,
    "f64": np.float64,
    "i1": np.bool_,
    "i8": np.int8,
    "i16": np.int16,
    "i32": np.int32,
    "i64": np.int64,
    "ui8": np.uint8,
    "ui16": np.uint16,
    "ui32": np.uint32,
    "ui64": np.uint64,
}


class UnsupportedOpError(ValueError):
    """The export uses an op (or a form of one) that has no ONNX translation here."""


def _type(value: ir.Value) -> ir.RankedTensorType:
    return ir.RankedTensorType(value.type)


def _dtype(value: ir.Value) -> np.dtype:
    name = str(_type(value).element_type)
    if name == "bf16":  # computed in float32: ONNX Runtime's CPU kernels have no bfloat16 convs
        return np.dtype(np.float32)
    if name not in _NP_TYPES:
        raise UnsupportedOpError(f"element type {name} (ONNX Runtime's CPU kernels need others)")
    return np.dtype(_NP_TYPES[name])


def _shape(value: ir.Value) -> list[Any]:
    """Dimensions, None where dynamic."""
    t = _type(value)
    return [None if t.is_dynamic_dim(i) else t.get_dim_size(i) for i in range(t.rank)]


def _ints(attr: Any) -> list[int]:
    return [int(x) for x in attr]


@dataclasses.dataclass
class Broadcast:
    """A broadcast not yet materialised: ``small`` (a tensor name or numpy value of the result's
    rank, size-1 axes where it repeats) expanded to ``shape``. Elementwise ops beside a full
    operand use ``small`` with ONNX's own broadcasting, so batch-norm scales and the like never
    become activation-sized tensors (measured: ONNX Runtime 1.5x slower on ResNet-50 with them)."""

    small: Any
    shape: Any
    name: str | None = None


class Graph:
    """The ONNX graph being built: nodes, initializers and unique names."""

    def __init__(self) -> None:
        """An empty graph."""
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def fresh(self, hint: str) -> str:
        """A new tensor name."""
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, array: np.ndarray, hint: str = "const") -> str:
        """``array`` as an initializer; returns its name."""
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def tensor(self, x: Any) -> str:
        """The name of ``x`` (a tensor name, a numpy value made an initializer, or a
        ``Broadcast`` materialised once)."""
        if isinstance(x, Broadcast):
            if x.name is None:
                x.name = self.op("Expand", [x.small, self.int64(x.shape)])
            return x.name
        return x if isinstance(x, str) else self.const(np.asarray(x))

    def op(self, op_type: str, inputs: Sequence[Any], n_out: int = 1, **attrs: Any) -> Any:
        """Appends one node; returns its output name (or names, when ``n_out`` > 1)."""
        outputs = [self.fresh(op_type.lower()) for _ in range(n_out)]
        names = ["" if x is None else self.tensor(x) for x in inputs]
        self.nodes.append(helper.make_node(op_type, names, outputs, **attrs))
        return outputs[0] if n_out == 1 else outputs

    def int64(self, x: Any) -> Any:
        """``x`` (a shape or index tensor) as int64, as ONNX's shape inputs want."""
        if isinstance(x, Broadcast):
            x = self.tensor(x)
        if isinstance(x, str):
            return self.op("Cast", [x], to=onnx.TensorProto.INT64)
        return np.asarray(x, np.int64)


class Converter:
    """Interprets a StableHLO module, emitting ONNX nodes (see the module docstring)."""

    def __init__(self, module: ir.Module, platform_index: int):
        """``platform_index``: the branch of the export's platform switch to keep."""
        self.graph = Graph()
        self.scope: Any = {}
        self.platform_index = platform_index
        self.callers: list[Any] = []  # locations of the calls being run (innermost last)
        self.functions = {
            str(ir.StringAttr(f.attributes["sym_name"]).value): f
            for f in module.body.operations
            if f.operation.name == "func.func"
        }

    def call(self, name: str, args: Sequence[Any]) -> list[Any]:
        """Runs function ``name`` on ``args`` (numpy values or tensor names)."""
        func = self.functions[name]
        block = func.regions[0].blocks[0]
        env: dict[Any, Any] = dict(zip(block.arguments, args, strict=True))
        return self.run_block(block, env)

    def run_block(self, block: ir.Block, env: Any) -> list[Any]:
        """Runs the ops of ``block`` with ``env`` (value -> numpy value or tensor name);
        returns the values its terminator returns."""
        for view in block.operations:
            op: Any = view.operation
            self.scope = env  # what a nested region (a case branch) sees
            operands = [env[v] for v in op.operands]
            if op.name in ("func.return", "stablehlo.return"):
                return operands
            handler = _HANDLERS.get(op.name)
            try:
                if handler is None:
                    raise UnsupportedOpError(f"the op {op.name} has no ONNX translation here")
                if op.name in ("func.call", "stablehlo.case"):
                    self.callers.append(op.location)
                    try:
                        results = handler(self, op, operands)
                    finally:
                        self.callers.pop()
                else:
                    results = handler(self, op, operands)
            except UnsupportedOpError as e:
                if getattr(e, "located", False):
                    raise
                where = _where([op.location, *reversed(self.callers)])
                located = UnsupportedOpError(f"{e} ({where})" if where else str(e))
                located.located = True  # type: ignore[attr-defined]
                raise located from None
            for value, result in zip(op.results, results, strict=True):
                env[value] = result
        raise UnsupportedOpError("a block without a return")


_LOC_NAME = re.compile(r'loc\("([^"]*)"')
_LOC_FRAME = re.compile(r'callsite\("([^"]+)"\("([^"]+)":(\d+)')


def _where(locations: Sequence[Any]) -> str:
    """Which layer an op came from, from its MLIR location (JAX's name stack: ``jit(serve)/
    ModelFnModule/TinyBert_0/layer0_q/dot_general``, Flax modules by name) and the first
    source frame (``TinyBert.__call__ at model.py:143``); the nearest enclosing call's when
    the op's own location has none (ops of a private function)."""
    for location in locations:
        text = str(location)
        name = _LOC_NAME.search(text)
        frame = _LOC_FRAME.search(text)
        if not name or "/" not in name.group(1):
            continue
        parts = name.group(1).split("/")[:-1]  # the last part is the primitive
        parts = [p for p in parts if not p.startswith("jit(") and p != "ModelFnModule"]
        layer = "/".join(parts) or "the top level"
        said = f"layer {layer}"
        if frame:
            func, path, line = frame.groups()
            said += f", from {func} at {path.rsplit('/', 1)[-1]}:{line}"
        return said
    return ""


def _known(*xs: Any) -> bool:
    return all(isinstance(x, np.ndarray | np.generic) for x in xs)


def _elementwise(c: Converter, op: Any, xs: list[Any], emit: Callable[[list[Any]], Any]) -> Any:
    """``emit(operands)`` for an elementwise op, with lazy broadcasts left to ONNX's
    broadcasting where an operand of the result's full shape is a real tensor (else the result
    stays a lazy broadcast of the same shape)."""
    out_shape = _shape(op.results[0])
    lazy = [isinstance(x, Broadcast) for x in xs]
    if not any(lazy):
        return emit(xs)
    full = [_shape(v) == out_shape for v in op.operands]
    smalls = [x.small if is_lazy else x for x, is_lazy in zip(xs, lazy, strict=True)]
    if any(f and not is_lazy for f, is_lazy in zip(full, lazy, strict=True)):
        return emit(smalls)
    if all(lazy):
        return Broadcast(emit(smalls), next(x for x in xs if isinstance(x, Broadcast)).shape)
    return emit([c.graph.tensor(x) for x in xs])


def _small(shape: Sequence[Any]) -> bool:
    return None not in shape and int(np.prod(shape, dtype=np.int64)) <= _FOLD_LIMIT


_BINARY: dict[str, tuple[str, Callable[..., Any]]] = {
    "stablehlo.add": ("Add", np.add),
    "stablehlo.subtract": ("Sub", np.subtract),
    "stablehlo.multiply": ("Mul", np.multiply),
    "stablehlo.maximum": ("Max", np.maximum),
    "stablehlo.minimum": ("Min", np.minimum),
    "stablehlo.power": ("Pow", np.power),
}
_UNARY: dict[str, tuple[Sequence[str], Callable[..., Any] | None]] = {
    "stablehlo.exponential": (("Exp",), np.exp),
    "stablehlo.log": (("Log",), np.log),
    "stablehlo.sqrt": (("Sqrt",), np.sqrt),
    "stablehlo.rsqrt": (("Sqrt", "Reciprocal"), lambda x: (1 / np.sqrt(x)).astype(x.dtype)),
    "stablehlo.tanh": (("Tanh",), np.tanh),
    "stablehlo.logistic": (("Sigmoid",), lambda x: (1 / (1 + np.exp(-x))).astype(x.dtype)),
    "stablehlo.negate": (("Neg",), np.negative),
    "stablehlo.abs": (("Abs",), np.abs),
    "stablehlo.floor": (("Floor",), np.floor),
    "stablehlo.ceil": (("Ceil",), np.ceil),
    "stablehlo.round_nearest_even": (("Round",), np.round),
    "stablehlo.sign": (("Sign",), np.sign),
    "stablehlo.sine": (("Sin",), np.sin),
    "stablehlo.cosine": (("Cos",), np.cos),
    "chlo.erf": (("Erf",), None),
}


def _binary(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    onnx_op, fn = _BINARY[op.name]
    if _known(*xs) and _small(_shape(op.results[0])):
        return [np.asarray(fn(*xs)).astype(_dtype(op.results[0]))]
    return [_elementwise(c, op, xs, lambda ys: c.graph.op(onnx_op, ys))]


def _divide(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    dtype = _dtype(op.results[0])
    if _known(*xs) and _small(_shape(op.results[0])):
        if dtype.kind in "iu":  # StableHLO truncates towards zero, as C
            return [(np.sign(xs[0]) * np.sign(xs[1]) * (np.abs(xs[0]) // np.abs(xs[1])))]
        return [np.asarray(xs[0] / xs[1]).astype(dtype)]
    return [_elementwise(c, op, xs, lambda ys: c.graph.op("Div", ys))]


def _logical(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    boolean = _dtype(op.results[0]) == np.bool_
    kind = op.name.split(".")[1]
    if _known(*xs):
        return [{"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}[kind](*xs)]
    name = kind.capitalize() if boolean else f"Bitwise{kind.capitalize()}"
    return [_elementwise(c, op, xs, lambda ys: c.graph.op(name, ys))]


def _not(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    if _known(*xs):
        return [np.logical_not(xs[0]) if xs[0].dtype == np.bool_ else np.invert(xs[0])]
    return [c.graph.op("Not" if _dtype(op.results[0]) == np.bool_ else "BitwiseNot", xs)]


def _unary(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    onnx_ops, fn = _UNARY[op.name]
    if fn is not None and _known(*xs):
        return [np.asarray(fn(xs[0])).astype(_dtype(op.results[0]))]

    def emit(ys: list[Any]) -> Any:
        y = ys[0]
        for name in onnx_ops:
            y = c.graph.op(name, [y])
        return y

    return [_elementwise(c, op, xs, emit)]


_COMPARE = {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal}
_COMPARE |= {"GT": np.greater, "GE": np.greater_equal}
_ONNX_COMPARE = {"EQ": "Equal", "LT": "Less", "LE": "LessOrEqual", "GT": "Greater"}
_ONNX_COMPARE |= {"GE": "GreaterOrEqual"}


def _compare(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    direction = stablehlo.ComparisonDirectionAttr(op.attributes["comparison_direction"]).value
    if _known(*xs):
        return [_COMPARE[direction](*xs)]
    if direction == "NE":
        return [_elementwise(c, op, xs, lambda ys: c.graph.op("Not", [c.graph.op("Equal", ys)]))]
    return [_elementwise(c, op, xs, lambda ys: c.graph.op(_ONNX_COMPARE[direction], ys))]


def _select(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    if _known(*xs):
        return [np.where(*xs)]
    return [_elementwise(c, op, xs, lambda ys: c.graph.op("Where", ys))]


def _clamp(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    low, x, high = xs
    if _known(*xs):
        return [np.clip(x, low, high)]
    return [
        _elementwise(c, op, xs, lambda ys: c.graph.op("Max", [c.graph.op("Min", ys[1:]), ys[0]]))
    ]


def _convert(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    dtype = _dtype(op.results[0])
    if _known(*xs):
        return [np.asarray(xs[0]).astype(dtype)]
    to = helper.np_dtype_to_tensor_dtype(dtype)
    return [_elementwise(c, op, xs, lambda ys: c.graph.op("Cast", ys, to=to))]


def _constant(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    attr: Any = ir.DenseElementsAttr(op.attributes["value"])
    dtype, shape = _dtype(op.results[0]), _shape(op.results[0])
    if attr.is_splat:
        value = attr.get_splat_value()
        scalar = ir.BoolAttr(value).value if dtype == np.bool_ else value.value
        return [np.full(shape, scalar, dtype)]
    if dtype == np.bool_:
        return [np.asarray([bool(attr[i]) for i in range(len(attr))]).reshape(shape)]
    if str(_type(op.results[0]).element_type) == "bf16":
        return [_bf16_values(attr).astype(dtype).reshape(shape)]
    return [np.array(attr, dtype=dtype).reshape(shape)]


def _bf16_values(attr: Any) -> np.ndarray:
    """A bfloat16 array attribute's values (MLIR's Python buffers do not cover bfloat16): from
    its text, printed as numbers or, when large, as hex bytes."""
    import ml_dtypes

    text = str(attr)
    hexed = re.search(r'"0x([0-9A-Fa-f]+)"', text)
    if hexed:
        return np.frombuffer(bytes.fromhex(hexed.group(1)), ml_dtypes.bfloat16)
    body = text[text.index("<") + 1 : text.rindex(">", 0, text.index(":"))]
    values = []
    for token in re.split(r"[\[\],\s]+", body):
        if token.startswith("0x"):  # a special value (inf, nan) printed as its bits
            bits = np.asarray([int(token, 16)], np.uint16)
            values.append(float(bits.view(ml_dtypes.bfloat16)[0]))
        elif token:
            values.append(float(token))
    return np.asarray(values, np.float64)


def _iota(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    shape = _shape(op.results[0])
    dim = ir.IntegerAttr(op.attributes["iota_dimension"]).value
    line = np.arange(shape[dim], dtype=_dtype(op.results[0]))
    view = [1] * len(shape)
    view[dim] = shape[dim]
    return [np.broadcast_to(line.reshape(view), shape).copy()]


def _dynamic_iota(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    dim = ir.IntegerAttr(op.attributes["iota_dimension"]).value
    dtype = _dtype(op.results[0])
    rank = len(_shape(op.results[0]))
    if _known(*xs):
        shape = [int(s) for s in xs[0]]
        line = np.arange(shape[dim], dtype=dtype).reshape(
            [-1 if i == dim else 1 for i in range(rank)]
        )
        return [np.broadcast_to(line, shape).copy()]
    g = c.graph
    shape = g.int64(xs[0])
    size = g.op("Gather", [shape, np.asarray(dim, np.int64)])
    line = g.op("Range", [np.asarray(0, np.int64), size, np.asarray(1, np.int64)])
    view = [-1 if i == dim else 1 for i in range(rank)]
    line = g.op("Reshape", [line, np.asarray(view, np.int64)])
    line = g.op("Cast", [line], to=helper.np_dtype_to_tensor_dtype(dtype))
    return [g.op("Expand", [line, shape])]


def _get_dimension_size(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    dim = ir.IntegerAttr(op.attributes["dimension"]).value
    size = _shape(op.operands[0])[dim]
    if size is not None:
        return [np.asarray(size, np.int32)]
    g = c.graph
    shape = g.op("Shape", [xs[0]])
    size = g.op("Gather", [shape, np.asarray(dim, np.int64)])
    return [g.op("Cast", [size], to=onnx.TensorProto.INT32)]


def _broadcast(c: Converter, op: Any, x: Any, shape: Any) -> Any:
    """``broadcast_in_dim`` of ``x`` to ``shape`` (a list of ints, or a shape tensor)."""
    dims = _ints(op.attributes["broadcast_dimensions"])
    rank = len(_shape(op.results[0]))
    in_shape = _shape(op.operands[0])
    if dims != sorted(dims):
        order = [int(i) for i in np.argsort(dims)]
        x = np.transpose(x, order) if _known(x) else c.graph.op("Transpose", [x], perm=order)
        in_shape, dims = [in_shape[i] for i in order], sorted(dims)
    view = [1] * rank
    for d, size in zip(dims, in_shape, strict=True):
        view[d] = -1 if size is None else size
    static_shape = not isinstance(shape, str)
    if _known(x) and static_shape and _small(list(shape)):
        return np.broadcast_to(np.reshape(x, [v if v != -1 else 1 for v in view]), shape).copy()
    g = c.graph
    if _known(x):
        small = np.reshape(x, view)
    elif view.count(-1) <= 1:
        small = g.op("Reshape", [x, np.asarray(view, np.int64)])
    else:  # several dynamic dims: unsqueeze the new axes instead
        missing = [i for i in range(rank) if i not in dims]
        small = g.op("Unsqueeze", [x, np.asarray(missing, np.int64)])
    if static_shape:  # a dynamic dim here comes from x: Expand keeps it where the target says 1
        shape = np.asarray([1 if d is None else d for d in shape], np.int64)
    return Broadcast(small, shape)


def _broadcast_in_dim(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    return [_broadcast(c, op, xs[0], _shape(op.results[0]))]


def _dynamic_broadcast_in_dim(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    return [_broadcast(c, op, xs[0], xs[1])]


def _reshape(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    shape = _shape(op.results[0]) if len(xs) == 1 else xs[1]
    if _known(*xs) and (len(xs) == 2 or None not in shape):
        return [np.reshape(xs[0], [int(s) for s in shape])]
    return [c.graph.op("Reshape", [xs[0], c.graph.int64(shape)], allowzero=1)]


def _transpose(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    perm = _ints(op.attributes["permutation"])
    if _known(*xs):
        return [np.transpose(xs[0], perm)]
    return [c.graph.op("Transpose", xs, perm=perm)]


def _concatenate(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    axis = ir.IntegerAttr(op.attributes["dimension"]).value
    if _known(*xs):
        return [np.concatenate(xs, axis=axis)]
    return [c.graph.op("Concat", xs, axis=axis)]


def _slice(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    starts = _ints(op.attributes["start_indices"])
    limits = _ints(op.attributes["limit_indices"])
    strides = _ints(op.attributes["strides"])
    if _known(*xs):
        window = zip(starts, limits, strides, strict=True)
        return [xs[0][tuple(slice(s, e, k) for s, e, k in window)]]
    axes = list(range(len(starts)))
    ins = [xs[0], *(np.asarray(v, np.int64) for v in (starts, limits, axes, strides))]
    return [c.graph.op("Slice", ins)]


def _real_dynamic_slice(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    x, starts, limits, strides = xs
    if _known(*xs):
        window = zip(starts, limits, strides, strict=True)
        return [x[tuple(slice(int(s), int(e), int(k)) for s, e, k in window)]]
    g = c.graph
    axes = np.arange(len(_shape(op.operands[0])), dtype=np.int64)
    return [g.op("Slice", [x, g.int64(starts), g.int64(limits), axes, g.int64(strides)])]


def _pad(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    x, value = xs
    low, high = _ints(op.attributes["edge_padding_low"]), _ints(op.attributes["edge_padding_high"])
    if any(_ints(op.attributes["interior_padding"])) or min(low + high) < 0:
        raise UnsupportedOpError("stablehlo.pad with interior or negative padding")
    if _known(*xs) and _small(_shape(op.results[0])):
        return [np.pad(x, list(zip(low, high, strict=True)), constant_values=value)]
    return [c.graph.op("Pad", [x, np.asarray(low + high, np.int64), value])]


def _case(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    if not _known(*xs):
        raise UnsupportedOpError("stablehlo.case on a value known only at run time")
    index = int(xs[0])
    regions = list(op.regions)
    branch = regions[index if 0 <= index < len(regions) else len(regions) - 1]
    return c.run_block(branch.blocks[0], collections.ChainMap({}, c.scope))


def _call(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
    return c.call(callee, xs)


def _custom_call(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    target = ir.StringAttr(op.attributes["call_target_name"]).value
    if target == "shape_assertion":  # checks the batch size is >= 1: ONNX Runtime's shapes do
        return []
    raise UnsupportedOpError(f"the custom call {target!r} (a kernel outside StableHLO)")


def _optimization_barrier(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    return list(xs)


_HANDLERS: dict[str, Callable[[Converter, Any, list[Any]], list[Any]]] = {
    **dict.fromkeys(_BINARY, _binary),
    **dict.fromkeys(_UNARY, _unary),
    "stablehlo.divide": _divide,
    "stablehlo.and": _logical,
    "stablehlo.or": _logical,
    "stablehlo.xor": _logical,
    "stablehlo.not": _not,
    "stablehlo.compare": _compare,
    "stablehlo.select": _select,
    "stablehlo.clamp": _clamp,
    "stablehlo.convert": _convert,
    "stablehlo.constant": _constant,
    "stablehlo.iota": _iota,
    "stablehlo.dynamic_iota": _dynamic_iota,
    "stablehlo.get_dimension_size": _get_dimension_size,
    "stablehlo.broadcast_in_dim": _broadcast_in_dim,
    "stablehlo.dynamic_broadcast_in_dim": _dynamic_broadcast_in_dim,
    "stablehlo.reshape": _reshape,
    "stablehlo.dynamic_reshape": _reshape,
    "stablehlo.transpose": _transpose,
    "stablehlo.concatenate": _concatenate,
    "stablehlo.slice": _slice,
    "stablehlo.real_dynamic_slice": _real_dynamic_slice,
    "stablehlo.pad": _pad,
    "stablehlo.case": _case,
    "func.call": _call,
    "stablehlo.custom_call": _custom_call,
    "stablehlo.optimization_barrier": _optimization_barrier,
}


def _register(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        _HANDLERS[name] = fn
        return fn

    return add


@_register("stablehlo.convolution")
def _convolution(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    dn = stablehlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
    attrs = op.attributes
    rank = len(_shape(op.operands[0]))
    spatial = rank - 2

    def ints(name: str, default: int) -> list[int]:
        return _ints(attrs[name]) if name in attrs else [default] * spatial

    if any(d != 1 for d in ints("lhs_dilation", 1)) or (
        "batch_group_count" in attrs and ir.IntegerAttr(attrs["batch_group_count"]).value != 1
    ):
        raise UnsupportedOpError("stablehlo.convolution with input dilation or batch groups")
    padding = (
        np.asarray(ir.DenseIntElementsAttr(attrs["padding"])).reshape(spatial, 2)
        if "padding" in attrs
        else np.zeros((spatial, 2), np.int64)
    )
    g = c.graph
    in_perm = [dn.input_batch_dimension, dn.input_feature_dimension, *dn.input_spatial_dimensions]
    k_perm = [
        dn.kernel_output_feature_dimension,
        dn.kernel_input_feature_dimension,
        *dn.kernel_spatial_dimensions,
    ]
    out_perm = [
        dn.output_batch_dimension,
        dn.output_feature_dimension,
        *dn.output_spatial_dimensions,
    ]
    x = g.op("Transpose", [xs[0]], perm=in_perm)
    kernel = (
        np.transpose(xs[1], k_perm) if _known(xs[1]) else g.op("Transpose", [xs[1]], perm=k_perm)
    )
    y = g.op(
        "Conv",
        [x, kernel],
        strides=ints("window_strides", 1),
        dilations=ints("rhs_dilation", 1),
        pads=[int(p) for p in padding[:, 0]] + [int(p) for p in padding[:, 1]],
        group=ir.IntegerAttr(attrs["feature_group_count"]).value,
    )
    return [g.op("Transpose", [y], perm=[int(i) for i in np.argsort(out_perm)])]


@_register("stablehlo.dot_general")
def _dot_general(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    dn = stablehlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
    lb, rb = list(dn.lhs_batching_dimensions), list(dn.rhs_batching_dimensions)
    lc, rc = list(dn.lhs_contracting_dimensions), list(dn.rhs_contracting_dimensions)
    lhs_rank, rhs_rank = len(_shape(op.operands[0])), len(_shape(op.operands[1]))
    dtype = _dtype(op.results[0])
    g = c.graph
    if not lb and lc == [lhs_rank - 1] and rc == [0] and rhs_rank == 2:
        out = g.op("MatMul", xs)
    else:  # the general case, as one Einsum: batch dims, lhs free dims, rhs free dims
        letters = iter("abcdefghijklmnopqrstuvwxyz")
        lhs = [next(letters) for _ in range(lhs_rank)]
        rhs = [next(letters) for _ in range(rhs_rank)]
        for a, b in zip(lb + lc, rb + rc, strict=True):
            rhs[b] = lhs[a]
        out_letters = [lhs[d] for d in lb]
        out_letters += [lhs[d] for d in range(lhs_rank) if d not in lb + lc]
        out_letters += [rhs[d] for d in range(rhs_rank) if d not in rb + rc]
        equation = f"{''.join(lhs)},{''.join(rhs)}->{''.join(out_letters)}"
        out = g.op("Einsum", xs, equation=equation)
    if _dtype(op.operands[0]) != dtype:
        out = g.op("Cast", [out], to=helper.np_dtype_to_tensor_dtype(dtype))
    return [out]


def _body_ops(op: Any) -> list[Any]:
    return [o.operation for o in op.regions[0].blocks[0].operations]


_REDUCERS = {
    "stablehlo.add": ("ReduceSum", 0),
    "stablehlo.maximum": ("ReduceMax", -np.inf),
    "stablehlo.minimum": ("ReduceMin", np.inf),
    "stablehlo.multiply": ("ReduceProd", 1),
    "stablehlo.and": ("ReduceMin", True),
    "stablehlo.or": ("ReduceMax", False),
}


@_register("stablehlo.reduce")
def _reduce(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    axes = np.asarray(_ints(op.attributes["dimensions"]), np.int64)
    body = [o.name for o in _body_ops(op)]
    g = c.graph
    if len(xs) == 4:  # (values, indices) with inits: an argmax or argmin over one axis
        direction = next(
            (
                stablehlo.ComparisonDirectionAttr(o.attributes["comparison_direction"]).value
                for o in _body_ops(op)
                if o.name == "stablehlo.compare"
            ),
            None,
        )
        if len(axes) != 1 or direction not in ("GT", "LT"):
            raise UnsupportedOpError("a stablehlo.reduce of two operands that is not an argmax")
        kind = "ArgMax" if direction == "GT" else "ArgMin"
        index = g.op(kind, [xs[0]], axis=int(axes[0]), keepdims=0, select_last_index=0)
        value = g.op(kind.replace("Arg", "Reduce"), [xs[0], axes], keepdims=0)
        to = helper.np_dtype_to_tensor_dtype(_dtype(op.results[1]))
        return [value, g.op("Cast", [index], to=to)]
    if len(xs) != 2 or len(body) != 2 or body[0] not in _REDUCERS:
        raise UnsupportedOpError(f"a stablehlo.reduce whose body is {body}")
    name, identity = _REDUCERS[body[0]]
    x, init = xs
    boolean = _dtype(op.results[0]) == np.bool_
    if boolean:  # all/any (and/or) of booleans as min/max of 0/1
        x = g.op("Cast", [x], to=onnx.TensorProto.INT32)
    out = g.op(name, [x, axes], keepdims=0)
    if boolean:
        out = g.op("Cast", [out], to=onnx.TensorProto.BOOL)
    if not (_known(init) and np.asarray(init) == np.asarray(identity).astype(init.dtype)):
        combine = _BINARY[body[0]][0] if body[0] in _BINARY else body[0].split(".")[1].title()
        out = g.op(combine, [out, init])
    return [out]


@_register("stablehlo.reduce_window")
def _reduce_window(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    attrs = op.attributes
    window = _ints(attrs["window_dimensions"])
    rank = len(window)
    strides = _ints(attrs["window_strides"]) if "window_strides" in attrs else [1] * rank
    padding = (
        np.asarray(ir.DenseIntElementsAttr(attrs["padding"])).reshape(rank, 2)
        if "padding" in attrs
        else np.zeros((rank, 2), np.int64)
    )
    for name in ("base_dilations", "window_dilations"):
        if name in attrs and any(d != 1 for d in _ints(attrs[name])):
            raise UnsupportedOpError(f"stablehlo.reduce_window with {name}")
    body = [o.name for o in _body_ops(op)]
    if len(xs) != 2 or body[0] not in ("stablehlo.maximum", "stablehlo.add"):
        raise UnsupportedOpError(f"a stablehlo.reduce_window whose body is {body}")
    pooled = [d for d in range(rank) if window[d] > 1 or strides[d] > 1 or padding[d].any()]
    plain = [d for d in range(rank) if d not in pooled]
    if len(plain) < 2 or not pooled:
        raise UnsupportedOpError("a stablehlo.reduce_window over all but one axis")
    # ONNX pools over [N, C, spatial...]: one untouched axis as N, the others folded into C.
    perm = [plain[0], *plain[1:], *pooled]
    g = c.graph
    x = g.op("Transpose", [xs[0]], perm=perm)
    shape = g.op("Shape", [x])
    merged = np.asarray([0, -1, *([0] * len(pooled))], np.int64)
    x = g.op("Reshape", [x, merged]) if len(plain) > 2 else x
    attrs_: dict[str, Any] = {
        "kernel_shape": [window[d] for d in pooled],
        "strides": [strides[d] for d in pooled],
        "pads": [int(padding[d][0]) for d in pooled] + [int(padding[d][1]) for d in pooled],
    }
    if body[0] == "stablehlo.maximum":
        y = g.op("MaxPool", [x], **attrs_)
    else:  # a sum: the mean over the padded window, times its size
        y = g.op("AveragePool", [x], count_include_pad=1, **attrs_)
        y = g.op("Mul", [y, np.asarray(np.prod(attrs_["kernel_shape"]), _dtype(op.results[0]))])
    if len(plain) > 2:
        head = g.op("Slice", [shape, np.asarray([0]), np.asarray([len(plain)])])
        tail = g.op("Slice", [g.op("Shape", [y]), np.asarray([2]), np.asarray([2 + len(pooled)])])
        y = g.op("Reshape", [y, g.op("Concat", [head, tail], axis=0)])
    return [g.op("Transpose", [y], perm=[int(i) for i in np.argsort(perm)])]


@_register("stablehlo.gather")
@_register("stablehlo.dynamic_gather")
def _gather(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    """A slice when the start is a constant and every operand axis is kept; else a gather of
    points (what embedding lookups and ``x[:, 0]`` lower to) as ONNX GatherND."""
    dn = stablehlo.GatherDimensionNumbers(op.attributes["dimension_numbers"])
    if list(dn.operand_batching_dims) or list(dn.start_indices_batching_dims):
        raise UnsupportedOpError(f"a {op.name} with batching dimensions")
    sliced = _gather_as_slice(c, op, dn, xs)
    if sliced is not None:
        return [sliced]
    return [_gather_points(c, op, dn, xs)]


def _slice_sizes(op: Any, dn: Any, xs: list[Any]) -> list[int | None]:
    """The gather's slice sizes; for ``dynamic_gather``'s run-time sizes, the result's static
    sizes, 1 on collapsed axes, else None (a whole dynamic axis: the batch)."""
    if op.name == "stablehlo.gather":
        return list[int | None](_ints(op.attributes["slice_sizes"]))
    if _known(xs[2]):
        return [int(v) for v in np.ravel(xs[2])]
    rank = len(_shape(op.operands[0]))
    collapsed = [int(d) for d in dn.collapsed_slice_dims]
    kept = [d for d in range(rank) if d not in collapsed]
    offset_dims, out_shape = [int(d) for d in dn.offset_dims], _shape(op.results[0])
    return [out_shape[offset_dims[kept.index(d)]] if d in kept else 1 for d in range(rank)]


def _gather_as_slice(c: Converter, op: Any, dn: Any, xs: list[Any]) -> Any:
    """The gather as an ONNX Slice (and Squeeze), or None when it is not one: one start,
    known when converting (``x[:, -1, 1:3]``)."""
    operand_shape = _shape(op.operands[0])
    start_map = [int(d) for d in dn.start_index_map]
    if not _known(xs[1]) or np.size(xs[1]) != len(start_map):
        return None
    sizes = _slice_sizes(op, dn, xs)
    starts = [0] * len(operand_shape)
    for axis, start in zip(start_map, np.ravel(xs[1]), strict=True):
        starts[axis] = int(start)
    ends = []
    for axis, size in enumerate(sizes):
        limit = operand_shape[axis]
        if size is None:  # a whole dynamic axis
            if axis in start_map:
                return None
            ends.append(np.iinfo(np.int64).max)
            continue
        if limit is not None:
            starts[axis] = min(max(starts[axis], 0), limit - size)
        ends.append(starts[axis] + size)
    g = c.graph
    axes = np.arange(len(starts), dtype=np.int64)
    out = g.op("Slice", [xs[0], np.asarray(starts, np.int64), np.asarray(ends, np.int64), axes])
    collapsed = [int(d) for d in dn.collapsed_slice_dims]
    return g.op("Squeeze", [out, np.asarray(collapsed, np.int64)]) if collapsed else out


def _gather_indices(
    g: Any,
    indices: Any,
    index_shape: list[Any],
    ivd: int,
    operand: Any,
    operand_shape: list[Any],
    starts: list[int],
) -> Any:
    """A gather's indices as GatherND takes them: ``[batch..., K]`` int64 (the index vector
    last, ``ivd`` its axis), K = ``len(starts)``, clamped into ``[0, dim - 1]`` of the indexed
    axes of ``operand`` (its shape read at run time where it is not known)."""
    if _known(indices):
        idx: Any = np.asarray(indices, np.int64)
        idx = idx[..., None] if ivd == len(index_shape) else np.moveaxis(idx, ivd, -1)
    else:
        idx = g.int64(indices)
        if ivd == len(index_shape):
            idx = g.op("Unsqueeze", [idx, np.asarray([-1], np.int64)])
        elif ivd != len(index_shape) - 1:
            order = [a for a in range(len(index_shape)) if a != ivd] + [ivd]
            idx = g.op("Transpose", [idx], perm=order)
    dims = [operand_shape[d] for d in starts]
    if None in dims:
        shape = g.op("Shape", [operand])
        high: Any = g.op(
            "Sub", [g.op("Gather", [shape, np.asarray(starts, np.int64)]), np.int64(1)]
        )
    else:
        high = np.asarray(dims, np.int64) - 1
    if _known(idx, high):
        idx = np.clip(idx, 0, high)
    else:
        idx = g.op("Min", [g.op("Max", [idx, np.zeros([1], np.int64)]), high])
    return idx


def _gather_points(c: Converter, op: Any, dn: Any, xs: list[Any]) -> Any:
    """A gather whose slices are one element along each indexed axis and whole along the others:
    GatherND on the operand with its indexed axes first; indices clamped into the operand as
    StableHLO clamps them (ONNX Runtime refuses indices out of range)."""
    g = c.graph
    operand, indices = xs[0], xs[1]
    operand_shape = _shape(op.operands[0])
    index_shape = _shape(op.operands[1])
    rank = len(operand_shape)
    starts = [int(d) for d in dn.start_index_map]
    collapsed = [int(d) for d in dn.collapsed_slice_dims]
    offset_dims = [int(d) for d in dn.offset_dims]
    sizes = _slice_sizes(op, dn, xs)
    for d in range(rank):
        whole = sizes[d] is None or sizes[d] == operand_shape[d]
        if (d in starts and sizes[d] != 1) or (d not in starts and not whole):
            raise UnsupportedOpError(
                f"a {op.name} of windows (slice sizes {sizes} of {operand_shape}, indexed axes "
                f"{starts}) that ONNX's Gather does not express"
            )
    rest = [d for d in range(rank) if d not in starts]
    perm = starts + rest
    if perm != list(range(rank)):
        operand = (
            np.transpose(operand, perm)
            if _known(operand)
            else g.op("Transpose", [operand], perm=perm)
        )
    ivd = int(dn.index_vector_dim)
    idx = _gather_indices(g, indices, index_shape, ivd, xs[0], operand_shape, starts)
    if _known(operand, idx):
        out: Any = np.asarray(operand)[tuple(np.moveaxis(idx, -1, 0))]
    else:
        out = g.op("GatherND", [operand, idx])
    # out: [batch..., operand axes of `rest`]; the indexed axes not collapsed come back as 1s.
    batch_rank = (len(index_shape) - 1) if ivd < len(index_shape) else len(index_shape)
    trailing = [d for d in range(rank) if d not in collapsed]
    ones = [batch_rank + i for i, d in enumerate(trailing) if d in starts]
    if ones:
        out = (
            np.expand_dims(out, ones)
            if _known(out)
            else g.op("Unsqueeze", [out, np.asarray(ones, np.int64)])
        )
    # The result's axes: the offset dims at offset_dims, the batch dims in the others.
    out_rank = batch_rank + len(trailing)
    batch_positions = [p for p in range(out_rank) if p not in offset_dims]
    order = [
        batch_rank + offset_dims.index(p) if p in offset_dims else batch_positions.index(p)
        for p in range(out_rank)
    ]
    if order != list(range(out_rank)):
        out = np.transpose(out, order) if _known(out) else g.op("Transpose", [out], perm=order)
    return out


@_register("stablehlo.dynamic_slice")
def _dynamic_slice(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    """``lax.dynamic_slice``: the starts clamped into the operand as StableHLO clamps them."""
    x, starts = xs[0], xs[1:]
    sizes = _ints(op.attributes["slice_sizes"])
    dims = _shape(op.operands[0])
    if _known(*xs):
        clamped = [min(max(int(s), 0), d - n) for s, d, n in zip(starts, dims, sizes, strict=True)]
        return [x[tuple(slice(s, s + n) for s, n in zip(clamped, sizes, strict=True))]]
    g = c.graph
    if None in dims:
        limits: Any = g.op("Sub", [g.op("Shape", [x]), np.asarray(sizes, np.int64)])
    else:
        limits = np.asarray(dims, np.int64) - np.asarray(sizes, np.int64)
    if _known(*starts):
        begin: Any = np.asarray([int(s) for s in starts], np.int64)
    else:
        begin = g.op(
            "Concat",
            [g.op("Reshape", [g.int64(s), np.asarray([1], np.int64)]) for s in starts],
            axis=0,
        )
    if _known(begin, limits):
        begin = np.clip(begin, 0, limits)
    else:
        begin = g.op("Min", [g.op("Max", [begin, np.zeros([1], np.int64)]), limits])
    end = (
        g.op("Add", [begin, np.asarray(sizes, np.int64)])
        if isinstance(begin, str)
        else (begin + np.asarray(sizes, np.int64))
    )
    axes = np.arange(len(sizes), dtype=np.int64)
    return [g.op("Slice", [x, begin, end, axes])]


@_register("stablehlo.reduce_precision")
def _reduce_precision(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    """Rounding to fewer bits: nothing for float32's own (8, 23), else through the ONNX type
    of that precision (bfloat16's (8, 7), float16's (5, 10)) and back."""
    bits = (
        ir.IntegerAttr(op.attributes["exponent_bits"]).value,
        ir.IntegerAttr(op.attributes["mantissa_bits"]).value,
    )
    dtype = _dtype(op.results[0])
    own = {np.dtype(np.float32): (8, 23), np.dtype(np.float64): (11, 52)}
    if own.get(dtype) is not None and bits[0] >= own[dtype][0] and bits[1] >= own[dtype][1]:
        return [xs[0]]
    through = {(8, 7): onnx.TensorProto.BFLOAT16, (5, 10): onnx.TensorProto.FLOAT16}.get(bits)
    if through is None:
        raise UnsupportedOpError(f"stablehlo.reduce_precision to {bits} exponent/mantissa bits")
    g = c.graph
    narrow = g.op("Cast", [g.tensor(xs[0])], to=through)
    return [g.op("Cast", [narrow], to=helper.np_dtype_to_tensor_dtype(dtype))]


@_register("stablehlo.remainder")
def _remainder(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    """C's fmod (the sign of the dividend), as StableHLO's remainder."""
    if _known(*xs):
        return [np.fmod(xs[0], xs[1]).astype(_dtype(op.results[0]))]
    return [_elementwise(c, op, xs, lambda ys: c.graph.op("Mod", ys, fmod=1))]


@_register("stablehlo.exponential_minus_one")
def _expm1(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    if _known(*xs):
        return [np.expm1(xs[0]).astype(_dtype(op.results[0]))]
    one = np.asarray(1, _dtype(op.results[0]))
    return [_elementwise(c, op, xs, lambda ys: c.graph.op("Sub", [c.graph.op("Exp", ys), one]))]


@_register("stablehlo.log_plus_one")
def _log1p(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    if _known(*xs):
        return [np.log1p(xs[0]).astype(_dtype(op.results[0]))]
    one = np.asarray(1, _dtype(op.results[0]))
    return [
        _elementwise(c, op, xs, lambda ys: c.graph.op("Log", [c.graph.op("Add", [ys[0], one])]))
    ]


@_register("stablehlo.is_finite")
def _is_finite(c: Converter, op: Any, xs: list[Any]) -> list[Any]:
    if _known(*xs):
        return [np.isfinite(xs[0])]
    g = c.graph

    def emit(ys: list[Any]) -> Any:
        bad = g.op("Or", [g.op("IsInf", ys), g.op("IsNaN", ys)])
        return g.op("Not", [bad])

    return [_elementwise(c, op, xs, emit)]


def to_onnx(
    mlir_text: str,
    platforms: Sequence[str],
    weights: Sequence[np.ndarray],
    inputs: Sequence[tuple[str, np.dtype, Sequence[int | None]]],
    outputs: Sequence[tuple[str, np.dtype]],
) -> onnx.ModelProto:
    """Translates an export's module into an ONNX model (opset ``OPSET``).

    Args:
      mlir_text: ``Exported.mlir_module()``.
      platforms: ``Exported.platforms``: the CPU branch of a platform switch is kept.
      weights: the weight arguments' values, in the module's argument order.
      inputs: ``(name, dtype, shape)`` of the remaining arguments (None: the batch); a dtype
        other than the argument's (int64 for an int32 argument) is cast to it in the graph.
      outputs: ``(name, dtype)`` of each result.

    Raises:
      UnsupportedOpError: an op has no translation here (the message names it).
    """
    lower = [p.lower() for p in platforms]
    with make_ir_context():
        module = ir.Module.parse(mlir_text)
        converter = Converter(module, lower.index("cpu") if "cpu" in lower else 0)
        main = converter.functions["main"]
        n_args = len(main.regions[0].blocks[0].arguments)
        args: list[Any] = [np.asarray(converter.platform_index, np.int32)] * (
            n_args - len(weights) - len(inputs)
        )
        args += [np.asarray(w) for w in weights]
        g = converter.graph
        params = main.regions[0].blocks[0].arguments
        for (name, dtype, _), param in zip(
            inputs, list(params)[n_args - len(inputs) :], strict=True
        ):
            computed = _dtype(param)
            if np.dtype(dtype) == computed:
                args.append(name)
                continue
            # Declared int64 (or float64), computed in int32 (float32) as JAX does without its
            # 64-bit mode: the graph takes what clients send and casts it, as estimax serve.
            cast = f"{name}/as_{computed.name}"
            to = helper.np_dtype_to_tensor_dtype(computed)
            g.nodes.append(helper.make_node("Cast", [name], [cast], to=to))
            args.append(cast)
        results = converter.call("main", args)
    infos = []
    for (name, dtype), result in zip(outputs, results, strict=True):
        g.nodes.append(helper.make_node("Identity", [g.tensor(result)], [name]))
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        infos.append(helper.make_tensor_value_info(name, elem, None))
    graph = helper.make_graph(
        g.nodes,
        "estimax_export",
        [
            helper.make_tensor_value_info(
                name,
                helper.np_dtype_to_tensor_dtype(np.dtype(dtype)),
                [s or "batch" for s in shape],
            )
            for name, dtype, shape in inputs
        ],
        infos,
        initializer=g.initializers,
    )
    # IR version 10 (ONNX 1.16): what ONNX Runtime 1.17 and later load.
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION
    )
