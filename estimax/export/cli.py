"""The ``estimax`` subcommands that use a published version without serving it.

    estimax predict --model_base_path=DIR image1.jpg image2.png
    estimax export-check --model_base_path=DIR [--model_version=N]
    estimax export-savedmodel --model_base_path=DIR --output_dir=OUT     (estimax[tf])
    estimax export-onnx --model_base_path=DIR --output=model.onnx        (estimax[onnx])

Bad flags or paths print one line and exit non-zero (``estimax.command`` runs them).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from estimax.export.servable import Servable
from estimax.export.versions import check_version, list_versions


class Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless it says its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, "", argparse.SUPPRESS):
            return text
        return super()._get_help_string(action) or text


def add_parsers(sub: Any) -> None:
    """Adds ``predict``, ``export-check``, ``export-savedmodel`` and ``export-onnx`` to ``sub``."""
    predict = sub.add_parser(
        "predict",
        help="classify image files with a version (and name them)",
        formatter_class=Defaults,
    )
    predict.add_argument(
        "--model_base_path", required=True, help="folder (or URL) of numeric versions"
    )
    predict.add_argument(
        "--model_version", type=int, default=None, help="the version (default: the newest)"
    )
    predict.add_argument("--top_k", type=int, default=5, help="classes printed per image")
    predict.add_argument("images", nargs="+", help="JPEG or PNG files")

    check = sub.add_parser(
        "export-check",
        help="rerun a version's parity examples on this machine",
        formatter_class=Defaults,
    )
    check.add_argument("--model_base_path", required=True, help="folder of numeric versions")
    check.add_argument(
        "--model_version", type=int, default=None, help="the version (default: the newest)"
    )

    _add_format_commands(sub)


def _add_format_commands(sub: Any) -> None:
    """``export-savedmodel`` and ``export-onnx``: a version in another serving format."""
    # estimax.export.formats.savedmodel / onnx_export: need the estimax[tf] / estimax[onnx] extras.
    for name, what, output, module in (
        (
            "export-savedmodel",
            "a TF SavedModel (estimax[tf])",
            ("--output_dir", "the SavedModel to write"),
            "savedmodel",
        ),
        (
            # Image preprocessing stays the client's job (onnx_export's docstring).
            "export-onnx",
            "an ONNX model (estimax[onnx])",
            ("--output", "the .onnx file to write"),
            "onnx_export",
        ),
    ):
        export = sub.add_parser(name, help=f"a version -> {what}", formatter_class=Defaults)
        export.add_argument(
            "--model_base_path", required=True, help="folder (or URL) of numeric versions"
        )
        export.add_argument(
            "--model_version", type=int, default=None, help="the version (default: the newest)"
        )
        export.add_argument(
            output[0], required=True, help=f"{output[1]} (new; parents are created)"
        )
        export.add_argument(
            "--atol", default=None, help=f"see python -m estimax.export.formats.{module} -h"
        )


def version_dir(base: str, version: int | None) -> tuple[str, int]:
    """``base``'s folder of ``version`` (default: the newest) and its number."""
    versions = list_versions(base)
    if not versions:
        raise FileNotFoundError(
            f"--model_base_path={base} has no published version "
            "(numeric folders with serving.json or signature.json)"
        )
    if version is None:
        version = versions[-1]
    elif version not in versions:
        raise FileNotFoundError(
            f"--model_version={version} is not under {base} (versions: {versions})"
        )
    return f"{base.rstrip('/')}/{version}", version


def predict(args: argparse.Namespace) -> int:
    """Prints one JSON line per image: its class and the top-k probabilities."""
    path, version = version_dir(args.model_base_path, args.model_version)
    servable = Servable(path, version)
    if servable.preprocessing is None:
        raise ValueError(
            f"{path} takes arrays, not images (it was exported without "
            "preprocessing); send arrays to the server instead"
        )
    images = []
    for name in args.images:
        with open(name, "rb") as f:  # FileNotFoundError names the file
            images.append(f.read())
    outputs = servable.predict_images(images)
    probabilities = outputs.get("probabilities")
    for i, name in enumerate(args.images):
        line: dict = {"image": name, "model_version": version}
        for key, value in outputs.items():
            if key != "probabilities":
                line[key] = np.asarray(value[i]).tolist()
        if probabilities is not None:
            # [class id, probability] (and the class's name when the export has them).
            top = np.argsort(-probabilities[i], kind="stable")[: args.top_k]
            line["top_k"] = [
                [int(c), float(probabilities[i][c])]
                + ([str(servable.class_names[c])] if servable.class_names is not None else [])
                for c in top
            ]
        print(json.dumps(line))
    return 0


def export_check(args: argparse.Namespace) -> int:
    """Reruns a version's stored examples; exit 1 beyond the tolerance."""
    path, _ = version_dir(args.model_base_path, args.model_version)
    count, diffs = check_version(path)
    print(
        f"export-check: {path}: {count} examples match "
        + ", ".join(f"{k} (max |diff| {v:.3g})" for k, v in diffs.items())
    )
    return 0


def export_savedmodel(args: argparse.Namespace) -> int:
    """A version as a TensorFlow SavedModel (``estimax.export.formats.savedmodel``)."""
    from estimax.export.formats import savedmodel

    path, _ = version_dir(args.model_base_path, args.model_version)
    argv = [f"--export_dir={path}", f"--output_dir={args.output_dir}"]
    return savedmodel.main(argv + ([f"--atol={args.atol}"] if args.atol else []))


def export_onnx(args: argparse.Namespace) -> int:
    """A version as an ONNX model (``estimax.export.formats.onnx_export``)."""
    from estimax.export.formats import onnx_export

    path, _ = version_dir(args.model_base_path, args.model_version)
    argv = [f"--export_dir={path}", f"--output={args.output}"]
    return onnx_export.main(argv + ([f"--atol={args.atol}"] if args.atol else []))


# What ``estimax.command`` runs for each subcommand added here.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "predict": predict,
    "export-check": export_check,
    "export-savedmodel": export_savedmodel,
    "export-onnx": export_onnx,
}
