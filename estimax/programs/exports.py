"""A program's ``--export_dir``: publishing the trained model, the images it is checked with, its
tolerance, and the class names of the converter's manifest."""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING, Any

import fsspec
from absl import logging

from estimax.programs.cli import UsageError

if TYPE_CHECKING:
    from estimax.programs.job import Job


def export(est: Any, job: Job) -> str:
    """``--export_dir``: publishes the latest checkpoint as the next numbered version there.

    The layout TensorFlow Serving and ``estimax serve --model_base_path`` read
    (``export_dir/1``, ``export_dir/2``...), checked against ``Estimator.predict`` first.
    Returns the version's path.
    """
    from estimax import export

    logging.info("Starting to export model.")
    if job.loop.export_dir is None:
        raise ValueError("export() needs --export_dir.")
    rtol, atol = job.export_tolerance
    path = export.export_version(
        est,
        job.loop.export_dir,
        serving_input=job.serving,
        preprocessing=job.preprocessing,
        check_inputs=job.check_inputs() if job.check_inputs else None,
        rtol=rtol,
        atol=atol,
        eval_preprocess=job.eval_preprocess,
        class_names=job.class_names() if job.class_names else None,
    )
    logging.info("Exported the model to %s", path)
    return path


def export_tolerance(precision: str) -> tuple[float, float]:
    """``(rtol, atol)`` between an export and ``Estimator.predict`` for a compute dtype.

    In bf16 the two round differently: predict may run estimax's oneDNN kernels, the export
    XLA's own convolutions (it must not need the library).
    """
    return (0.0, 2e-2) if precision == "bfloat16" else (1e-3, 1e-4)


def sample_images(data_dir: str | None, count: int = 8) -> list[bytes] | None:
    """``count`` encoded images of ``validation-*`` in ``data_dir``, drawn across classes
    (``estimax.export.check_images``); None: fake data."""
    if data_dir is None:
        return None
    from estimax import export

    return export.check_images(data_dir, count) or None


def image_export(
    data_dir: str | None, label_offset: int, num_classes: int, precision: str
) -> dict[str, Any]:
    """The ``Job`` fields of an ImageNet-style program's export: check images across classes
    from ``data_dir``, the manifest's class names (``manifest_class_names``), the tolerance.

    The manifest is read now, when the program builds its job: a label outside the model's
    classes stops the program here, in one line, not at the export after training.

    Raises:
      UsageError: the manifest gives a class a label the model has no class for.
    """
    names = manifest_class_names(data_dir, label_offset, num_classes, strict=True)
    return {
        "check_inputs": lambda: sample_images(data_dir),
        "class_names": lambda: names,
        "export_tolerance": export_tolerance(precision),
    }


def manifest_class_names(
    data_dir: str | None, label_offset: int, num_classes: int, strict: bool = False
) -> list[str] | None:
    """The class names of ``data_dir``'s ``estimax-convert`` manifest, by the model's class id.

    ``label_offset``: class id = the file's label - ``label_offset``. Ids no class folder maps to
    (ImageNet's 1000 classes trained on a 10-class folder, Inception's background logit) are
    named ``""``. None, with a warning where there is a manifest, when the names cannot be this
    model's: the export is then published without them rather than lose the trained model.

    Args:
      data_dir: the converter's output (local or fsspec URL); None: fake data, no names.
      label_offset: see above.
      num_classes: the model's classes (logits).
      strict: before training: a label outside the model's classes is a UsageError (the data
        holds labels the model cannot learn) rather than a warning.

    Raises:
      UsageError: with ``strict``, a label outside ``label_offset .. label_offset +
        num_classes - 1``.
    """
    if data_dir is None:
        return None
    path = posixpath.join(data_dir, "manifest.json")
    try:
        label_map = _manifest_labels(path)
    except FileNotFoundError:
        return None  # TFRecords of another converter: nothing names the classes
    except (OSError, ValueError) as e:
        logging.warning("Exporting without class names: %s", e)
        return None
    # Checked before any list is sized by a label: a damaged label (10**12) is a MemoryError.
    outside = {n: v for n, v in label_map.items() if not 0 <= v - label_offset < num_classes}
    if outside:
        name, label = min(outside.items(), key=lambda item: abs(item[1]))
        why = (
            f"{path} gives class {name[:60]!r} the label {_short_int(label)}, outside the "
            "model's "
            f"{num_classes} classes (labels {label_offset}..{label_offset + num_classes - 1})"
            + (f" and {len(outside) - 1} more" if len(outside) > 1 else "")
        )
        if strict:
            raise UsageError(
                f"--data_dir={data_dir}: {why}: give the model as many classes as the "
                "converter wrote, or convert the classes this model has"
            )
        logging.warning("Exporting without class names: %s", why)
        return None
    names = [""] * num_classes
    for name, label in label_map.items():
        names[label - label_offset] = name
    return names


def _short_int(value: int) -> str:
    """``value`` for a log line: a damaged label can have hundreds of digits."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"


def _manifest_labels(path: str) -> dict[str, int]:
    """``label_map`` of an ``estimax-convert`` manifest: class name -> label (an integer).

    Raises:
      FileNotFoundError: there is none. ValueError: it is not one (or damaged).
    """
    from estimax import storage
    from estimax.export.record import MANIFEST_FORMAT

    fs, root = fsspec.core.url_to_fs(path)
    if not fs.exists(root):
        raise FileNotFoundError(path)
    with fs.open(root, "rb") as f:
        try:
            data = storage.load_json(f.read())
        except ValueError as e:
            raise ValueError(f"{path} is not JSON ({e})") from None
    label_map = data.get("label_map") if isinstance(data, dict) else None
    if not isinstance(label_map, dict) or not label_map or data.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: not an estimax-convert manifest with a label_map")
    for name, label in label_map.items():
        if type(label) is not int:
            raise ValueError(
                f"{path}: the label of {name[:60]!r} is {str(label)[:40]}, not a number"
            )
    if len(set(label_map.values())) < len(label_map):
        raise ValueError(f"{path}: two classes have one label")
    return label_map
