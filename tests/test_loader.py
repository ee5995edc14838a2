"""The loader: order, determinism, exact resume, parallel workers, host sharding, bad records.

Records here are tiny: the 8-byte id of the record (file * 1000 + index). The transform returns
the id and a draw from the per-element RNG, so the tests see both which records a batch holds
and whether the randomness is reproducible.
"""

import functools
import json
import struct

import numpy as np
import pytest

from estimax.data import loader as L
from estimax.data import tfrecord


def _write_files(directory, num_files=3, per_file=(5, 7, 4)):
    paths = []
    for f in range(num_files):
        path = str(directory / tfrecord.sharded_name("train", f, num_files))
        with tfrecord.TFRecordWriter(path) as w:
            for i in range(per_file[f]):
                w.write(struct.pack("<q", f * 1000 + i))
        paths.append(path)
    return paths


def _transform(record: bytes, rng: np.random.Generator, fail_on=()):
    (rid,) = struct.unpack("<q", record)
    if rid in fail_on:
        raise ValueError(f"cannot decode image of record {rid}")
    return np.array([rid, rng.integers(1 << 30)], np.int64), np.int32(rid % 1000)


def _ids(batches):
    return [b[0][:, 0].tolist() for b in batches]


@pytest.fixture
def files(tmp_path):
    return _write_files(tmp_path)


ALL_IDS = sorted([f * 1000 + i for f, n in enumerate((5, 7, 4)) for i in range(n)])


def _loader(files, **kw):
    kw.setdefault("batch_size", 4)
    kw.setdefault("shuffle", True)
    kw.setdefault("num_workers", 0)
    kw.setdefault("seed", 7)
    source = kw.pop("source", None) or L.TFRecordSource(files)
    return L.Loader(source, kw.pop("transform", _transform), **kw)


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_eval_pass_is_finite_exact_and_keeps_remainder(files):
    ld = _loader(files, shuffle=False, num_epochs=1, drop_remainder=False, batch_size=5)
    batches = list(ld)
    # 16 records -> 5 + 5 + 5 + 1; file order, every record exactly once
    assert [len(b[1]) for b in batches] == [5, 5, 5, 1]
    assert sum(_ids(batches), []) == ALL_IDS
    assert batches[0][1].dtype == np.int32
    assert len(ld) == 4


def test_train_epochs_reshuffle_and_cover_everything(files):
    it = iter(_loader(files, batch_size=4))
    epoch0, epoch1 = sum(_ids(_take(it, 4)), []), sum(_ids(_take(it, 4)), [])
    assert sorted(epoch0) == ALL_IDS and sorted(epoch1) == ALL_IDS
    assert epoch0 != epoch1  # a new permutation each epoch
    assert epoch0 != ALL_IDS
    assert it.get_state()["epoch"] == 2 and it.get_state()["position"] == 0


def test_same_seed_same_batches_other_seed_differs(files):
    a = _take(iter(_loader(files, seed=3)), 6)
    b = _take(iter(_loader(files, seed=3)), 6)
    c = _take(iter(_loader(files, seed=4)), 6)
    for x, y in zip(a, b, strict=False):
        np.testing.assert_array_equal(x[0], y[0])
        np.testing.assert_array_equal(x[1], y[1])
    assert _ids(a) != _ids(c)


@pytest.mark.parametrize("k", [1, 3, 4, 5])  # 4 batches of 4 = one epoch of 16: boundary cases
def test_resume_from_state_matches_uninterrupted(files, k):
    reference = _take(iter(_loader(files, batch_size=4, prefetch=3)), k + 6)
    it = iter(_loader(files, batch_size=4, prefetch=3))
    _take(it, k)
    # Prefetching has run ahead; the state must still say "after k batches".
    state = json.loads(json.dumps(it.get_state()))
    it.close()
    resumed = iter(_loader(files, batch_size=4, prefetch=3))
    resumed.set_state(state)
    for want, got in zip(reference[k:], _take(resumed, 6), strict=False):
        np.testing.assert_array_equal(want[0], got[0])


def test_resume_batch_straddling_epochs(files):
    # batch 3 of 5 elements spans epochs 0/1 (16 records); resume right after it
    reference = _take(iter(_loader(files, batch_size=5)), 8)
    it = iter(_loader(files, batch_size=5))
    _take(it, 4)
    assert it.get_state()["epoch"] == 1 and it.get_state()["position"] == 4
    resumed = iter(_loader(files, batch_size=5))
    resumed.set_state(it.get_state())
    assert _ids(_take(resumed, 4)) == _ids(reference[4:])


@pytest.mark.parametrize("worker_type, num_workers", [("thread", 2), ("process", 2)])
def test_parallel_workers_same_batches_and_resume(files, worker_type, num_workers):
    reference = _take(iter(_loader(files, batch_size=3)), 9)
    kw = dict(batch_size=3, num_workers=num_workers, worker_type=worker_type, chunk_size=2)
    it = iter(_loader(files, **kw))
    got = _take(it, 4)
    state = it.get_state()
    it.close()
    resumed = iter(_loader(files, **kw))
    resumed.set_state(state)
    got += _take(resumed, 5)
    resumed.close()
    for want, g in zip(reference, got, strict=False):
        np.testing.assert_array_equal(want[0], g[0])  # ids and RNG draws


def test_set_state_rejects_other_data(files):
    it = iter(_loader(files))
    state = it.get_state()
    other = iter(_loader(files[:2]))
    with pytest.raises(ValueError, match="num_records=16 but this loader has num_records=12"):
        other.set_state(state)
    with pytest.raises(ValueError, match="seed=7 but this loader has seed=8"):
        iter(_loader(files, seed=8)).set_state(state)


@pytest.mark.parametrize("num_hosts", [1, 2, 3, 4])
def test_host_file_sharding_covers_every_file_once(tmp_path, num_hosts):
    files = _write_files(tmp_path, num_files=3)
    seen_files, seen_ids = [], []
    for host in range(num_hosts):
        mine = L.host_shard(files, host, num_hosts)
        seen_files += mine
        if mine:
            ld = _loader(mine, shuffle=False, num_epochs=1, drop_remainder=False)
            seen_ids += sum(_ids(ld), [])
    assert sorted(seen_files) == files
    assert sorted(seen_ids) == ALL_IDS
    with pytest.raises(ValueError, match="host_index 2 out of range for num_hosts 2"):
        L.host_shard(files, 2, 2)


def test_record_level_sharding_via_record_ids(files):
    source = L.TFRecordSource(files)
    seen = []
    for host in range(3):
        ld = _loader(
            files,
            source=source,
            record_ids=L.host_shard(range(len(source)), host, 3),
            num_epochs=1,
            drop_remainder=False,
        )
        seen += sum(_ids(ld), [])
    assert sorted(seen) == ALL_IDS


def test_transform_error_names_file_and_offset(files):
    bad = functools.partial(_transform, fail_on={1003})
    ld = _loader(files, transform=bad, shuffle=False, num_epochs=1, drop_remainder=False)
    with pytest.raises(L.BadRecordError) as e:
        list(ld)
    # record 3 of file 1: offset 3 * (12 + 8 + 4)
    assert str(e.value) == (
        f"{files[1]}: record at byte offset 72: ValueError: cannot decode image of record 1003"
    )


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_skip_bad_records_counts_and_keeps_shapes(files, worker_type):
    bad = functools.partial(_transform, fail_on={0, 1003})
    ld = _loader(
        files,
        transform=bad,
        shuffle=False,
        num_epochs=1,
        drop_remainder=False,
        skip_bad_records=True,
        batch_size=4,
        num_workers=2,
        worker_type=worker_type,
    )
    it = iter(ld)
    batches = list(it)
    assert it.num_skipped == 2
    # A one-pass input drops them: the blocks they were in are smaller.
    assert [len(b[1]) for b in batches] == [3, 4, 3, 4]
    assert sorted(sum(_ids(batches), [])) == [i for i in ALL_IDS if i not in (0, 1003)]


def test_skip_count_survives_resume(files):
    bad = functools.partial(_transform, fail_on={1, 2})
    kw = dict(transform=bad, shuffle=False, skip_bad_records=True, batch_size=4)
    it = iter(_loader(files, **kw))
    _take(it, 1)
    assert it.num_skipped == 2
    resumed = iter(_loader(files, **kw))
    resumed.set_state(it.get_state())
    assert resumed.num_skipped == 2
    _take(resumed, 4)  # into epoch 1: the two are skipped again
    assert resumed.num_skipped == 4


def _corrupt_file(files, which, offset_in_file):
    with open(files[which], "r+b") as f:
        f.seek(offset_in_file)
        byte = f.read(1)
        f.seek(offset_in_file)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_bad_crc_raises_or_skips(files):
    _corrupt_file(files, 2, 24 + 12 + 1)  # data of record 1 of file 2 (offset 24)
    with pytest.raises(
        L.BadRecordError,
        match=r"train-00002-of-00003: record at byte offset 24:"
        r" data CRC mismatch",
    ):
        list(_loader(files, shuffle=False, num_epochs=1, drop_remainder=False))
    it = iter(
        _loader(files, shuffle=False, num_epochs=1, drop_remainder=False, skip_bad_records=True)
    )
    ids = sum(_ids(it), [])
    assert it.num_skipped == 1 and 2001 not in ids and len(ids) == 15


def test_truncated_file_raises_or_skips(files):
    with open(files[0], "r+b") as f:
        f.truncate(4 * 24 + 10)  # record 4 of file 0 cut inside its data
    with pytest.raises(
        tfrecord.CorruptRecordError,
        match=r"train-00000-of-00003: record at byte offset 96: truncated",
    ):
        L.TFRecordSource(files)
    source = L.TFRecordSource(files, skip_bad_records=True)
    assert source.num_records_per_file() == [4, 7, 4]
    it = iter(_loader(files, source=source, shuffle=False, num_epochs=1, drop_remainder=False))
    assert sorted(sum(_ids(it), [])) == [i for i in ALL_IDS if i != 4]
    assert it.num_skipped == 1


def test_empty_inputs_rejected(tmp_path):
    with pytest.raises(ValueError, match="needs at least one file"):
        L.TFRecordSource([])
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="no records to read"):
        _loader([str(empty)])


def test_data_layer_imports_no_jax_or_upper_layers():
    """estimax/data imports no JAX, Flax, Optax, estimator or models (docs/design.md §2)."""
    import ast
    import pathlib

    import estimax.data

    banned = (
        "jax",
        "jaxlib",
        "flax",
        "optax",
        "orbax",
        "grain",
        "estimax.estimator",
        "estimax.models",
        "estimax.programs",
    )
    offenders = []
    for py in pathlib.Path(estimax.data.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [
                f"{py.name}: {n}"
                for n in names
                if any(n == b or n.startswith(b + ".") for b in banned)
            ]
    assert offenders == []


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dropped_iterator_stops_its_thread_and_workers(files, num_workers):
    import gc
    import threading

    before = set(threading.enumerate())
    it = iter(_loader(files, num_workers=num_workers, prefetch=1))
    next(it)  # the producer now blocks on its full queue
    mine = [t for t in set(threading.enumerate()) - before if t.name == "estimax-loader"]
    assert len(mine) == 1
    del it
    gc.collect()
    assert not mine[0].is_alive()


def _side_by_side(files, num_hosts, steps, state=None, **kw):
    its = [iter(_loader(files, num_hosts=num_hosts, host_index=h, **kw)) for h in range(num_hosts)]
    if state is not None:
        for it in its:
            it.set_state(state)
    batches = [np.concatenate([next(it)[0][:, 0] for it in its]).tolist() for _ in range(steps)]
    states = [it.get_state() for it in its]
    assert all(st == states[0] for st in states)  # one position, the same on every host
    for it in its:
        it.close()
    return batches, states[0]


@pytest.mark.parametrize("num_hosts", [2, 4])
def test_hosts_together_read_one_hosts_batches_and_resume_on_any_count(files, num_hosts):
    # 16 records in global batches of 8: epoch 0 ends after 2 batches; 6 batches span 3 epochs.
    one, _ = _side_by_side(files, 1, 6, batch_size=8)
    many, _ = _side_by_side(
        files, num_hosts, 6, batch_size=8 // num_hosts, num_workers=2, worker_type="thread"
    )
    assert many == one
    # Saved on num_hosts hosts after 3 global batches, resumed on 1 and on 2 hosts.
    _, state = _side_by_side(files, num_hosts, 3, batch_size=8 // num_hosts)
    assert state["order"] == "global"
    assert _side_by_side(files, 1, 3, state, batch_size=8)[0] == one[3:]
    assert _side_by_side(files, 2, 3, state, batch_size=4)[0] == one[3:]


def test_the_per_element_randomness_does_not_depend_on_the_host_count(files):
    one = next(iter(_loader(files, batch_size=6)))[0]
    parts = [
        next(iter(_loader(files, batch_size=2, num_hosts=3, host_index=h)))[0] for h in range(3)
    ]
    np.testing.assert_array_equal(np.concatenate(parts), one)


def test_training_skip_fills_each_hosts_block_from_its_own_records(files):
    # Records 1 and 2 are bad. Unshuffled, host 0 of 2 reads [0, 1] and host 1 [2, 3] of the
    # first global batch of 4: each bad record is replaced by the good one before it (after it,
    # for the first), so both hosts keep full batches and the global order stays aligned.
    bad = functools.partial(_transform, fail_on={1, 2})
    kw = dict(transform=bad, shuffle=False, skip_bad_records=True, batch_size=2, num_hosts=2)
    h0, h1 = (iter(_loader(files, host_index=h, **kw)) for h in range(2))
    assert next(h0)[0][:, 0].tolist() == [0, 0]
    assert next(h1)[0][:, 0].tolist() == [3, 3]
    assert h0.num_skipped == h1.num_skipped == 1
    assert h0.get_state()["position"] == h1.get_state()["position"] == 4
    with pytest.raises(L.BadRecordError, match="every other record of this host's block"):
        next(
            iter(
                _loader(files, **dict(kw, transform=functools.partial(_transform, fail_on={0, 1})))
            )
        )


def test_an_old_per_host_position_restarts_a_many_host_input(files, caplog):
    it = iter(_loader(files, batch_size=2, num_hosts=2, host_index=1))
    old = {
        "version": 1,
        "epoch": 2,
        "position": 3,
        "num_skipped": 0,
        "seed": 7,
        "shuffle": True,
        "num_records": 8,
    }
    it.set_state(old)
    assert "input restarts from its beginning" in caplog.text
    assert (it.get_state()["epoch"], it.get_state()["position"]) == (0, 0)
    one = iter(_loader(files))  # one host: its count was the stream's
    one.set_state(dict(old, num_records=16))
    assert (one.get_state()["epoch"], one.get_state()["position"]) == (2, 3)


def _trained_positions(files, num_hosts, pattern):
    """Each host's input position after 2 batches of a job of ``num_hosts`` whose input_fn
    builds its Loader by ``pattern``: ``"host_shard"`` (each host its own share, the
    pattern docs/contract.md showed before) or ``"global"`` (num_hosts=, host_index=)."""
    states = []
    for h in range(num_hosts):
        ld = _host_loader(files, num_hosts, h, pattern)
        it = iter(ld)
        _take(it, 2)
        states.append(it.get_state())
    return states


def _host_loader(files, num_hosts, h, pattern):
    source = L.TFRecordSource(files)
    if pattern == "host_shard":
        ids = L.host_shard(np.arange(len(source)), h, num_hosts)
        return _loader(files, batch_size=2, source=source, record_ids=ids)
    return _loader(files, batch_size=2, source=source, num_hosts=num_hosts, host_index=h)


@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (1, 2)])
def test_a_host_shard_input_resumed_on_another_host_count_restarts_with_a_warning(
    files, saved, resumed, monkeypatch, caplog
):
    import jax

    from estimax.estimator import batches

    states = _trained_positions(files, saved, "host_shard")
    meta = {"input_states": states} if saved > 1 else {"input_state": states[0]}
    monkeypatch.setattr(jax, "process_count", lambda: resumed)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    current = iter(_host_loader(files, resumed, 0, "host_shard")).get_state()
    # Not the loader's "num_records=8 but this loader has num_records=16" error: a restart.
    assert batches._input_state_of_this_process(meta, current) is None
    assert "The input restarts from its beginning" in caplog.text
    assert "Loader(num_hosts=, host_index=)" in caplog.text


@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (1, 2)])
def test_the_documented_input_resumes_exactly_on_another_host_count(
    files, saved, resumed, monkeypatch
):
    import jax

    from estimax.estimator import batches

    states = _trained_positions(files, saved, "global")
    meta = {"input_states": states} if saved > 1 else {"input_state": states[0]}
    monkeypatch.setattr(jax, "process_count", lambda: resumed)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    ids_after = []
    for h in range(resumed):
        it = iter(_host_loader(files, resumed, h, "global"))
        it.set_state(batches._input_state_of_this_process(meta, it.get_state()))
        ids_after.append(_ids(_take(it, 2)))
    # The stream after 2 global batches of 2 x saved rows, as one uninterrupted host reads it.
    one = iter(_loader(files, batch_size=2 * resumed))
    _take(one, 2 * saved // resumed)
    expected = _ids(_take(one, 2))
    joined = [sum((ids_after[h][k] for h in range(resumed)), []) for k in range(2)]
    assert joined == expected


def test_a_host_share_given_a_whole_position_says_what_to_do(files):
    whole = iter(_loader(files, batch_size=2))
    _take(whole, 1)
    share = iter(_host_loader(files, 2, 0, "host_shard"))
    with pytest.raises(ValueError, match=r"give every host all the record_ids with num_hosts="):
        share.set_state(whole.get_state())
