"""An estimax export -> an ONNX model for ONNX Runtime (``estimax export-onnx``).

Needs the ``estimax[onnx]`` extra (``onnx`` and ``onnxruntime``). ::

    estimax export-onnx --model_base_path=models/resnet --output=onnx/resnet.onnx
    python -m estimax.export.formats.onnx_export --export_dir=models/resnet/3 --output=resnet.onnx

The input is one version of an estimax export published with check inputs
(``export_check.json``); no model code is needed. The network is the export's own StableHLO
translated op by op (``estimax.export.formats.stablehlo_onnx``: why no converter library does
it), with the weights as initializers and a dynamic batch dimension. Inputs and outputs keep the
export's names and declared dtypes (``input`` for a single unnamed tensor; nested names joined
with ``/``; an int64 input the model computes in int32, as JAX does without its 64-bit mode, is
cast in the graph); a bfloat16 computation runs in float32 (ONNX Runtime's CPU has no bfloat16
convolutions).

**Image preprocessing is the client's job**: ONNX has no JPEG decoder, so the model takes the
preprocessed tensor (e.g. uint8 ``[batch, 224, 224, 3]`` for ``resnet_eval``), and the recipe
the export records is written into the model's metadata (``estimax.preprocessing``, the
``serving.json`` record) and printed by the command. ``estimax.export.preprocess.from_spec``
of that record is estimax's own implementation of it.

The model is written aside, loaded by ``onnxruntime`` and run on the export's check inputs (the
check images preprocessed by estimax); it is moved into place only if its integer outputs
(``classes``) equal estimax's and its float outputs are within ``--atol`` (default: the export's
own check tolerance, ``export_check.json``'s ``atol``, 1e-4 for float32) plus its ``rtol``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from estimax.export.formats import common as export_formats

__all__ = ["OnnxCheckError", "export_onnx", "main"]


class OnnxCheckError(AssertionError):
    """The ONNX model's predictions differ from estimax's on the export's check inputs."""


def _graph_io(export: dict[str, Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """(weights, inputs, outputs) of the module: the arguments it kept, in its order."""
    import jax

    inputs, outputs = export_formats.io_specs(export)
    weights = jax.tree.leaves(export["variables"])
    kept = export["exported"].module_kept_var_idx
    return (
        [np.asarray(weights[i]) for i in kept if i < len(weights)],
        [inputs[i - len(weights)] for i in kept if i >= len(weights)],
        outputs,
    )


def _with_top_k(model: Any, k: int, dtype: Any) -> None:
    """Adds ``top_k_classes``/``top_k_probabilities`` as the server computes them."""
    from onnx import TensorProto, helper

    graph = model.graph
    k_name = "estimax_top_k"
    graph.initializer.append(helper.make_tensor(k_name, TensorProto.INT64, [1], [k]))
    graph.node.extend(
        [
            helper.make_node(
                "TopK", ["probabilities", k_name], ["top_k_probabilities", "top_k_index"], axis=1
            ),
            helper.make_node("Cast", ["top_k_index"], ["top_k_classes"], to=TensorProto.INT32),
        ]
    )
    for name, elem in (
        ("top_k_classes", TensorProto.INT32),
        ("top_k_probabilities", helper.np_dtype_to_tensor_dtype(np.dtype(dtype))),
    ):
        graph.output.append(helper.make_tensor_value_info(name, elem, None))


def convert(export: dict[str, Any]) -> Any:
    """The ONNX model of a loaded export (see the module docstring)."""
    from estimax.export.formats import stablehlo_onnx

    exported = export["exported"]
    weights, inputs, outputs = _graph_io(export)
    model = stablehlo_onnx.to_onnx(
        exported.mlir_module(), exported.platforms, weights, inputs, outputs
    )
    top_k = export["spec"].get("top_k")
    names = [name for name, _ in outputs]
    if top_k is not None and "probabilities" in names:
        probabilities = exported.out_avals[names.index("probabilities")]
        _with_top_k(model, min(int(top_k), int(probabilities.shape[-1])), probabilities.dtype)
    preprocessing = export["spec"].get("preprocessing")
    model.producer_name = "estimax"
    # The whole serving.json too: what else the export records (e.g. class names) for clients.
    meta = {
        "estimax.preprocessing": json.dumps(preprocessing),
        "estimax.serving": json.dumps(export["spec"]),
    }
    for key, value in meta.items():
        model.metadata_props.add(key=key, value=value)
    return model


def export_onnx(export_dir: str, output: str, *, atol: float | None = None) -> dict[str, Any]:
    """Writes ``output`` (an ONNX model) from the estimax export version ``export_dir``.

    Returns:
      ``{"output", "inputs", "preprocessing", "max_diff", "checked"}`` for the caller to report.

    Raises:
      FileNotFoundError: not an estimax export with check inputs.
      FileExistsError: ``output`` exists.
      stablehlo_onnx.UnsupportedOpError: the export uses an op with no ONNX translation.
      OnnxCheckError: ONNX Runtime's answers differ from estimax's (nothing written).
    """
    import onnxruntime as ort

    if os.path.exists(output):
        raise FileExistsError(f"{output} exists: give a new --output")
    export = export_formats.load_export(export_dir)
    model = convert(export)
    _, inputs, _ = _graph_io(export)
    features = export_formats.check_features(export)
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=".onnx-", dir=parent)
    os.close(fd)
    try:
        with open(staging, "wb") as f:
            f.write(model.SerializeToString())
        try:
            session = ort.InferenceSession(staging, providers=["CPUExecutionProvider"])
            names = [o.name for o in session.get_outputs()]
            feed = {i.name: features[i.name] for i in session.get_inputs()}
            got = dict(zip(names, session.run(None, feed), strict=True))
        except Exception as e:  # noqa: BLE001 - ONNX Runtime's errors have no common base
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise OnnxCheckError(f"ONNX Runtime cannot run the model: {first}") from None
        worst = export_formats.compare(got, export, atol, "ONNX Runtime", OnnxCheckError)
        os.replace(staging, output)
    except BaseException:
        if os.path.exists(staging):
            os.remove(staging)
        raise
    return {
        "output": output,
        "inputs": inputs,
        "preprocessing": export["spec"].get("preprocessing"),
        "max_diff": worst,
        "checked": len(next(iter(features.values()))),
    }


def describe(result: dict[str, Any]) -> str:
    """What the command prints: the file, its inputs, and whose job the preprocessing is."""
    inputs = ", ".join(
        f"{name} {np.dtype(dtype).name}[{', '.join(str(s or 'batch') for s in shape)}]"
        for name, dtype, shape in result["inputs"]
    )
    lines = [
        f"wrote the ONNX model {result['output']} (inputs: {inputs}; checked with onnxruntime "
        f"on {result['checked']} check inputs: same classes, max |diff| {result['max_diff']:.2g})"
    ]
    pre = result["preprocessing"]
    if pre:
        lines.append(
            f"image preprocessing is the client's job (not in the graph): {pre['name']} "
            f"v{pre['version']} {json.dumps(pre['params'])}; the model's metadata "
            "'estimax.preprocessing' records it (estimax.export.preprocess.from_spec runs it)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m estimax.export.formats.onnx_export``: the command line; returns the exit code."""
    from estimax.export.formats.stablehlo_onnx import UnsupportedOpError

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export_dir", required=True, help="an estimax export version directory")
    parser.add_argument("--output", required=True, help="the .onnx file to write (new)")
    parser.add_argument(
        "--atol",
        type=float,
        default=None,
        help="largest |difference| of a float output vs estimax allowed (default: the "
        "export's own check tolerance, export_check.json's atol)",
    )
    args = parser.parse_args(argv)
    try:
        result = export_onnx(args.export_dir, args.output, atol=args.atol)
    except ImportError as e:
        print(f"export-onnx: error: {e}: install the estimax[onnx] extra", file=sys.stderr)
        return 2
    except UnsupportedOpError as e:
        print(f"export-onnx: error: {args.export_dir}: {e}; not written", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError, ValueError, OnnxCheckError) as e:
        print(f"export-onnx: error: {e}", file=sys.stderr)
        return 2
    print(describe(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
