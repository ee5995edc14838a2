"""Disk full while writing a checkpoint, a summary, an export and a converter shard.

The fault is real: the writer runs in a child process under ``RLIMIT_FSIZE`` (no root needed),
so its writes past the limit fail with EFBIG as on a full disk (SIGXFSZ ignored). Each case
asserts what the user is told (one error naming the path) and what is kept (the previous
state intact and loadable, nothing partial under a final name).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from estimax.state import checkpoints

try:
    from . import ckpt_fixtures as fx
except ImportError:
    import ckpt_fixtures as fx

LIMIT = textwrap.dedent("""
    import resource, signal
    def limit_file_size(n):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
""")


def _child(code: str) -> str:
    """Runs ``code`` in a child (stdout is a pipe: the limit does not apply to it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([fx.ROOT, fx.HERE, env.get("PYTHONPATH", "")])
    env.setdefault("ESTIMAX_REQUIRE_ONEDNN", "0")
    proc = subprocess.run(
        [sys.executable, "-c", LIMIT + textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow  # a child process that imports JAX and trains
def test_checkpoint_write(tmp_path):
    model_dir = str(tmp_path)
    out = _child(f"""
        import ckpt_fixtures as fx
        from estimax import storage
        fx.train({model_dir!r}, 2, width=256)
        limit_file_size(4096)  # the step-4 checkpoint's data files are larger
        est = fx.estimator({model_dir!r}, width=256)
        try:
            est.train(fx.train_input_fn(), max_steps=4)
        except storage.StorageError as e:
            print("ERROR:", e)
        est.close()
    """)
    where = checkpoints.checkpoint_dir(model_dir)
    assert f"Could not write checkpoint 4 in {where}: the disk is full" in out
    assert "the previous one (step 2) is intact" in out
    assert sorted(os.listdir(where)) == ["2"]  # no partial step, final or temporary
    assert checkpoints.verify_manifest(os.path.join(where, "2")) is None
    est = fx.estimator(model_dir, width=256)
    assert est.get_global_step() == 2
    est.train(fx.train_input_fn(), max_steps=4)  # and training resumes once there is room
    assert est.get_global_step() == 4
    est.close()


def test_summary_write(tmp_path):
    logdir = str(tmp_path)
    out = _child(f"""
        import os
        from estimax import storage
        from estimax.estimator import summaries
        s = summaries.Summaries({logdir!r})
        s.scalars(1, {{"loss": 1.0}})
        s.scalars(2, {{"loss": 2.0}})
        s.flush()
        (name,) = os.listdir({logdir!r})
        limit_file_size(os.path.getsize(os.path.join({logdir!r}, name)) + 40)
        try:
            for step in range(3, 100):
                s.scalars(step, {{"loss": float(step)}})
            s.flush()
        except storage.StorageError as e:
            print("ERROR:", e)
        s.close()
    """)
    assert f"Could not write summaries in {logdir}: File too large (the disk is full" in out
    # What was flushed before is intact; TensorBoard reads the rest up to the torn record.
    points = fx.scalar_events(logdir, "loss")
    assert points[:2] == [(1, 1.0), (2, 2.0)]
    assert all(value == step for step, value in points)


@pytest.mark.slow  # a child process that imports JAX and exports
def test_export_write(tmp_path):
    model_dir, base = str(tmp_path / "model"), str(tmp_path / "exports")
    fx.train(model_dir, 2)
    code = f"""
        import numpy as np
        import ckpt_fixtures as fx
        import estimax as ex
        from estimax import export, storage
        est = fx.estimator({model_dir!r})
        spec = ex.TensorSpec((None, 6), np.float32)
        LIMIT
        try:
            print("PUBLISHED:", export.export_version(est, {base!r}, serving_input=spec))
        except storage.StorageError as e:
            print("ERROR:", e)
    """
    import estimax as ex
    from estimax import export

    est = fx.estimator(model_dir)
    spec = ex.TensorSpec((None, 6), np.float32)
    assert export.export_version(est, base, serving_input=spec) == os.path.join(base, "1")
    est.close()
    before = {f: open(f, "rb").read() for f in glob.glob(os.path.join(base, "1", "*"))}
    out = _child(code.replace("LIMIT", "limit_file_size(1024)"))
    assert "ERROR: " in out and f"Could not write the export {base}/" in out
    assert "(the disk is full or a file size limit was reached)" in out
    assert "Nothing was published" in out
    assert os.listdir(base) == ["1"]  # no version 2, no staging directory left
    assert {f: open(f, "rb").read() for f in glob.glob(os.path.join(base, "1", "*"))} == before
    from estimax.export import servable

    servable.Servable(os.path.join(base, "1"))  # still loads
    assert json.load(open(os.path.join(base, "1", "signature.json")))["global_step"] == 2


def test_converter_shard_write(tmp_path):
    out_dir = tmp_path / "out"
    out = _child(f"""
        import json, os
        import numpy as np
        from PIL import Image
        from estimax import storage
        from estimax.tools import convert_shards
        from estimax.tools.convert_sources import Item
        items = []
        for i in range(4):
            path = os.path.join({str(tmp_path)!r}, f"img{{i}}.png")
            pixels = np.random.default_rng(i).integers(0, 255, (64, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(path)
            items.append(Item(path, 1, "n01440764"))
        os.makedirs({str(out_dir)!r})
        first = convert_shards.ShardTask({str(out_dir)!r}, "train", 0, 2, tuple(items[:2]))
        print("FIRST:", json.dumps(convert_shards.write_shard(first)))
        limit_file_size(os.path.getsize(first.path) // 2)
        second = convert_shards.ShardTask({str(out_dir)!r}, "train", 1, 2, tuple(items[2:]))
        try:
            convert_shards.write_shard(second)
        except storage.StorageError as e:
            print("ERROR:", e)
    """)
    first = json.loads(out.split("FIRST: ", 1)[1].splitlines()[0])
    second_path = os.path.join(str(out_dir), "train-00001-of-00002")
    assert f"ERROR: [Errno 27] {second_path}: could not write the shard: File too large" in out
    # No partial shard or index, no temporary: the first shard and its index only.
    assert sorted(os.listdir(out_dir)) == [".estimax-index", "train-00000-of-00002"]
    assert os.listdir(os.path.join(out_dir, ".estimax-index")) == ["train-00000-of-00002.idx"]
    from estimax.data import tfrecord
    from estimax.tools import convert_shards

    kept = os.path.join(str(out_dir), "train-00000-of-00002")
    assert convert_shards.sha256_file(kept) == first["sha256"]
    assert len(list(tfrecord.read_records(kept))) == first["num_examples"] == 2
