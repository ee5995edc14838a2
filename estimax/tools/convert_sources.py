"""What to convert: the input trees and lists -> labelled image lists per split.

Three inputs, one result (:class:`Dataset`):

* ``imagenet``: the raw ImageNet layout of ``imagenet_to_gcs.py`` (docs/original.md §8.1)::

      <raw_data_dir>/train/n01440764/n01440764_10026.JPEG
      <raw_data_dir>/validation/ILSVRC2012_val_00000001.JPEG
      <raw_data_dir>/synset_labels.txt   # one synset per line, in sorted validation-file order

  labels ``{synset: k + 1 for k, synset in enumerate(sorted(set(val + train synsets)))}``: the
  original's 1-based labels (1..1000).
* ``folder``: ``<dir>/<label>/<image>`` trees (one per split); labels are the sorted label
  directory names (or a labels file's order), 1-based. Images in subfolders of a label directory
  belong to that label (``<dir>/<label>/batch1/<image>``, as Keras'
  ``image_dataset_from_directory`` reads them). The classes are checked: a class without images
  (a folder with none, or a labels-file line no folder has) and a class with images in one split
  only are each one :class:`InputError` naming them, unless allowed (then a warning): either
  would give a label that no training example has, and shift every later label.
* ``csv``: lines ``path_or_url,label`` and a labels file, one label per line: the input of
  ``jpeg_to_tf_record.py`` (§8.2); label = ``labels.index(label) + 1``, synset = the label text.

Training lists are shuffled with ``random.Random(seed)``. The original meant to do this too, but
its ``shuffled_index = range(len(filenames)); random.shuffle(list(shuffled_index))`` shuffled a
copy and returned the files in sorted (i.e. class-by-class) order; ours really shuffles.
Validation lists keep their sorted (or CSV) order, as the original.

Bad input raises :class:`InputError` naming the file (and line); with ``skip_bad`` the offending
entries are left out and returned in ``Dataset.skipped`` (they go to the manifest).
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import posixpath
import random
import re

import fsspec

__all__ = [
    "Dataset",
    "InputError",
    "Item",
    "csv_source",
    "folder_source",
    "imagenet_source",
    "shuffle_train",
]

_SYNSET = re.compile(r"^n\d{8}$")

log = logging.getLogger(__name__)


class InputError(ValueError):
    """The input is wrong (missing file, unknown label, empty split); the message names it."""


@dataclasses.dataclass(frozen=True)
class Item:
    """One input image: its path (or URL), 1-based label and synset (label text)."""

    path: str
    label: int
    synset: str


@dataclasses.dataclass
class Dataset:
    """Labelled images per split.

    Attributes:
      splits: split name ('train', 'validation') -> items, in output order.
      label_map: synset (label text) -> 1-based label.
      skipped: ``{'file': ..., 'reason': ...}`` of inputs left out (only with ``skip_bad``).
    """

    splits: dict[str, list[Item]]
    label_map: dict[str, int]
    skipped: list[dict[str, str]] = dataclasses.field(default_factory=list)


def _fs(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(path)


def _full(fs: fsspec.AbstractFileSystem, p: str, like: str) -> str:
    return p if "://" not in like else fs.unstrip_protocol(p)


def _shown(name: str) -> str:
    """``name`` printable: bytes that are not UTF-8 (which Python's os functions hand over as
    surrogate escapes) as ``\\xNN``."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _check_text(path: str, what: str) -> None:
    """Refuses a name that is not UTF-8 text (Latin-1 bytes, from an old archive or a Windows
    share): class names and file names are written as text into the manifest, the Examples
    (``image/synset``, ``image/filename``), exports and served answers, and bytes that are no
    text cannot be; guessing their encoding would name the class wrongly."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(
            f"{_shown(path)}: the name of this {what} is not UTF-8 (escaped here as \\xNN); "
            "rename it to UTF-8, e.g. convmv -f latin1 -t utf8 -r --notest <dir>"
        ) from None


def _list_dir(path: str) -> tuple[list[str], list[str]]:
    """(sorted subdirectory names, sorted file paths) of ``path``; hidden entries ignored.

    Raises:
      InputError: an entry's name is not UTF-8.
    """
    fs, fs_path = _fs(path)
    dirs, files = [], []
    for entry in fs.ls(fs_path, detail=True):
        name = posixpath.basename(entry["name"].rstrip("/"))
        if name.startswith("."):
            continue
        if entry["type"] == "directory":
            _check_text(posixpath.join(path, name), "folder")
            dirs.append(name)
        else:
            files.append(_full(fs, entry["name"], path))
            _check_text(files[-1], "file")
    return sorted(dirs), sorted(files)


def _class_files(path: str) -> list[str]:
    """Every file under ``path``, subfolders included, sorted; hidden entries (and all under a
    hidden folder) ignored."""
    fs, fs_path = _fs(path)
    files = []
    for found in fs.find(fs_path, withdirs=False):
        relative = posixpath.relpath(found, fs_path.rstrip("/") or "/")
        if not any(part.startswith(".") for part in relative.split("/")):
            files.append(_full(fs, found, path))
            _check_text(files[-1], "file")
    return sorted(files)


def _exists(path: str) -> bool:
    fs, fs_path = _fs(path)
    return fs.exists(fs_path)


def _isdir(path: str) -> bool:
    fs, fs_path = _fs(path)
    return fs.isdir(fs_path)


def _read_lines(path: str, what: str) -> list[str]:
    if not _exists(path):
        raise InputError(f"{what} {path} does not exist")
    with fsspec.open(path, "rt", encoding="utf-8") as f:
        return [line.strip() for line in f.read().splitlines()]


def read_labels_file(path: str) -> list[str]:
    """Labels, one per line (blank lines ignored), as ``jpeg_to_tf_record.py``'s labels file.

    Raises:
      InputError: missing, fewer than 2 labels, or a label listed twice.
    """
    labels = [line for line in _read_lines(path, "labels file") if line]
    if len(labels) < 2:
        raise InputError(f"labels file {path} has {len(labels)} labels; at least 2 are needed")
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise InputError(f"labels file {path} lists these labels more than once: {dupes[:10]}")
    return labels


def shuffle_train(items: list[Item], seed: int) -> list[Item]:
    """A seeded shuffle of ``items`` (a new list; really shuffled, unlike the original's)."""
    out = list(items)
    random.Random(seed).shuffle(out)
    return out


def _class_tree(root: str, what: str) -> dict[str, list[str]]:
    """``root/<label>/<file>`` -> {label: sorted files}; errors name the directory."""
    if not _isdir(root):
        raise InputError(f"{what} directory {root} does not exist")
    labels, loose = _list_dir(root)
    if not labels:
        raise InputError(
            f"{what} directory {root} has no <label>/ subdirectories (empty split)"
            + (f"; it has {len(loose)} loose files" if loose else "")
        )
    tree = {label: _class_files(posixpath.join(root, label)) for label in labels}
    if not any(tree.values()):
        raise InputError(
            f"{what} directory {root}: no images in any of its {len(labels)} "
            "label directories (empty split)"
        )
    return tree


def imagenet_source(raw_data_dir: str, seed: int = 0, skip_bad: bool = False) -> Dataset:
    """The raw ImageNet layout (module docstring) -> train (shuffled) and validation (sorted).

    Raises:
      InputError: neither ``train/`` nor ``validation/`` exists; a split is empty;
        ``synset_labels.txt`` is missing, has a different number of lines than there are
        validation files, or names a synset that is not a ``train/`` directory (unknown synset;
        skipped with ``skip_bad``); a ``train/`` directory is not a synset name.
    """
    train_dir = posixpath.join(raw_data_dir, "train")
    val_dir = posixpath.join(raw_data_dir, "validation")
    labels_file = posixpath.join(raw_data_dir, "synset_labels.txt")
    has_train, has_val = _isdir(train_dir), _isdir(val_dir)
    if not (has_train or has_val):
        raise InputError(
            f"--raw_data_dir {raw_data_dir} has neither train/ nor validation/ "
            "(expected train/<synset>/*.JPEG, validation/*.JPEG, synset_labels.txt)"
        )
    skipped: list[dict[str, str]] = []
    train: list[tuple[str, str]] = []
    train_synsets: list[str] = []
    if has_train:
        tree = _class_tree(train_dir, "train")
        for synset, files in tree.items():
            if not _SYNSET.match(synset):
                raise InputError(
                    f"{posixpath.join(train_dir, synset)}: not a synset directory "
                    "name (expected n + 8 digits, e.g. n01440764)"
                )
            train_synsets.append(synset)
            train.extend((f, synset) for f in files)
    val: list[tuple[str, str]] = []
    if has_val:
        known = set(train_synsets) if has_train else None
        val = _imagenet_validation(val_dir, labels_file, known, skip_bad, skipped)
    # Exactly the original's label rule: the union of both splits' synsets, sorted, 1-based.
    label_map = {s: k + 1 for k, s in enumerate(sorted(set(train_synsets) | {s for _, s in val}))}
    splits = {}
    if has_train:
        splits["train"] = shuffle_train([Item(f, label_map[s], s) for f, s in train], seed)
    if has_val:
        if not val:
            raise InputError(f"every validation image was skipped; nothing left in {val_dir}")
        splits["validation"] = [Item(f, label_map[s], s) for f, s in val]
    return Dataset(splits, label_map, skipped)


def _imagenet_validation(
    val_dir: str,
    labels_file: str,
    known: set[str] | None,
    skip_bad: bool,
    skipped: list[dict[str, str]],
) -> list[tuple[str, str]]:
    """``(file, synset)`` of the sorted validation files, their synsets read from
    ``labels_file``; ``known``: the train synsets (None: no train split). Skipped lines are
    appended to ``skipped``."""
    val_files = _list_dir(val_dir)[1]
    if not val_files:
        raise InputError(f"validation directory {val_dir} has no images (empty split)")
    synsets = [s for s in _read_lines(labels_file, "validation labels file") if s]
    if len(synsets) != len(val_files):
        raise InputError(
            f"{labels_file} has {len(synsets)} synsets but {val_dir} has {len(val_files)} "
            "files; it must have one line per validation file, in sorted file order"
        )
    val = []
    for line_no, (f, synset) in enumerate(zip(val_files, synsets, strict=False), start=1):
        problem = None
        if not _SYNSET.match(synset):
            problem = f"{labels_file} line {line_no}: {synset!r} is not a synset"
        elif known is not None and synset not in known:
            problem = (
                f"{labels_file} line {line_no}: unknown synset {synset!r} (for "
                f"{posixpath.basename(f)}): there is no train/{synset}/ directory"
            )
        if problem:
            if not skip_bad:
                raise InputError(problem + " (--skip_bad leaves such images out)")
            skipped.append({"file": f, "reason": problem})
            continue
        val.append((f, synset))
    return val


def folder_source(
    split_dirs: dict[str, str],
    labels_file: str | None = None,
    seed: int = 0,
    skip_bad: bool = False,
    allow_empty_classes: bool = False,
    allow_class_mismatch: bool = False,
) -> Dataset:
    """``<dir>/<label>/<image>`` trees -> a Dataset; the 'train' split is shuffled.

    Args:
      split_dirs: split name -> tree root, e.g. ``{'train': ..., 'validation': ...}``.
      labels_file: label order (1-based by line); default: sorted union of the label dirs.
      seed: train shuffle seed.
      skip_bad: leave out label directories that are not in ``labels_file``.
      allow_empty_classes: keep classes without images (a label no example has) with a warning.
      allow_class_mismatch: keep classes that have images in some splits only, with a warning.

    Raises:
      InputError: a missing or empty tree; a label directory not in ``labels_file``; a class
        without images, or with images in some splits only (unless allowed).
    """
    if not split_dirs:
        raise InputError("no input directory given (--train_dir / --validation_dir)")
    trees = {split: _class_tree(root, f"--{split}_dir") for split, root in split_dirs.items()}
    if labels_file:
        labels = read_labels_file(labels_file)
    else:
        labels = sorted(set().union(*(t.keys() for t in trees.values())))
    label_map = {name: k + 1 for k, name in enumerate(labels)}
    _check_classes(split_dirs, trees, label_map, allow_empty_classes, allow_class_mismatch)
    skipped: list[dict[str, str]] = []
    splits = {}
    for split, tree in trees.items():
        items: list[Item] = []
        for name, files in tree.items():
            if name not in label_map:
                problem = (
                    f"{posixpath.join(split_dirs[split], name)}: label {name!r} is not "
                    f"in the labels file {labels_file}"
                )
                if not skip_bad:
                    raise InputError(problem + " (--skip_bad leaves it out)")
                skipped.extend({"file": f, "reason": problem} for f in files)
                continue
            items.extend(Item(f, label_map[name], name) for f in files)
        if not items:
            raise InputError(f"--{split}_dir {split_dirs[split]}: no images left (empty split)")
        splits[split] = shuffle_train(items, seed) if split == "train" else items
    return Dataset(splits, label_map, skipped)


def _check_classes(
    split_dirs: dict[str, str],
    trees: dict[str, dict[str, list[str]]],
    label_map: dict[str, int],
    allow_empty: bool,
    allow_mismatch: bool,
) -> None:
    """Refuses (or, allowed, warns about) classes without images and classes in one split only:
    each still gets a label, which no training (or no evaluation) example has."""
    has = {split: {n for n in label_map if tree.get(n)} for split, tree in trees.items()}
    of = f"of {len(label_map)}"
    empty = [n for n in label_map if not any(n in names for names in has.values())]
    if empty:
        where = []
        for n in empty:
            folders = [posixpath.join(split_dirs[s], n) for s in trees if n in trees[s]]
            found = f"{', '.join(folders)} has no image files" if folders else "no folder"
            where.append(f"{n!r} (label {label_map[n]} {of}: {found})")
        _refuse_or_warn(
            f"classes without images: {'; '.join(where)}: a label no example has",
            allow_empty,
            "--allow_empty_classes",
            "add images or remove the folder (or the labels-file line)",
        )
    if len(trees) < 2:
        return
    common = set.intersection(*has.values())
    odd = [n for n in label_map if n not in empty and n not in common]
    if odd:
        where = []
        for n in odd:
            missing = [s for s in trees if n not in has[s]]
            where.append(
                f"{n!r} (label {label_map[n]} {of}) has images in "
                f"{' and '.join(s for s in trees if n in has[s])} only ("
                + ("the model never trains on it" if "train" in missing else "never evaluated")
                + ")"
            )
        _refuse_or_warn(
            f"{' and '.join(trees)} have different classes: {'; '.join(where)}",
            allow_mismatch,
            "--allow_class_mismatch",
            "give each class images in every split",
        )


def _refuse_or_warn(problem: str, allowed: bool, flag: str, fix: str) -> None:
    if not allowed:
        raise InputError(f"{problem}. To fix: {fix}, or pass {flag} to convert them as they are")
    log.warning("%s (converted as they are: %s)", problem, flag)


def csv_source(
    split_csvs: dict[str, str], labels_file: str, seed: int = 0, skip_bad: bool = False
) -> Dataset:
    """CSV files of ``path_or_url,label`` lines + a labels file -> a Dataset.

    Relative local paths are relative to the CSV file's directory. The 'train' split is shuffled.

    Raises:
      InputError: a missing CSV or labels file; a malformed line; a label not in the labels
        file (the original skipped those silently; here an error, or skipped and listed with
        ``skip_bad``); an empty split.
    """
    if not split_csvs:
        raise InputError("no CSV given (--train_csv / --validation_csv)")
    if not labels_file:
        raise InputError("--labels_file is required with csv input")
    labels = read_labels_file(labels_file)
    label_map = {name: k + 1 for k, name in enumerate(labels)}
    skipped: list[dict[str, str]] = []
    splits = {}
    for split, csv_path in split_csvs.items():
        lines = _read_lines(csv_path, f"--{split}_csv file")
        base = posixpath.dirname(csv_path)
        items = []
        for line_no, row in enumerate(csv.reader(lines), start=1):
            if not row or not "".join(row).strip():
                continue
            where = f"{csv_path} line {line_no}"
            if len(row) != 2:
                raise InputError(f"{where}: expected 'path_or_url,label', got {row!r}")
            path, label = row[0].strip(), row[1].strip()
            if label not in label_map:
                problem = f"{where}: label {label!r} is not in the labels file {labels_file}"
                if not skip_bad:
                    raise InputError(problem + " (--skip_bad leaves such lines out)")
                skipped.append({"file": path, "reason": problem})
                continue
            if "://" not in path and not posixpath.isabs(path):
                path = posixpath.join(base, path)
            items.append(Item(path, label_map[label], label))
        if not items:
            raise InputError(f"--{split}_csv {csv_path}: no images (empty split)")
        splits[split] = shuffle_train(items, seed) if split == "train" else items
    return Dataset(splits, label_map, skipped)
