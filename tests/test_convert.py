"""estimax-convert: raw trees -> shards, fixes, labels, shuffle, resume, manifest, verify, Beam.

Inputs are generated here: a raw-ImageNet-shaped tree of 32x24 images with a PNG named .JPEG, a
CMYK JPEG and a grayscale JPEG among them. Expected labels follow docs/original.md §8.1:
``{synset: k + 1 for k, synset in enumerate(sorted(synsets))}``.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from estimax.data import tfrecord
from estimax.data.example import decode_example
from estimax.tools import convert, convert_shards, convert_sources, fake_imagenet
from estimax.tools.convert_images import BadImageError
from estimax.tools.convert_sources import InputError

SYNSETS = ["n01440764", "n01443537", "n01484850"]
H, W = 24, 32
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _color(i: int) -> tuple[int, int, int]:
    return (40 * i % 256, 255 - 30 * i % 256, 90 + 17 * i % 166)


def _jpeg(color, mode="RGB") -> bytes:
    img = Image.new("RGB", (W, H), color)
    if mode != "RGB":
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def _png(color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGBA", (W, H), color + (255,)).save(buf, format="PNG")
    return buf.getvalue()


def make_raw_imagenet(root, per_synset: int = 4, num_val: int = 6) -> dict:
    """Writes the raw layout; returns {basename: (synset, color, kind)}."""
    info = {}
    for s_i, synset in enumerate(SYNSETS):
        os.makedirs(root / "train" / synset)
        for j in range(per_synset):
            name = f"{synset}_{j}.JPEG"
            color = _color(s_i * 10 + j)
            kind = "rgb"
            if (s_i, j) == (0, 1):
                kind, data = "png", _png(color)  # a PNG disguised as JPEG
            elif (s_i, j) == (1, 2):
                kind, data = "cmyk", _jpeg(color, "CMYK")
            elif (s_i, j) == (2, 0):
                kind, data = "grayscale", _jpeg(color, "L")
            else:
                data = _jpeg(color)
            (root / "train" / synset / name).write_bytes(data)
            info[name] = (synset, color, kind)
    os.makedirs(root / "validation")
    val_synsets = []
    for k in range(num_val):
        name = f"ILSVRC2012_val_{k + 1:08d}.JPEG"
        synset = SYNSETS[(k * 2) % len(SYNSETS)]
        color = _color(100 + k)
        (root / "validation" / name).write_bytes(_jpeg(color))
        val_synsets.append(synset)
        info[name] = (synset, color, "rgb")
    (root / "synset_labels.txt").write_text("\n".join(val_synsets) + "\n")
    return info


def read_dir(out_dir) -> dict[str, list[dict]]:
    """{shard name: decoded examples} for every shard file in out_dir."""
    return {
        os.path.basename(p): [decode_example(r) for r in tfrecord.read_records(p)]
        for p in tfrecord.list_files(os.path.join(str(out_dir), "*-of-*"))
    }


def digests(out_dir) -> dict[str, str]:
    """{file name: SHA-256} of every shard and index file in out_dir."""
    out = str(out_dir)
    paths = tfrecord.list_files(os.path.join(out, "*-of-*"))
    paths += tfrecord.list_files(os.path.join(out, tfrecord.INDEX_DIR_NAME, "*-of-*.idx"))
    return {os.path.basename(p): hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths}


def assert_indexed(out_dir: str) -> None:
    """Every shard has its index file, listing exactly its records."""
    shards = tfrecord.list_files(os.path.join(out_dir, "*-of-*"))
    assert shards
    for path in shards:
        assert convert_shards.index_problems(path) == [], path
        # In the hidden folder: a TensorFlow glob of the shards (train-*) matches no index.
        assert tfrecord.existing_index_path(path) == tfrecord.default_index_path(path)
    fs, fs_dir = tfrecord._fs_and_path(out_dir)  # noqa: SLF001
    assert not any(n.endswith(".idx") for n in fs.ls(fs_dir, detail=False))


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    root = tmp_path_factory.mktemp("raw")
    return root, make_raw_imagenet(root)


@pytest.fixture(scope="module")
def converted(raw, tmp_path_factory):
    root, info = raw
    out = tmp_path_factory.mktemp("out")
    ds = convert_sources.imagenet_source(str(root))
    manifest = convert_shards.convert_local(
        ds, str(out), {"train": 3, "validation": 2}, num_workers=2, progress=False
    )
    return out, manifest, info


def test_imagenet_records_parse_decode_and_carry_the_original_labels(converted):
    out, manifest, info = converted
    labels = {s: k + 1 for k, s in enumerate(sorted(SYNSETS))}  # §8.1's rule
    shards = read_dir(out)
    assert sorted(shards) == [
        "train-00000-of-00003",
        "train-00001-of-00003",
        "train-00002-of-00003",
        "validation-00000-of-00002",
        "validation-00001-of-00002",
    ]
    seen = {}
    for name, examples in shards.items():
        assert examples, f"empty shard {name}"
        assert len(examples) == manifest.shards[name]["num_examples"]
        for ex in examples:
            fname = ex["image/filename"][0].decode()
            synset, color, _ = info[fname]
            assert ex["image/class/synset"] == [synset.encode()]
            assert int(ex["image/class/label"][0]) == labels[synset]
            assert ex["image/format"] == [b"JPEG"] and ex["image/colorspace"] == [b"RGB"]
            assert int(ex["image/channels"][0]) == 3
            img = simplejpeg.decode_jpeg(ex["image/encoded"][0], colorspace="RGB")
            assert img.shape == (int(ex["image/height"][0]), int(ex["image/width"][0]), 3)
            assert img.shape == (H, W, 3)
            seen[fname] = (name, img)
    # Every input written once: counts sum to the inputs.
    assert sorted(seen) == sorted(info)
    assert manifest.complete and manifest.label_map == labels
    assert sum(e["num_examples"] for e in manifest.shards.values()) == len(info)
    # Shard sizes differ by at most one (4*3=12 train -> 4,4,4; 6 val -> 3,3).
    assert [len(shards[n]) for n in sorted(shards)] == [4, 4, 4, 3, 3]


def test_png_cmyk_and_gray_become_rgb_jpegs_detected_by_content(converted):
    out, manifest, info = converted
    fixed = {
        os.path.basename(f["file"]): f["reason"]
        for e in manifest.shards.values()
        for f in e["fixed"]
    }
    expected = {n: kind for n, (_, _, kind) in info.items() if kind != "rgb"}
    assert fixed == expected  # exactly the odd files, found without a list of names
    for examples in read_dir(out).values():
        for ex in examples:
            fname = ex["image/filename"][0].decode()
            data = ex["image/encoded"][0]
            _, _, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            assert colorspace == "YCbCr", fname
            img = simplejpeg.decode_jpeg(data, colorspace="RGB").astype(int)
            color, kind = info[fname][1], info[fname][2]
            if kind == "grayscale":  # ITU-R 601 luma, as Pillow's L conversion
                gray = (color[0] * 299 + color[1] * 587 + color[2] * 114) / 1000
                color = (gray, gray, gray)
            # Flat colours survive JPEG (and CMYK's round trip) within a few levels.
            assert np.abs(img.mean((0, 1)) - np.array(color)).max() < 6, (fname, kind)
            if kind == "rgb":  # plain RGB JPEGs are stored as they were, byte for byte
                assert data == _jpeg(color)


def test_validation_in_sorted_order_with_synset_labels(converted):
    out, _, info = converted
    shards = read_dir(out)
    val = [
        ex["image/filename"][0].decode()
        for n in sorted(shards)
        if n.startswith("validation")
        for ex in shards[n]
    ]
    assert val == sorted(n for n in info if n.startswith("ILSVRC"))


def test_train_order_is_a_real_seeded_shuffle(converted, raw):
    out, _, info = converted
    root, _ = raw
    shards = read_dir(out)
    order = [
        ex["image/filename"][0].decode()
        for n in sorted(shards)
        if n.startswith("train")
        for ex in shards[n]
    ]
    sorted_order = sorted(n for n in info if not n.startswith("ILSVRC"))
    assert sorted(order) == sorted_order
    assert order != sorted_order  # the original's shuffle bug returned exactly this
    # Seeded: the same seed gives this order again, another seed a different one.
    items = convert_sources.imagenet_source(str(root), seed=0).splits["train"]
    assert [os.path.basename(i.path) for i in items] == order
    other = convert_sources.imagenet_source(str(root), seed=1).splits["train"]
    assert [os.path.basename(i.path) for i in other] != order


def test_imagenet_input_fn_reads_the_output_with_zero_based_labels(converted):
    from estimax.data import imagenet

    out, manifest, _ = converted
    fn = imagenet.input_fn(str(out), is_training=False, image_size=16, num_parallel_calls=1)
    it = iter(fn({"batch_size": 4}))
    images, labels = next(it)
    first = [
        ex for n in sorted(read_dir(out)) if n.startswith("validation") for ex in read_dir(out)[n]
    ][:4]
    assert images.shape == (4, 16, 16, 3)
    assert labels.tolist() == [int(ex["image/class/label"][0]) - 1 for ex in first]


def test_verify_passes_then_catches_a_deleted_record(converted, tmp_path):
    out, _, _ = converted
    assert_indexed(str(out))
    assert convert_shards.verify(str(out), decode=True, num_workers=1) == []
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shard = str(copy / "train-00001-of-00003")
    records = list(tfrecord.read_records(shard))
    with tfrecord.TFRecordWriter(shard) as w:
        for r in records[:1] + records[2:]:
            w.write(r)
    problems = convert_shards.verify(str(copy), num_workers=1)
    assert any("train-00001-of-00003" in p and "SHA-256" in p for p in problems)
    assert any(
        f"{len(records) - 1} records, the manifest says {len(records)}" in p for p in problems
    )
    idx = tfrecord.default_index_path(shard)
    assert f"{idx}: lists {len(records)} records, the shard has {len(records) - 1}; " in (
        "\n".join(problems)
    )
    assert convert.main(["verify", f"--output_dir={copy}"]) == 1


def test_verify_checks_index_files_and_a_rerun_writes_missing_ones(raw, converted, tmp_path):
    root, _ = raw
    out, _, _ = converted
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    lost = copy / ".estimax-index" / "train-00000-of-00003.idx"
    lost.unlink()
    short = copy / ".estimax-index" / "validation-00001-of-00002.idx"
    # Its last record's line dropped (and the trailer that records the shard's size, as an index
    # of an earlier estimax has none).
    lines = [x for x in short.read_text().splitlines(keepends=True) if not x.startswith("#")]
    short.write_text("".join(lines[:-1]))
    problems = convert_shards.verify(str(copy), num_workers=1)
    assert problems == [
        f"{lost}: missing (the shard's index, which training hosts read); rerun the same "
        "convert command to rewrite it",
        f"{short}: lists {len(lines) - 1} records, the shard has {len(lines)}; rerun the same "
        "convert command to rewrite it",
    ]
    # The same command again: every shard kept (its SHA-256 matches), the indexes rewritten.
    rewritten = []
    convert_shards.convert_local(
        convert_sources.imagenet_source(str(root)),
        str(copy),
        {"train": 3, "validation": 2},
        num_workers=1,
        progress=False,
        on_shard=rewritten.append,
    )
    assert rewritten == []
    assert convert_shards.verify(str(copy), num_workers=1) == []
    # The shards are the same bytes; the rewritten indexes list the same records (their trailer
    # records the copy's own mtime).
    shards = lambda d: {k: v for k, v in digests(d).items() if not k.endswith(".idx")}
    assert shards(copy) == shards(out)
    for name in os.listdir(out / ".estimax-index"):
        records = lambda p: [x for x in p.read_text().splitlines() if not x.startswith("#")]
        assert records(copy / ".estimax-index" / name) == records(out / ".estimax-index" / name)


def _fake_args(out, *extra):
    return [
        sys.executable,
        "-m",
        "estimax.tools.convert",
        "fake-imagenet",
        f"--output_dir={out}",
        "--train_examples=960",
        "--validation_examples=0",
        "--train_shards=24",
        "--min_size=64",
        "--max_size=128",
        "--no_progress",
        *extra,
    ]


def test_interrupted_conversion_resumes_and_equals_an_uninterrupted_one(tmp_path):
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        _fake_args(killed, "--num_workers=1", "--manifest_save_secs=0"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # Kill as soon as the manifest records two finished shards (watching the output dir).
        while True:
            manifest = convert_shards.load_manifest(str(killed)) if killed.exists() else None
            if manifest is not None and len(manifest.shards) >= 2:
                break
            assert proc.poll() is None, "the conversion exited before it could be interrupted"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    partial = convert_shards.load_manifest(str(killed))
    assert not partial.complete and 2 <= len(partial.shards) < 24
    # No half-written shard under a final name: every final-name file reads cleanly, and its
    # index is there with it.
    for name in os.listdir(killed):
        if name.startswith("train-") and not name.endswith(".idx"):
            assert list(tfrecord.read_records(str(killed / name)))
            assert convert_shards.index_problems(str(killed / name)) == []
    rewritten = []
    args = convert._parser().parse_args(_fake_args(killed)[3:])
    ds, _ = convert._dataset(args)
    final = convert_shards.convert_local(
        ds, str(killed), {"train": 24}, num_workers=2, progress=False, on_shard=rewritten.append
    )
    assert final.complete
    assert not {r["name"] for r in rewritten} & set(partial.shards)  # finished ones kept
    assert len(rewritten) == 24 - len(partial.shards)
    assert not [n for n in os.listdir(killed) if ".tmp-" in n]  # stale temporaries removed
    convert_shards.convert_local(ds, str(whole), {"train": 24}, num_workers=2, progress=False)
    assert digests(killed) == digests(whole)
    assert convert_shards.verify(str(killed), num_workers=1) == []


def test_fake_imagenet_fields_labels_and_worker_independence(tmp_path):
    ds = fake_imagenet.fake_dataset(30, 10, num_classes=5, seed=3, min_size=40, max_size=60)
    a = convert_shards.convert_local(
        ds, str(tmp_path / "a"), {"train": 3, "validation": 2}, num_workers=2, progress=False
    )
    convert_shards.convert_local(
        ds, str(tmp_path / "b"), {"train": 3, "validation": 2}, num_workers=1, progress=False
    )
    assert digests(tmp_path / "a") == digests(tmp_path / "b")
    assert_indexed(str(tmp_path / "a"))
    assert a.label_map == {f"n{k:08d}": k for k in range(1, 6)}
    for examples in read_dir(tmp_path / "a").values():
        for ex in examples:
            label = int(ex["image/class/label"][0])
            assert 1 <= label <= 5 and ex["image/class/synset"] == [b"n%08d" % label]
            img = simplejpeg.decode_jpeg(ex["image/encoded"][0])
            assert 40 <= img.shape[0] <= 60 and 40 <= img.shape[1] <= 60
            assert img.shape[:2] == (ex["image/height"][0], ex["image/width"][0])


def test_folder_and_csv_commands_write_the_same_examples_as_imagenet(raw, converted, tmp_path):
    root, info = raw
    out_imagenet, manifest, _ = converted
    want = {
        ex["image/filename"][0]: ex
        for exs in read_dir(out_imagenet).values()
        for ex in exs
        if ex["image/filename"][0].startswith(b"n")
    }
    assert (
        convert.main(
            [
                "folder",
                f"--train_dir={root / 'train'}",
                "--train_shards=2",
                f"--output_dir={tmp_path / 'folder'}",
                "--no_progress",
            ]
        )
        == 0
    )
    # CSV with paths relative to the CSV file, and a labels file in a non-sorted order.
    labels = list(reversed(SYNSETS))
    (root / "labels.txt").write_text("\n".join(labels))
    rows = [f"train/{info[n][0]}/{n},{info[n][0]}" for n in sorted(info) if n.startswith("n")]
    (root / "train.csv").write_text("\n".join(rows) + "\n")
    assert (
        convert.main(
            [
                "csv",
                f"--train_csv={root / 'train.csv'}",
                f"--labels_file={root / 'labels.txt'}",
                "--train_shards=2",
                f"--output_dir={tmp_path / 'csv'}",
                "--no_progress",
            ]
        )
        == 0
    )
    for kind in ("folder", "csv"):
        got = {
            ex["image/filename"][0]: ex for exs in read_dir(tmp_path / kind).values() for ex in exs
        }
        assert sorted(got) == sorted(want)
        for name, ex in got.items():
            assert ex["image/encoded"] == want[name]["image/encoded"]
            synset = ex["image/class/synset"][0].decode()
            label = labels.index(synset) + 1 if kind == "csv" else manifest.label_map[synset]
            assert int(ex["image/class/label"][0]) == label
        assert convert.main(["verify", f"--output_dir={tmp_path / kind}"]) == 0
        assert_indexed(str(tmp_path / kind))


def _require_beam() -> None:
    if os.environ.get("ESTIMAX_REQUIRE_BEAM"):  # `make test` runs this in .venv-beam
        import apache_beam  # noqa: F401
    pytest.importorskip(
        "apache_beam",
        reason="apache-beam runs in its own venv (`make test` "
        "builds .venv-beam: Beam pins protobuf<7); not installed here",
    )


def _watch_sdk_workers(stop: threading.Event, seen: set[int]) -> None:
    """Collects the pids of this process's Beam SDK worker children until ``stop``."""
    me = str(os.getpid())
    while not stop.is_set():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
                with open(f"/proc/{pid}/stat") as f:
                    parent = f.read().rsplit(")", 1)[1].split()[1]
            except OSError:
                continue
            if b"sdk_worker_main" in cmdline and parent == me:
                seen.add(int(pid))
        stop.wait(0.02)  # polling the process table while the pipeline runs


def test_beam_direct_runner_writes_the_same_examples_as_the_local_tool(
    raw, converted, tmp_path, caplog
):
    _require_beam()
    from estimax.tools import convert_beam

    root, _ = raw
    out_local, _, _ = converted
    ds = convert_sources.imagenet_source(str(root))
    stop, workers = threading.Event(), set()
    watcher = threading.Thread(target=_watch_sdk_workers, args=(stop, workers))
    watcher.start()
    caplog.set_level(logging.INFO, logger="estimax.tools.convert_beam")
    try:
        manifest = convert_beam.convert_beam(
            ds, str(tmp_path), {"train": 3, "validation": 2}, num_workers=2
        )
    finally:
        stop.set()
        watcher.join()
    assert manifest.complete
    assert digests(tmp_path) == digests(out_local)  # shards and index files, byte for byte
    assert convert_shards.verify(str(tmp_path), num_workers=1) == []
    # The runner that ran is named, with the worker processes asked for; they ran.
    assert "Beam: writing 5 shards on FnApiRunner (Beam's local runner, 2 worker processes" in (
        caplog.text
    )
    assert "Beam: FnApiRunner wrote 5 shards" in caplog.text
    assert "Prism" not in caplog.text.replace("never tries Prism", "")
    assert len(workers) == 2, workers


def test_beam_converter_runs_with_no_network_and_names_its_runner(raw, converted, tmp_path):
    _require_beam()
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip to run the converter in a network namespace")
    # A new network namespace: only the loopback interface (up, for Beam's worker channels),
    # no route out. The Prism runner's download could not even start.
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.decode().strip()}")
    root, _ = raw
    out_local, _, _ = converted
    out = tmp_path / "offline"
    command = [
        sys.executable,
        "-m",
        "estimax.tools.convert",
        "imagenet",
        f"--raw_data_dir={root}",
        f"--output_dir={out}",
        "--train_shards=3",
        "--validation_shards=2",
        "--runner=DirectRunner",
        "--num_workers=2",
        "--no_progress",
    ]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # bounded: a runner waiting on the network would be killed here
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Beam: writing 5 shards on FnApiRunner (Beam's local runner, 2 worker processes" in (
        proc.stderr
    )
    assert "PrismRunner" not in proc.stderr
    assert digests(out) == digests(out_local)


# ------------------------------------------------------------------------------ bad input


def _tree(tmp_path):
    root = tmp_path / "raw"
    make_raw_imagenet(root, per_synset=2, num_val=3)
    return root


def _convert(root, out, **kw):
    skip_bad = kw.pop("skip_bad", False)
    ds = convert_sources.imagenet_source(str(root), skip_bad=skip_bad)
    shards = kw.pop("shards", {"train": 2, "validation": 1})
    return convert_shards.convert_local(
        ds, str(out), shards, num_workers=1, progress=False, skip_bad=skip_bad, **kw
    )


def test_unreadable_and_truncated_images_name_the_file_or_are_skipped(tmp_path):
    root = _tree(tmp_path)
    bad = root / "train" / SYNSETS[0] / f"{SYNSETS[0]}_0.JPEG"
    bad.write_bytes(b"this is not an image")
    with pytest.raises(BadImageError, match=f"{bad}.*not a readable image.*--skip_bad"):
        _convert(root, tmp_path / "o1")
    truncated = root / "train" / SYNSETS[1] / f"{SYNSETS[1]}_0.JPEG"
    noise = np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8)
    full = simplejpeg.encode_jpeg(noise, quality=95)
    truncated.write_bytes(full[: len(full) * 3 // 4])  # headers intact, scan data cut
    bad.write_bytes(_jpeg((1, 2, 3)))
    with pytest.raises(BadImageError, match=f"{truncated}.*truncated"):
        _convert(root, tmp_path / "o2")
    manifest = _convert(root, tmp_path / "o3", skip_bad=True)
    skipped = [s for e in manifest.shards.values() for s in e["skipped"]]
    assert [s["file"] for s in skipped] == [str(truncated)]
    assert sum(e["num_examples"] for e in manifest.shards.values()) == 6 + 3 - 1
    assert convert_shards.verify(str(tmp_path / "o3"), num_workers=1) == []


def test_unknown_synset_names_the_labels_file_line(tmp_path):
    root = _tree(tmp_path)
    (root / "synset_labels.txt").write_text(f"{SYNSETS[0]}\nn09999999\n{SYNSETS[1]}\n")
    with pytest.raises(
        InputError,
        match=r"synset_labels.txt line 2: unknown synset "
        r"'n09999999' \(for ILSVRC2012_val_00000002.JPEG\)",
    ):
        convert_sources.imagenet_source(str(root))
    ds = convert_sources.imagenet_source(str(root), skip_bad=True)
    assert [os.path.basename(i.path) for i in ds.splits["validation"]] == [
        "ILSVRC2012_val_00000001.JPEG",
        "ILSVRC2012_val_00000003.JPEG",
    ]
    assert "n09999999" in ds.skipped[0]["reason"]


def test_empty_split_missing_labels_file_and_too_many_shards(tmp_path, capsys):
    root = _tree(tmp_path)
    (root / "synset_labels.txt").unlink()
    with pytest.raises(
        InputError, match=f"validation labels file {root}/synset_labels.txt does not exist"
    ):
        convert_sources.imagenet_source(str(root))
    assert (
        convert.main(["imagenet", f"--raw_data_dir={root}", f"--output_dir={tmp_path / 'o'}"]) == 2
    )
    assert "synset_labels.txt does not exist" in capsys.readouterr().err
    for synset in SYNSETS:
        for f in (root / "train" / synset).iterdir():
            f.unlink()
    with pytest.raises(InputError, match=f"{root}/train: no images .*empty split"):
        convert_sources.imagenet_source(str(root))
    with pytest.raises(InputError, match="labels file .*nope.txt does not exist"):
        convert_sources.csv_source({"train": str(root / "t.csv")}, str(root / "nope.txt"))
    ds = fake_imagenet.fake_dataset(3, 0)
    with pytest.raises(InputError, match="train: 3 images cannot fill 4 shards"):
        convert_shards.plan_shards(ds, {"train": 4}, str(tmp_path))


def test_csv_label_not_in_labels_file_names_the_line(tmp_path):
    (tmp_path / "labels.txt").write_text("cat\ndog\n")
    (tmp_path / "t.csv").write_text("a.jpg,cat\nb.jpg,cow\n")
    with pytest.raises(InputError, match=r"t.csv line 2: label 'cow' is not in the labels file"):
        convert_sources.csv_source({"train": str(tmp_path / "t.csv")}, str(tmp_path / "labels.txt"))


def test_a_different_conversion_in_the_same_output_dir_is_refused(tmp_path):
    root = _tree(tmp_path)
    _convert(root, tmp_path / "o")
    with pytest.raises(InputError, match="manifest.json is from a different conversion"):
        _convert(root, tmp_path / "o", shards={"train": 3, "validation": 1})
    manifest = _convert(root, tmp_path / "o", shards={"train": 3, "validation": 1}, overwrite=True)
    shards = ["validation-00000-of-00001"] + [f"train-0000{i}-of-00003" for i in range(3)]
    assert sorted(os.listdir(tmp_path / "o")) == sorted(
        ["manifest.json", *shards, ".estimax-index"]
    )
    assert sorted(os.listdir(tmp_path / "o" / ".estimax-index")) == sorted(
        f"{name}.idx" for name in shards
    )
    assert manifest.complete


def test_output_to_a_remote_fsspec_filesystem_and_rerun_rewrites_nothing():
    # memory:// stands for gs://: no local rename, manifest and checksums through fsspec.
    ds = fake_imagenet.fake_dataset(20, 6, num_classes=4, seed=1, min_size=30, max_size=40)
    out = "memory://estimax-test-convert/out"
    manifest = convert_shards.convert_local(
        ds, out, {"train": 2, "validation": 1}, num_workers=1, progress=False
    )
    assert manifest.complete and convert_shards.verify(out, num_workers=1) == []
    assert_indexed(out)
    records = list(tfrecord.read_records(out + "/train-00001-of-00002"))
    assert len(records) == manifest.shards["train-00001-of-00002"]["num_examples"] == 10
    rewritten = []
    convert_shards.convert_local(
        ds,
        out,
        {"train": 2, "validation": 1},
        num_workers=1,
        progress=False,
        on_shard=rewritten.append,
    )
    assert rewritten == []


def test_a_shard_whose_images_are_all_bad_is_not_written_even_with_skip_bad(tmp_path):
    bad = tmp_path / "in" / "cat"
    bad.mkdir(parents=True)
    for i in range(2):
        (bad / f"{i}.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    (tmp_path / "in" / "dog").mkdir()
    for i in range(2):
        (tmp_path / "in" / "dog" / f"{i}.jpg").write_bytes(_jpeg((5, 5, 5)))
    ds = convert_sources.folder_source({"validation": str(tmp_path / "in")})
    # validation keeps sorted order: shard 0 = the two bad cats, shard 1 = the two dogs.
    with pytest.raises(
        BadImageError,
        match="validation-00000-of-00002: all 2 of its images "
        "are bad.*refusing to write an empty shard",
    ):
        convert_shards.convert_local(
            ds,
            str(tmp_path / "out"),
            {"validation": 2},
            num_workers=1,
            progress=False,
            skip_bad=True,
        )
    assert not (tmp_path / "out" / "validation-00000-of-00002").exists()
    assert not [n for n in os.listdir(tmp_path / "out") if n.startswith(".")]


# ------------------------------------------------------------------------- folder classes


def _product_photos(root) -> None:
    """A Keras-style tree: 'textiles' in subfolders, an empty 'aprons' and 'lamps' in
    validation only."""
    for split, n in (("train", 4), ("validation", 2)):
        for i in range(n):
            for folder in ("bottles", "textiles/batch1", "textiles/batch2"):
                os.makedirs(root / split / folder, exist_ok=True)
                (root / split / folder / f"{i}.jpg").write_bytes(_jpeg(_color(i + len(folder))))
    (root / "train" / "aprons").mkdir()
    (root / "validation" / "lamps").mkdir()
    (root / "validation" / "lamps" / "0.jpg").write_bytes(_jpeg(_color(9)))


def _folder_command(root, out, *flags) -> list[str]:
    return [
        "folder",
        f"--train_dir={root / 'train'}",
        f"--validation_dir={root / 'validation'}",
        "--train_shards=2",
        "--validation_shards=1",
        f"--output_dir={out}",
        "--no_progress",
        *flags,
    ]


def test_folder_classes_are_checked_and_counted_with_their_subfolders(tmp_path, capsys, caplog):
    _product_photos(tmp_path / "in")
    assert convert.main(_folder_command(tmp_path / "in", tmp_path / "o1")) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "estimax-convert folder: error: classes without images: 'aprons' (label 1 of 4: "
        f"{tmp_path}/in/train/aprons has no image files): a label no example has. To fix: add "
        "images or remove the folder (or the labels-file line), or pass --allow_empty_classes to "
        "convert them as they are"
    )
    out = _folder_command(tmp_path / "in", tmp_path / "o2", "--allow_empty_classes")
    assert convert.main(out) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(
        "estimax-convert folder: error: train and validation have different classes: 'lamps' "
        "(label 3 of 4) has images in validation only (the model never trains on it). To fix: "
    )
    assert err.endswith("--allow_class_mismatch to convert them as they are")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()  # nothing written

    flags = ("--allow_empty_classes", "--allow_class_mismatch")
    assert convert.main(_folder_command(tmp_path / "in", tmp_path / "o3", *flags)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == (
        "labels are 1-based, as the original's converter wrote them (a model's class id is "
        "label - 1): 1 = 'aprons' (train 0, validation 0), 2 = 'bottles' (train 4, validation 2), "
        "3 = 'lamps' (train 0, validation 1), 4 = 'textiles' (train 8, validation 4)"
    )
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("'aprons'" in w and "--allow_empty_classes" in w for w in warned)
    assert any("'lamps'" in w and "--allow_class_mismatch" in w for w in warned)
    # The subfolders' images are converted, under their class's label.
    labels = [
        (ex["image/class/synset"][0].decode(), int(ex["image/class/label"][0]))
        for exs in read_dir(tmp_path / "o3").values()
        for ex in exs
    ]
    assert labels.count(("textiles", 4)) == 12 and labels.count(("bottles", 2)) == 6
    manifest = convert_shards.load_manifest(str(tmp_path / "o3"))
    assert json.loads(manifest.to_json())["splits"]["train"]["classes"] == {
        "aprons": 0,
        "bottles": 4,
        "lamps": 0,
        "textiles": 8,
    }
    assert convert.main(["verify", f"--output_dir={tmp_path / 'o3'}"]) == 0


def test_a_labels_file_class_without_a_folder_and_a_class_emptied_by_skip_bad(tmp_path, capsys):
    root = tmp_path / "in"
    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        (root / name / "0.jpg").write_bytes(_jpeg(_color(len(name))))
    (tmp_path / "labels.txt").write_text("cat\ncow\ndog\n")
    with pytest.raises(InputError, match=r"'cow' \(label 2 of 3: no folder\)"):
        convert_sources.folder_source({"train": str(root)}, str(tmp_path / "labels.txt"))
    # Every 'dog' image unreadable and skipped: the class is left without an example.
    (root / "dog" / "0.jpg").write_bytes(b"not an image")
    (root / "dog" / "1.jpg").write_bytes(b"nor this")
    command = ["folder", f"--train_dir={root}", "--train_shards=1", "--no_progress", "--skip_bad"]
    assert convert.main([*command, f"--output_dir={tmp_path / 'o'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and (
        "classes left without images: every image of 'dog' was skipped as unreadable" in err
    )
    assert "--allow_empty_classes" in err
    out = [*command, f"--output_dir={tmp_path / 'o'}", "--allow_empty_classes"]
    assert convert.main(out) == 0  # resumes the same conversion, accepting it
    assert "2 = 'dog' (train 0)" in capsys.readouterr().out


def test_a_manifest_without_class_counts_resumes_and_gains_them(tmp_path):
    root = _tree(tmp_path)
    manifest = _convert(root, tmp_path / "o")
    path = tmp_path / "o" / "manifest.json"
    old = json.loads(path.read_text())
    for entry in old["shards"].values():
        del entry["classes"]  # as an older estimax wrote it
    for info in old["splits"].values():
        del info["classes"]
    path.write_text(json.dumps(old))
    rewritten = []
    again = _convert(root, tmp_path / "o", on_shard=rewritten.append)
    assert rewritten == [] and again.class_counts() == manifest.class_counts()
    assert sum(manifest.class_counts()["train"].values()) == 6


def test_beam_checks_and_counts_folder_classes_as_the_local_tool(tmp_path):
    if os.environ.get("ESTIMAX_REQUIRE_BEAM"):  # `make test` runs this in .venv-beam
        import apache_beam  # noqa: F401
    pytest.importorskip("apache_beam", reason="apache-beam runs in its own venv (.venv-beam)")
    _product_photos(tmp_path / "in")
    flags = ("--allow_empty_classes", "--allow_class_mismatch")
    assert convert.main(_folder_command(tmp_path / "in", tmp_path / "local", *flags)) == 0
    beam = ["--runner=DirectRunner", "--num_workers=2"]
    assert convert.main(_folder_command(tmp_path / "in", tmp_path / "beam", *beam)) == 2
    assert convert.main(_folder_command(tmp_path / "in", tmp_path / "beam", *flags, *beam)) == 0
    local = convert_shards.load_manifest(str(tmp_path / "local"))
    beamed = convert_shards.load_manifest(str(tmp_path / "beam"))
    assert beamed.class_counts() == local.class_counts()
    assert beamed.class_counts()["validation"]["textiles"] == 4
    assert digests(tmp_path / "beam") == digests(tmp_path / "local")


@pytest.mark.parametrize("where", ["class folder", "file", "file in a subfolder"])
def test_a_name_that_is_not_utf8_is_refused_in_one_line_naming_it(tmp_path, capsys, where):
    """Issue #42 item 16: a class folder named in Latin-1 bytes (``caf\\xe9``) ended the folder
    converter with a UnicodeEncodeError traceback. Class and file names are text in the
    manifest, the Examples and the served answers: the name is refused, escaped, in one line."""
    root = os.fsencode(tmp_path / "in")
    for name in (b"dog", b"caf\xe9" if where == "class folder" else b"cat"):
        os.makedirs(os.path.join(root, name))
        with open(os.path.join(root, name, b"0.jpg"), "wb") as f:
            f.write(_jpeg(_color(len(name))))
    bad = {
        "class folder": b"caf\xe9",
        "file": b"cat/\xe9t\xe9.jpg",
        "file in a subfolder": b"cat/\xe9t\xe9/0.jpg",
    }[where]
    os.makedirs(os.path.dirname(os.path.join(root, bad)), exist_ok=True)
    with open(os.path.join(root, bad if where != "class folder" else bad + b"/1.jpg"), "wb") as f:
        f.write(_jpeg(_color(3)))
    command = ["folder", f"--train_dir={tmp_path / 'in'}", "--train_shards=1", "--no_progress"]
    assert convert.main([*command, f"--output_dir={tmp_path / 'o'}"]) == 2
    err = capsys.readouterr().err.strip()
    shown = bad.decode("latin-1").encode("ascii", "backslashreplace").decode()
    kind = "folder" if where == "class folder" else "file"
    assert err == (
        f"estimax-convert folder: error: {tmp_path}/in/{shown}: the name of this {kind} is not "
        "UTF-8 (escaped here as \\xNN); rename it to UTF-8, e.g. convmv -f latin1 -t utf8 -r "
        "--notest <dir>"
    )
    assert not (tmp_path / "o").exists()
