"""``estimax-convert``: raw images -> verified TFRecord shards of tf.Examples (the ImageNet format).

Subcommands::

    estimax-convert imagenet --raw_data_dir=/data/raw --output_dir=gs://bucket/imagenet
    estimax-convert folder --train_dir=flowers/train --validation_dir=flowers/val --output_dir=...
    estimax-convert csv --train_csv=train.csv --validation_csv=eval.csv --labels_file=labels.txt \\
        --output_dir=...
    estimax-convert fake-imagenet --train_examples=10240 --output_dir=/tmp/fake_imagenet
    estimax-convert verify --output_dir=gs://bucket/imagenet [--decode]
    estimax-convert index 'gs://bucket/imagenet/train-*' 'gs://bucket/imagenet/validation-*'
    estimax-convert to-bigtable --data_dir=gs://bucket/imagenet --bigtable_project=P \\
        --bigtable_instance=I --bigtable_table=imagenet
    estimax-convert tf-checkpoint --checkpoint=gs://bucket/resnet --model_dir=DIR \\
        --model=resnet --resnet_depth=50 [--num_label_classes=1000 ...]
    estimax-convert tf-checkpoint --checkpoint=gs://bucket/resnet/model.ckpt-112590 --list

Conversion subcommands run on all cores (``--runner=local``, the default) or as an Apache Beam
pipeline (``--runner=DirectRunner|DataflowRunner|FlinkRunner|SparkRunner``; further arguments go
to Beam, e.g. ``--project --region --temp_location``). They resume an interrupted run in the same
``--output_dir`` and write ``manifest.json``, which ``verify`` checks. The library behind it:
``convert_sources`` (inputs -> labelled lists), ``convert_images`` (image -> tf.Example),
``convert_shards`` (shards, manifest, resume, verify), ``convert_beam``, ``fake_imagenet``.
``index`` writes the index files of existing shards (TensorFlow's tools write none) in
``.estimax-index/`` beside them,
so that a job reading them from a bucket starts without reading them whole
(``convert_index``). ``to-bigtable`` copies finished shards into Cloud Bigtable rows
(``tfrecords_to_bigtable``), the layout ``resnet --bigtable_instance=...`` reads.
``tf-checkpoint`` turns a checkpoint of the original TensorFlow ResNet/Inception into an
estimax model_dir (``estimax.migrate``), or lists its tensors (``--list``, as
``tf.train.list_variables``).

Flags keep the original tools' names where they had one (``--raw_data_dir``,
``--gcs_output_path`` as an alias of ``--output_dir``, ``--train_csv``, ``--labels_file``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from estimax import storage
from estimax.tools import (
    convert_images,
    convert_shards,
    convert_sources,
    convert_spark,
    fake_imagenet,
)

__all__ = ["main", "run"]

RUNNERS = ("local", "DirectRunner", "DataflowRunner", "FlinkRunner", "SparkRunner")
ENGINES = ("local", "beam", "spark")


def _add_common(p: argparse.ArgumentParser, shards: tuple[int, int] = (1024, 128)) -> None:
    p.add_argument(
        "--output_dir",
        "--gcs_output_path",
        dest="output_dir",
        required=True,
        help="where the shards and manifest.json go (any fsspec path, e.g. gs://)",
    )
    p.add_argument(
        "--train_shards",
        type=int,
        default=shards[0],
        help="number of train-SSSSS-of-NNNNN files (default %(default)s)",
    )
    p.add_argument(
        "--validation_shards",
        type=int,
        default=shards[1],
        help="number of validation-SSSSS-of-NNNNN files (default %(default)s)",
    )
    p.add_argument(
        "--runner",
        choices=RUNNERS,
        default="local",
        help="'local': a process pool on this machine; else an Apache Beam runner",
    )
    p.add_argument(
        "--num_workers",
        type=int,
        default=None,
        help="worker processes (local and DirectRunner); default: all usable cores",
    )
    _add_engine_options(p)
    _add_image_options(p)


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    """Which engine distributes the shards: --engine and Spark's options."""
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=None,
        help="'local': a process pool here (default); 'beam': an Apache Beam pipeline "
        "(--runner, default DirectRunner); 'spark': an Apache Spark job (--spark_master)",
    )
    p.add_argument(
        "--spark_master",
        default="local[*]",
        help="with --engine=spark: local[N], spark://HOST:PORT, yarn or k8s://https://HOST:PORT "
        "(default %(default)s)",
    )
    p.add_argument(
        "--spark_conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --engine=spark: a Spark option, e.g. spark.executor.memory=4g (repeatable)",
    )


def _add_image_options(p: argparse.ArgumentParser) -> None:
    """How images are checked, bad ones handled, and the output ordered and shown."""
    p.add_argument(
        "--check",
        choices=convert_images.CHECKS,
        default="scaled",
        help="how each JPEG is checked: 'scaled' entropy-decodes all data but "
        "reconstructs at 1/8 scale (catches what a full decode catches, faster), "
        "'decode' full decode as the original, 'header' header only",
    )
    p.add_argument(
        "--skip_bad",
        action="store_true",
        help="skip unreadable images and unknown labels (listed in the manifest) "
        "instead of stopping with an error",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace shards/manifest of a different conversion in --output_dir "
        "(default: refuse; the same conversion resumes)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="train shuffle seed (default 0, the original's random.seed(0))",
    )
    p.add_argument("--no_progress", dest="progress", action="store_false", help="no progress bar")
    # Tests set 0 (save after every shard) to interrupt a run at a known point.
    p.add_argument("--manifest_save_secs", type=float, default=2.0, help=argparse.SUPPRESS)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="estimax-convert",
        description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="examples:\n" + __doc__.split("\n\n")[2].replace("\\\n", "\\\n"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_conversions(sub)
    _add_verify(sub)
    _add_index(sub)
    _add_to_bigtable(sub)
    _add_tf_checkpoint(sub)
    return parser


def _add_conversions(sub: Any) -> None:
    """The conversion subcommands: imagenet, folder, csv, fake-imagenet."""
    p = sub.add_parser(
        "imagenet",
        help="raw ImageNet (train/<synset>/*.JPEG, validation/, "
        "synset_labels.txt) -> train-*/validation-* shards",
    )
    p.add_argument(
        "--raw_data_dir",
        required=True,
        help="directory with train/<synset>/*.JPEG, validation/*.JPEG and "
        "synset_labels.txt (one synset per sorted validation file)",
    )
    _add_common(p)

    p = sub.add_parser("folder", help="<label>/<image> trees -> shards")
    p.add_argument("--train_dir", help="<label>/<image> tree of training images")
    p.add_argument("--validation_dir", help="<label>/<image> tree of validation images")
    p.add_argument(
        "--labels_file",
        help="one label per line: fixes the label order "
        "(1-based); default: sorted label directory names",
    )
    p.add_argument(
        "--allow_empty_classes",
        action="store_true",
        help="convert classes without images (a label no example has) with a warning, instead "
        "of stopping with an error naming them",
    )
    p.add_argument(
        "--allow_class_mismatch",
        action="store_true",
        help="convert classes that have images in one split only with a warning, instead of "
        "stopping with an error naming them",
    )
    _add_common(p)

    p = sub.add_parser("csv", help="CSV files of path_or_url,label + a labels file -> shards")
    p.add_argument("--train_csv", help="lines 'path_or_url,label' of training images")
    p.add_argument("--validation_csv", help="lines 'path_or_url,label' of validation images")
    p.add_argument(
        "--labels_file", required=True, help="one label per line; label = line number (1-based)"
    )
    _add_common(p)

    p = sub.add_parser("fake-imagenet", help="random JPEGs in ImageNet-format shards")
    p.add_argument("--train_examples", type=int, default=10240)
    p.add_argument("--validation_examples", type=int, default=1280)
    p.add_argument("--num_classes", type=int, default=1000)
    p.add_argument("--min_size", type=int, default=96, help="smallest image side (pixels)")
    p.add_argument("--max_size", type=int, default=320, help="largest image side (pixels)")
    _add_common(p)


def _add_verify(sub: Any) -> None:
    """The verify subcommand."""
    p = sub.add_parser("verify", help="check shards against their manifest.json")
    p.add_argument(
        "--output_dir",
        "--data_dir",
        dest="output_dir",
        required=True,
        help="directory with manifest.json and the shards",
    )
    p.add_argument(
        "--decode",
        action="store_true",
        help="also decode every image and compare its size with the record's",
    )
    p.add_argument("--num_workers", type=int, default=None)


def _add_index(sub: Any) -> None:
    """The index subcommand."""
    p = sub.add_parser(
        "index",
        help="write the index file of each TFRecord shard that has none (read once each) in "
        "the hidden folder .estimax-index/ beside it, or --index_dir",
    )
    p.add_argument(
        "shards", nargs="+", metavar="PATH_OR_GLOB", help="shards (local, gs://, s3://) or globs"
    )
    p.add_argument("--verify", action="store_true", help="check every record's CRC on the way")
    p.add_argument("--force", action="store_true", help="rewrite indexes that fit their shards too")
    p.add_argument(
        "--connections",
        type=int,
        default=8,
        help="shards read at once, in all (default %(default)s)",
    )
    p.add_argument(
        "--num_workers",
        type=int,
        default=None,
        help="processes sharing the shards (default 1: reading waits on the network; "
        "more help --verify, which checks CRCs on the CPU)",
    )
    p.add_argument(
        "--runner",
        choices=RUNNERS,
        default="local",
        help="'local': here; else an Apache Beam runner (one shard per element)",
    )
    _add_engine_options(p)
    p.add_argument(
        "--index_dir",
        help="the folder the indexes go to, e.g. for shards whose folder cannot be written "
        "(a read-only bucket); a job finds them there when given the same folder (the "
        "programs use <model_dir>/shard_indexes). Default: <shards' folder>/.estimax-index",
    )
    p.add_argument(
        "--move",
        action="store_true",
        help="first move the <shard>.idx files earlier versions wrote beside the shards "
        "(which TensorFlow's train-* matches) into .estimax-index/",
    )
    p.add_argument("--no_progress", dest="progress", action="store_false", help="no progress bar")


def _index(args: argparse.Namespace, extra: list[str]) -> int:
    from estimax.tools import convert_index

    if args.num_workers is None:
        args.num_workers = 1
    if args.connections < 1 or args.num_workers < 1:
        print(
            "estimax-convert index: error: --connections and --num_workers must be at least 1",
            file=sys.stderr,
        )
        return 2
    try:
        spark_conf = convert_spark.parse_conf(args.spark_conf)
        report = convert_index.index_command(
            args.shards,
            verify=args.verify,
            force=args.force,
            connections=args.connections,
            num_workers=args.num_workers,
            progress=args.progress,
            runner=args.runner,
            pipeline_args=extra,
            index_dir=args.index_dir,
            move=args.move,
            spark_master=args.spark_master,
            spark_conf=spark_conf,
        )
    except (
        FileNotFoundError,
        ImportError,
        OSError,
        storage.StorageError,
        convert_spark.SparkError,
    ) as e:
        print(f"estimax-convert index: error: {e}", file=sys.stderr)
        return 2
    for problem in report.problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    print(convert_index.summary(report, args.shards))
    return 1 if report.problems else 0


def _add_to_bigtable(sub: Any) -> None:
    """The to-bigtable subcommand."""
    p = sub.add_parser(
        "to-bigtable",
        help="train-*/validation-* shards -> Cloud Bigtable rows "
        "train_0000000000... (one tf.Example per row), for --bigtable_* input",
    )
    p.add_argument(
        "--data_dir",
        "--output_dir",
        dest="data_dir",
        required=True,
        help="directory with the train-* and validation-* TFRecord shards",
    )
    p.add_argument(
        "--bigtable_project",
        default=None,
        help="Google Cloud project (default: the credentials' project, or the "
        "emulator's with BIGTABLE_EMULATOR_HOST)",
    )
    p.add_argument(
        "--bigtable_instance", required=True, help="Cloud Bigtable instance (must exist)"
    )
    p.add_argument(
        "--bigtable_table",
        default="imagenet",
        help="table, created with the column family if absent (default %(default)s)",
    )
    _add_bigtable_layout(p)


def _add_bigtable_layout(p: argparse.ArgumentParser) -> None:
    """Where the rows go: key prefixes, column, splits; and whether to replace rows."""
    p.add_argument(
        "--bigtable_train_prefix",
        "--train_prefix",
        dest="train_prefix",
        default="train_",
        help="row key prefix of training rows (default %(default)s)",
    )
    p.add_argument(
        "--bigtable_eval_prefix",
        "--eval_prefix",
        dest="eval_prefix",
        default="validation_",
        help="row key prefix of validation rows (default %(default)s)",
    )
    p.add_argument(
        "--bigtable_column_family",
        "--column_family",
        dest="column_family",
        default="tfexample",
        help="column family (default %(default)s)",
    )
    p.add_argument(
        "--bigtable_column_qualifier",
        "--column_qualifier",
        dest="column_qualifier",
        default="example",
        help="column qualifier (default %(default)s)",
    )
    p.add_argument(
        "--splits",
        default="train,validation",
        help="comma-separated splits to copy (default %(default)s)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete rows already under a prefix and copy again (default: refuse)",
    )


def _add_tf_checkpoint(sub: Any) -> None:
    """The tf-checkpoint subcommand."""
    p = sub.add_parser(
        "tf-checkpoint",
        help="a TensorFlow checkpoint of the original ResNet/Inception -> an estimax model_dir "
        "(further --flags are the program's model flags, e.g. --resnet_depth=50)",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        help="the TensorFlow checkpoint: its model_dir (the 'checkpoint' file names the "
        "newest), a prefix such as DIR/model.ckpt-1000, or its .index (local, gs://, s3://)",
    )
    p.add_argument(
        "--list", action="store_true", help="print every tensor's name, dtype and shape; no output"
    )
    p.add_argument(
        "--model_dir", help="the estimax model_dir to write (new, or without checkpoints)"
    )
    # Checked against the family registry when used (importing it here would load JAX for
    # every estimax-convert command).
    p.add_argument(
        "--model",
        help="the program whose network the checkpoint holds: one with a TensorFlow original "
        "(resnet, inception_v3, inception_v4; another name lists the registered ones)",
    )
    _add_own_model_arguments(p)
    _add_loading_arguments(p)


def _add_own_model_arguments(p: argparse.ArgumentParser) -> None:
    """tf-checkpoint's arguments for a model_fn of the user's own and how its variables are found
    in the checkpoint."""
    p.add_argument(
        "--model_fn",
        help="a model_fn of your own instead of --model: FILE.py:NAME or MODULE:NAME; its "
        "variables are found in the checkpoint by name, as a warm start finds them",
    )
    p.add_argument(
        "--input_fn",
        help="with --model_fn: the input_fn whose first batch initialises the model "
        "(FILE.py:NAME or MODULE:NAME; default: input_fn beside the model_fn)",
    )
    p.add_argument(
        "--params", help='with --model_fn: its params, as JSON or a JSON file ({"num_labels": 2})'
    )
    p.add_argument(
        "--assignment_map",
        help="init_from_checkpoint's assignment_map, checkpoint name -> variable name, as JSON "
        'or a JSON file: {"bert/": "bert/"}, {"old/var": "new/var"}, {"/": "scope/"}',
    )
    p.add_argument(
        "--rename",
        help="checkpoint name parts -> the model's, as JSON or a JSON file: "
        '{"LayerNorm/gamma": "LayerNorm/scale", "LayerNorm/beta": "LayerNorm/bias"}',
    )


def _add_loading_arguments(p: argparse.ArgumentParser) -> None:
    """tf-checkpoint's arguments for what is loaded (optimizer slots, moving averages) and what
    may be missing, of another shape or unmapped."""
    p.add_argument(
        "--optimizer_state",
        choices=("load", "fresh"),
        default="load",
        help="'load': the optimizer's slots (Momentum; RMSProp, RMSProp_1) into the optax state "
        "(default); 'fresh': optax state as initialised",
    )
    p.add_argument(
        "--ema",
        choices=("load", "none"),
        default="load",
        help="'load': the ExponentialMovingAverage shadows into estimax's moving average "
        "(default); 'none': ignore them",
    )
    p.add_argument(
        "--allow_missing",
        action="store_true",
        help="keep variables the checkpoint lacks as initialised",
    )
    p.add_argument(
        "--allow_mismatch",
        action="store_true",
        help="keep variables of another shape (e.g. another number of classes) as initialised",
    )
    p.add_argument(
        "--allow_unmapped",
        action="store_true",
        help="go on when checkpoint variables map to nothing",
    )


def _tf_checkpoint(args: argparse.Namespace, extra: list[str]) -> int:
    from absl import flags

    from estimax import migrate
    from estimax.tools import convert_tf

    try:
        if args.list:
            if extra:
                raise migrate.TFCheckpointError(
                    f"--list takes no program flags ({' '.join(extra)})"
                )
            for name, dtype, shape in migrate.list_variables(args.checkpoint):
                print(f"{name}\t{dtype}\t{list(shape)}")
            return 0
        if not args.model_dir or bool(args.model) == bool(args.model_fn):
            raise migrate.TFCheckpointError(
                "give --model_dir and one of --model or --model_fn (or --list)"
            )
        if not args.model_fn and (args.input_fn or args.params):
            raise migrate.TFCheckpointError("--input_fn and --params go with --model_fn")
        program: Any = args.model
        if args.model_fn:
            params = _json_flag("--params", args.params)
            if params is not None and not isinstance(params, dict):
                raise migrate.TFCheckpointError("--params: expected a JSON object")
            program = convert_tf.user_model(args.model_fn, args.input_fn, params)
        report = convert_tf.convert_tf_checkpoint(
            args.checkpoint,
            args.model_dir,
            program,
            extra,
            optimizer_state=args.optimizer_state == "load",
            ema=args.ema == "load",
            allow_missing=args.allow_missing,
            allow_mismatch=args.allow_mismatch,
            allow_unmapped=args.allow_unmapped,
            assignment_map=_json_flag("--assignment_map", args.assignment_map),
            rename=_json_flag("--rename", args.rename),
        )
    except (migrate.TFCheckpointError, flags.Error, storage.StorageError, OSError) as e:
        print(f"estimax-convert tf-checkpoint: error: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    then = (
        f"`{args.model} --model_dir={args.model_dir} --mode=eval` evaluates it"
        if args.model
        else f"an Estimator of that model_fn with model_dir={args.model_dir} starts from it"
    )
    print(f"wrote the estimax checkpoint at step {report.step or 0} to {args.model_dir}: {then}")
    return 0


def _json_flag(flag: str, value: str | None) -> Any:
    """A flag's JSON, given inline (``{...}``, ``[...]``) or as a file's path."""
    import json

    from estimax import migrate

    if value is None:
        return None
    text = value
    if not value.lstrip().startswith(("{", "[")):
        try:
            with storage.open_file(value, "r") as f:
                text = f.read()
        except (OSError, storage.StorageError) as e:
            raise migrate.TFCheckpointError(
                f"{flag}={value}: neither JSON nor a file ({e})"
            ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise migrate.TFCheckpointError(f"{flag}: not JSON ({e})") from None


def _to_bigtable(args: argparse.Namespace) -> int:
    from estimax.data import bigtable
    from estimax.tools import tfrecords_to_bigtable

    splits = [s for s in args.splits.split(",") if s]
    unknown = sorted(set(splits) - {"train", "validation"})
    if unknown:
        print(
            f"estimax-convert to-bigtable: error: unknown splits {unknown} (train, validation)",
            file=sys.stderr,
        )
        return 2
    try:
        written = tfrecords_to_bigtable.tfrecords_to_bigtable(
            args.data_dir,
            args.bigtable_project,
            args.bigtable_instance,
            args.bigtable_table,
            train_prefix=args.train_prefix,
            eval_prefix=args.eval_prefix,
            column_family=args.column_family,
            column_qualifier=args.column_qualifier,
            overwrite=args.overwrite,
            splits=splits,
        )
    except (bigtable.BigtableError, FileNotFoundError, ImportError, storage.StorageError) as e:
        print(f"estimax-convert to-bigtable: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {written} rows to "
        f"{bigtable.table_path(args.bigtable_project, args.bigtable_instance, args.bigtable_table)}"
        f" ({args.column_family}:{args.column_qualifier})"
    )
    return 0


def _dataset(args: argparse.Namespace) -> tuple[convert_sources.Dataset, dict]:
    if args.command == "imagenet":
        ds = convert_sources.imagenet_source(args.raw_data_dir, args.seed, args.skip_bad)
        return ds, {"command": "imagenet", "raw_data_dir": args.raw_data_dir, "seed": args.seed}
    if args.command == "folder":
        dirs = {
            s: d for s, d in (("train", args.train_dir), ("validation", args.validation_dir)) if d
        }
        ds = convert_sources.folder_source(
            dirs,
            args.labels_file,
            args.seed,
            args.skip_bad,
            allow_empty_classes=args.allow_empty_classes,
            allow_class_mismatch=args.allow_class_mismatch,
        )
        return ds, {"command": "folder", **dirs, "labels_file": args.labels_file, "seed": args.seed}
    if args.command == "csv":
        csvs = {
            s: c for s, c in (("train", args.train_csv), ("validation", args.validation_csv)) if c
        }
        ds = convert_sources.csv_source(csvs, args.labels_file, args.seed, args.skip_bad)
        return ds, {"command": "csv", **csvs, "labels_file": args.labels_file, "seed": args.seed}
    ds = fake_imagenet.fake_dataset(
        args.train_examples,
        args.validation_examples,
        args.num_classes,
        args.seed,
        args.min_size,
        args.max_size,
    )
    return ds, {"command": "fake-imagenet", "seed": args.seed, "num_classes": args.num_classes}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "tf-checkpoint":
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        return _tf_checkpoint(args, extra)
    if args.command in (*_CONVERSIONS, "index"):
        problem = _engine(args)
        if problem:
            parser.error(problem)
    if extra and (args.command in ("verify", "to-bigtable") or args.runner in ("local", "spark")):
        parser.error(
            f"unrecognized arguments: {' '.join(extra)} (only Beam runners take "
            "extra pipeline options)"
        )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Beam logs every worker's start and stop at INFO; keep our progress readable.
    logging.getLogger("apache_beam").setLevel(logging.WARNING)
    if args.command == "to-bigtable":
        return _to_bigtable(args)
    if args.command == "index":
        return _index(args, extra)
    try:
        if args.command == "verify":
            return _verify(args)
        dataset, manifest = _convert(args, extra)
    except (
        convert_sources.InputError,
        convert_images.BadImageError,
        convert_spark.SparkError,
        ImportError,
        storage.StorageError,
    ) as e:
        print(f"estimax-convert {args.command}: error: {e}", file=sys.stderr)
        return 2
    counts = {
        s: sum(e["num_examples"] for e in manifest.shards.values() if e["split"] == s)
        for s in manifest.splits
    }
    skipped = len(manifest.skipped) + sum(len(e["skipped"]) for e in manifest.shards.values())
    fixed = sum(len(e["fixed"]) for e in manifest.shards.values())
    print(
        f"wrote {counts} examples in {len(manifest.shards)} shards to {args.output_dir} "
        f"({fixed} images re-encoded as RGB JPEG, {skipped} skipped; see manifest.json)"
    )
    print(_labels_line(manifest))
    return _no_class_emptied(args, dataset, manifest)


_CONVERSIONS = ("imagenet", "folder", "csv", "fake-imagenet")


def _engine(args: argparse.Namespace) -> str | None:
    """Sets ``args.engine`` from ``--engine``/``--runner`` (``--runner`` alone picks Beam, as
    before ``--engine`` existed); returns what is wrong with the combination, if anything."""
    if args.engine is None:
        args.engine = "local" if args.runner == "local" else "beam"
    elif args.engine == "beam" and args.runner == "local":
        args.runner = "DirectRunner"
    elif args.engine != "beam" and args.runner != "local":
        return f"--runner={args.runner} is a Beam runner: use it with --engine=beam"
    if args.engine == "spark":
        args.runner = "spark"  # not "local": extra arguments are refused below
        if args.num_workers is not None:
            return "--num_workers is for local and Beam; Spark's workers are its executors"
    return None


def _verify(args: argparse.Namespace) -> int:
    problems = convert_shards.verify(args.output_dir, args.decode, args.num_workers)
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    manifest = convert_shards.load_manifest(args.output_dir)
    if problems:
        print(f"verify: {len(problems)} problems in {args.output_dir}", file=sys.stderr)
        return 1
    assert manifest is not None
    n = sum(s["num_examples"] for s in manifest.shards.values())
    print(
        f"verify: OK: {len(manifest.shards)} shards, {n} examples, "
        f"{len(manifest.label_map)} labels in {args.output_dir}"
    )
    return 0


def _convert(
    args: argparse.Namespace, extra: list[str]
) -> tuple[convert_sources.Dataset, convert_shards.Manifest]:
    """The conversion subcommands: their inputs, and the manifest of the finished conversion."""
    dataset, source = _dataset(args)
    num_shards = {"train": args.train_shards, "validation": args.validation_shards}
    kwargs = dict(
        num_workers=args.num_workers,
        check=args.check,
        skip_bad=args.skip_bad,
        overwrite=args.overwrite,
        source=source,
    )
    if args.engine == "spark":
        manifest = convert_spark.convert_spark(
            dataset,
            args.output_dir,
            num_shards,
            master=args.spark_master,
            conf=convert_spark.parse_conf(args.spark_conf),
            check=args.check,
            skip_bad=args.skip_bad,
            overwrite=args.overwrite,
            source=source,
        )
    elif args.runner == "local":
        manifest = convert_shards.convert_local(
            dataset,
            args.output_dir,
            num_shards,
            progress=args.progress,
            manifest_save_secs=args.manifest_save_secs,
            **kwargs,
        )
    else:
        from estimax.tools import convert_beam

        manifest = convert_beam.convert_beam(
            dataset,
            args.output_dir,
            num_shards,
            runner=args.runner,
            pipeline_args=extra,
            **kwargs,
        )
    return dataset, manifest


# More classes than this are summarised (ImageNet's 1,000); manifest.json has every count.
_LISTED_CLASSES = 20


def _labels_line(manifest: convert_shards.Manifest) -> str:
    """The label numbering and each class's label and examples per split, in one line."""
    counts = manifest.class_counts()

    def described(name: str) -> str:
        per_split = ", ".join(f"{split} {counts[split][name]}" for split in counts)
        return f"{manifest.label_map[name]} = {name!r} ({per_split})"

    names = list(manifest.label_map)
    shown = names if len(names) <= _LISTED_CLASSES else names[:10]
    line = (
        "labels are 1-based, as the original's converter wrote them (a model's class id is "
        f"label - 1): {', '.join(described(n) for n in shown)}"
    )
    if len(shown) < len(names):
        ranges = ", ".join(
            f"{split} {min(c.values())}..{max(c.values())}" for split, c in counts.items()
        )
        line += (
            f", ... {len(names)} classes in all (examples per class: {ranges}; every count is "
            "in manifest.json)"
        )
    return line


def _no_class_emptied(
    args: argparse.Namespace, dataset: convert_sources.Dataset, manifest: convert_shards.Manifest
) -> int:
    """Exit status 2 (unless ``--allow_empty_classes``) when skipping unreadable images left a
    folder's class without any example: a label the model could never learn."""
    if args.command != "folder":
        return 0
    counts = manifest.class_counts()
    had_images = {item.synset for items in dataset.splits.values() for item in items}
    emptied = [
        n for n in manifest.label_map if n in had_images and not any(c[n] for c in counts.values())
    ]
    if not emptied:
        return 0
    problem = (
        f"classes left without images: every image of {', '.join(map(repr, emptied))} was "
        "skipped as unreadable (listed in manifest.json), so their labels have no example"
    )
    if args.allow_empty_classes:
        logging.getLogger(__name__).warning("%s (--allow_empty_classes)", problem)
        return 0
    print(
        f"estimax-convert folder: error: {problem}; the shards are written: fix or remove those "
        "images and rerun, or rerun with --allow_empty_classes to accept them",
        file=sys.stderr,
    )
    return 2


def run() -> None:
    """Console-script entry point (``estimax-convert``)."""
    sys.exit(main())


if __name__ == "__main__":
    run()
