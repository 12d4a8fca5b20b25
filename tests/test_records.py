"""Ranking records (gem_jax/data/records/): the codec, the reader's answers to bad data, shards written by
the synthetic task packing into the generator's very packs, Parquet and MovieLens ingest."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from gem_jax.config import ConfigError
from gem_jax.data.batch import pack_examples
from gem_jax.data.pipeline import example_range, packed_dataset
from gem_jax.data.records import codec, movielens
from gem_jax.data.records.codec import Invalid, Record
from gem_jax.data.records.dataset import RecordsData
from gem_jax.data.records.errors import BadRecord, BadShard, TooManyBadRecords
from gem_jax.data.records.reader import counts_in_state
from gem_jax.data.records.schema import RecordSchema, ShardInfo, ShardSet, SparseFeature, write_schema
from gem_jax.data.records.synthetic import synthetic_records, synthetic_schema
from gem_jax.data.records.writer import ShardJob, _sha256, even_ranges, shard_name, write_shards
from gem_jax.data.synthetic import SyntheticAds
from tests.helpers import public_data_file, small_config

SCHEMA = RecordSchema(
    tasks=("click", "conversion"),
    num_candidates=2,
    item_vocab=100,
    action_vocab=5,
    sparse_features=(SparseFeature("segment", 20), SparseFeature("tags")),
    dense_features=("d0", "d1"),
)


def make_record(i: int, history: int = 5) -> Record:
    rng = np.random.default_rng(i)
    times = np.sort(rng.integers(1000, 2000, history))
    return Record(
        request_id=i,
        user_id=10 * i,
        timestamp=3000 + i,
        candidates=rng.integers(1, 100, 2),
        labels=rng.integers(0, 2, (2, 2)).astype(np.float32),
        sparse=[rng.integers(0, 20, 1), rng.integers(0, 10**6, int(rng.integers(0, 4)))],
        dense=rng.normal(size=2).astype(np.float32),
        history_items=rng.integers(0, 100, history),
        history_actions=rng.integers(1, 5, history),
        history_timestamps=times,
    )


def write_raw(directory: Path, schema: RecordSchema, shards: list[list[bytes]]) -> ShardSet:
    """A shard set of the given record bytes, written past the writers' checks (as a buggy tool would)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    directory.mkdir(parents=True, exist_ok=True)
    infos = []
    for i, records in enumerate(shards):
        path = directory / shard_name(i, len(shards))
        w = ArrayRecordWriter(str(path), "group_size:1,uncompressed")
        for data in records:
            w.write(data)
        w.close()
        stats = {"records": len(records), "labels": 0, "label_sums": [0.0] * len(schema.tasks)}
        stats |= {"history_events": 0, "history_max": 0, "history_hist": {}}
        infos.append(ShardInfo(path, len(records), path.stat().st_size, _sha256(path), stats))
    write_schema(directory, schema, infos)
    return ShardSet.open(str(directory))


def records_config(path, *overrides):
    return small_config(
        "data.kind=records",
        f"data.path={path}",
        "data.num_candidates=2",
        'model.tasks=["click", "conversion"]',
        "data.num_dense_features=2",
        *overrides,
    )


def read_all(config) -> tuple[list[dict], dict]:
    """Every example of the shards, in order (read as the validation split), and the stream's counts."""
    data = RecordsData(
        dataclasses.replace(config, data=dataclasses.replace(config.data, eval_path=config.data.path))
    )
    ds = data.stream(data.examples("valid").to_iter_dataset())
    it = iter(ds)
    examples = list(it)
    return examples, counts_in_state(it.get_state())


# ----------------------------------------------------------------------------- codec


def test_record_round_trip_and_views():
    r = make_record(3, history=7)
    back = codec.decode(codec.encode(r), SCHEMA)
    for field in ("request_id", "user_id", "timestamp"):
        assert getattr(back, field) == getattr(r, field)
    for field in ("candidates", "labels", "dense", "history_items", "history_actions", "history_timestamps"):
        np.testing.assert_array_equal(getattr(back, field), getattr(r, field))
    assert [b.tolist() for b in back.sparse] == [list(b) for b in r.sparse]
    p = codec.parse(codec.encode(r), SCHEMA)
    assert p.items.base is not None  # a view into the record's words, no copy
    np.testing.assert_array_equal(p.items, np.concatenate([r.history_items, r.candidates]))


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            lambda r: setattr(r, "history_items", r.history_items.astype(np.float64)),
            "float64, expected integers",
        ),
        (lambda r: setattr(r, "candidates", np.array([1, 2**40])), "outside int32"),
        (lambda r: setattr(r, "labels", np.zeros((3, 2))), "labels have shape"),
    ],
)
def test_encode_refuses_wrong_types(change, needle):
    r = make_record(0)
    change(r)
    with pytest.raises(Invalid, match=re.escape(needle)):
        codec.encode(r)


# Every way a record can break the schema once written, and the reason the reader gives.
def _dtype_word(data: bytes) -> bytes:
    words = np.frombuffer(data, "<i4").copy()
    words[1] = int.from_bytes(b"f\x04f\x04", "little")  # "ids written as float32"
    return words.tobytes()


def _uneven(data: bytes) -> bytes:
    words = np.frombuffer(data, "<i4").copy()
    words[3] -= 1  # one action fewer than items: then the sizes disagree too, the lengths are named first
    return words.tobytes()


def _with(field, value):
    def change(data: bytes) -> bytes:
        r = codec.decode(data, SCHEMA)
        setattr(r, field, value(r))
        return codec.encode(r)

    return change


BAD = {
    "wrong type": (_dtype_word, "wrong type"),
    "negative id": (_with("history_items", lambda r: np.array([1, -4, 2, 3, 5])), "negative item id -4"),
    "out-of-range id": (
        _with("candidates", lambda r: np.array([7, 100])),
        "item id 100 out of range [0, 100)",
    ),
    "sparse id out of range": (
        _with("sparse", lambda r: [np.array([20]), r.sparse[1]]),
        "segment id 20 out of range",
    ),
    "NaN dense": (_with("dense", lambda r: np.array([0.5, np.nan])), "dense feature d1 is nan"),
    "unequal lists": (_uneven, "history lists of unequal length: 5 items, 4 actions, 5 timestamps"),
    "cut record": (lambda data: data[:-8], "a cut or malformed record"),
    "future event": (_with("history_timestamps", lambda r: r.history_timestamps + 10**6), "a future event"),
    "label outside [0, 1]": (_with("labels", lambda r: np.full((2, 2), 2.0)), "labels outside [0, 1]"),
}


def _shards_with_bad_record(tmp_path: Path, corrupt) -> ShardSet:
    records = [codec.encode(make_record(i)) for i in range(12)]
    records[7] = corrupt(records[7])  # shard 1, record 1
    return write_raw(tmp_path / "shards", SCHEMA, [records[:6], records[6:]])


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_record_stops_with_one_line_naming_shard_and_record(tmp_path, case):
    corrupt, needle = BAD[case]
    _shards_with_bad_record(tmp_path, corrupt)
    config = records_config(tmp_path / "shards")
    with pytest.raises(BadRecord) as e:
        read_all(config)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path / 'shards' / shard_name(1, 2)}: record 1: "), message
    assert needle in message, message


def test_skip_counts_bad_records_and_stops_past_the_cap(tmp_path):
    records = [codec.encode(make_record(i)) for i in range(12)]
    for i in (2, 7, 9):
        records[i] = BAD["NaN dense"][0](records[i])
    write_raw(tmp_path / "shards", SCHEMA, [records[:6], records[6:]])
    examples, counts = read_all(records_config(tmp_path / "shards", "data.bad_records=skip"))
    assert len(examples) == 9 and counts["skipped_records"] == 3
    assert sorted(int(e["timestamps"][-1]) - 3000 for e in examples) == [0, 1, 3, 4, 5, 6, 8, 10, 11]
    with pytest.raises(
        TooManyBadRecords, match="more than data.max_bad_records = 2 .*dense feature d1 is nan"
    ):
        read_all(records_config(tmp_path / "shards", "data.bad_records=skip", "data.max_bad_records=2"))


def test_long_histories_keep_their_most_recent_events_and_are_counted(tmp_path):
    records = [make_record(i, history=h) for i, h in enumerate([3, 10, 4, 12])]
    write_raw(tmp_path / "shards", SCHEMA, [[codec.encode(r) for r in records]])
    examples, counts = read_all(records_config(tmp_path / "shards", "data.max_history_len=4"))
    assert counts["histories_cut"] == 2
    for r, e in zip(records, examples):
        keep = min(len(r.history_items), 4)
        np.testing.assert_array_equal(e["item_ids"][:keep], r.history_items[-keep:])
        np.testing.assert_array_equal(e["timestamps"][:keep], r.history_timestamps[-keep:])
        assert len(e["item_ids"]) == keep + 2


def test_truncated_and_unreadable_shards_are_named(tmp_path):
    shard_set = _shards_with_bad_record(tmp_path, lambda d: d)
    path = shard_set.shards[1].path
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        BadShard, match=re.escape(f"{path}: {len(data) // 2} bytes, its schema.json says {len(data)}")
    ):
        RecordsData(records_config(tmp_path / "shards"))
    path.write_bytes(b"\0" * len(data))  # the recorded size, but not an ArrayRecord file
    with pytest.raises(BadShard, match=re.escape(f"{path}: unreadable")):
        read_all(records_config(tmp_path / "shards"))
    path.unlink()
    with pytest.raises(BadShard, match="listed in schema.json but missing"):
        RecordsData(records_config(tmp_path / "shards"))


def test_config_must_match_the_schema(tmp_path):
    _shards_with_bad_record(tmp_path, lambda d: d)
    path = tmp_path / "shards"
    with pytest.raises(ConfigError, match=r"`data.num_candidates` is 1, the shards have 2"):
        RecordsData(records_config(path, "data.num_candidates=1"))
    with pytest.raises(ConfigError, match=r"`model.tasks` names tasks \['like'\]"):
        RecordsData(records_config(path, 'model.tasks=["like"]'))
    with pytest.raises(ConfigError, match="`data.sparse_features` names sparse features"):
        RecordsData(records_config(path, 'data.sparse_features={nope = "sparse", tags = "sparse"}'))
    with pytest.raises(ConfigError, match="`data.path`: no shard directory"):
        RecordsData(records_config(tmp_path / "absent"))
    with pytest.raises(
        ConfigError, match="`data.sparse_features` names 1 features, `data.num_sparse_features` is 2"
    ):
        records_config(path, 'data.sparse_features={tags = "sparse"}')


def test_tasks_and_features_are_picked_by_name(tmp_path):
    r = make_record(1)
    write_raw(tmp_path / "shards", SCHEMA, [[codec.encode(r)]])
    config = records_config(
        tmp_path / "shards",
        'model.tasks=["conversion"]',
        'data.sparse_features={tags = "sparse", segment = "sparse"}',
        'data.dense_features=["d1"]',
        "data.num_dense_features=1",
    )
    (e,), _ = read_all(config)
    np.testing.assert_array_equal(e["labels"], r.labels[:, [1]])
    assert [list(b) for b in e["sparse_ids"]] == [list(r.sparse[1]), list(r.sparse[0])]
    np.testing.assert_array_equal(e["dense"], r.dense[[1]])


# ----------------------------------------------------------------------------- synthetic


def synth_shards(directory: Path, config, n: int, start: int = 0, shards: int = 3) -> None:
    ranges = [(start + a, start + b) for a, b in even_ranges(n, shards)]
    jobs = [ShardJob(i, len(ranges), r) for i, r in enumerate(ranges)]
    write_shards(
        directory,
        synthetic_schema(config),
        jobs,
        synthetic_records,
        (config, None),
        workers=1,
        progress=False,
    )


def test_synthetic_shards_pack_into_the_generators_packs(tmp_path):
    """Examples 0..N-1 written out and read back in order give bitwise the generator's stacks."""
    c = small_config()
    synth_shards(tmp_path / "valid", c, 150)
    rc = small_config(
        "data.kind=records", f"data.path={tmp_path / 'valid'}", f"data.eval_path={tmp_path / 'valid'}"
    )
    data = RecordsData(rc)
    kw = dict(
        examples_capacity=8, tokens_capacity=256, num_sparse_features=2, max_bag_size=4, prefix=2, shards=2
    )
    kw.update(process_index=0, process_count=1)
    gen = SyntheticAds(c.data, 2)
    expected = list(packed_dataset(example_range(gen.example, 0, 150), **kw))
    got = list(packed_dataset(data.examples("valid"), stream=data.stream, **kw))
    assert len(got) == len(expected) > 5
    for a, b in zip(expected, got):
        jax.tree.map(np.testing.assert_array_equal, a, b)


def test_training_order_is_a_global_shuffle_new_every_epoch(tmp_path):
    c = small_config()
    synth_shards(tmp_path / "train", c, 40, shards=4)
    data = RecordsData(small_config("data.kind=records", f"data.path={tmp_path / 'train'}"))
    ds = data.examples("train")
    first = [int(ds[i]["timestamps"][-1]) for i in range(40)]
    second = [int(ds[i]["timestamps"][-1]) for i in range(40, 80)]
    assert sorted(first) == sorted(second) and first != second
    assert first != sorted(first)  # shuffled across shards


# ----------------------------------------------------------------------------- Parquet


def test_parquet_round_trip_and_bad_rows(tmp_path):
    from gem_jax.data.records import parquet

    records = [make_record(i, history=i % 4) for i in range(30)]
    parquet.write_parquet(records, SCHEMA, tmp_path / "a.parquet", row_group_size=8)
    files = [tmp_path / "a.parquet"]
    schema = parquet.infer_schema(files)
    assert schema.tasks == SCHEMA.tasks and schema.sparse_names == SCHEMA.sparse_names
    groups = parquet.row_groups(files)
    jobs = [ShardJob(i, len(groups), [g[:3]]) for i, g in enumerate(groups)]
    write_shards(tmp_path / "out", schema, jobs, parquet.parquet_records, schema, workers=1, progress=False)
    shard_set = ShardSet.open(str(tmp_path / "out"))
    assert shard_set.num_records == 30 and len(shard_set.shards) == 4
    from gem_jax.data.records.reader import ShardSource

    source = ShardSource(shard_set)
    back = [codec.decode(source[i][1], schema) for i in range(30)]
    for r, b in zip(records, back):
        assert (b.request_id, b.user_id, b.timestamp) == (r.request_id, r.user_id, r.timestamp)
        np.testing.assert_array_equal(b.labels, r.labels)
        np.testing.assert_array_equal(b.history_timestamps, r.history_timestamps)
        assert [list(x) for x in b.sparse] == [list(x) for x in r.sparse]
    # A row with history lists of unequal length: stop naming file and row, or skip and count.
    records[11].history_actions = records[11].history_actions[:-1]
    parquet.write_parquet(records, SCHEMA, tmp_path / "b.parquet", row_group_size=8)
    jobs = [ShardJob(0, 1, [g[:3] for g in parquet.row_groups([tmp_path / "b.parquet"])])]
    with pytest.raises(
        BadRecord, match=re.escape(f"{tmp_path / 'b.parquet'} row 11: history lists of unequal")
    ):
        write_shards(
            tmp_path / "out2", schema, jobs, parquet.parquet_records, schema, workers=1, progress=False
        )
    w = write_shards(
        tmp_path / "out2",
        schema,
        jobs,
        parquet.parquet_records,
        schema,
        workers=1,
        progress=False,
        skip_bad=True,
    )
    assert w.records == 29 and w.skipped == 1


def test_parquet_column_of_the_wrong_type_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gem_jax.data.records import parquet

    table = pa.table(
        {
            "timestamp": pa.array([5, 6]),
            "candidates": pa.array([[1.5], [2.0]], pa.list_(pa.float64())),
            "label_click": pa.array([[1.0], [0.0]]),
        }
    )
    pq.write_table(table, tmp_path / "f.parquet")
    schema = parquet.infer_schema([tmp_path / "f.parquet"])
    jobs = [ShardJob(0, 1, [(str(tmp_path / "f.parquet"), 0, 0)])]
    with pytest.raises(BadRecord, match=r"f.parquet: column candidates holds double, expected integer ids"):
        write_shards(tmp_path / "o", schema, jobs, parquet.parquet_records, schema, workers=1, progress=False)


# ----------------------------------------------------------------------------- MovieLens


def write_movielens(directory: Path, layout: str) -> None:
    """A tiny MovieLens directory in a GroupLens layout: 3 users, 4 items, 12 ratings."""
    directory.mkdir(parents=True)
    ratings = [  # user, item, rating, time: user 1 rates item 2 and 3 in the same second
        (1, 1, 5, 100), (1, 2, 3, 200), (1, 3, 4, 200), (1, 4, 1, 300), (2, 1, 4, 150), (2, 3, 5, 250),
        (2, 2, 2, 350), (3, 4, 5, 120), (3, 1, 2, 220), (3, 2, 4, 320), (3, 3, 5, 420), (1, 1, 4, 500),
    ]  # fmt: skip
    users = [
        (1, 24, "M", "technician", "85711"),
        (2, 53, "F", "other", "94043"),
        (3, 33, "F", "writer", "32067"),
    ]
    movies = [(1, "Toy Story (1995)", "Animation|Comedy"), (2, "Heat (1995)", "Action|Thriller")]
    movies += [(3, "Fargo (1996)", "Crime|Drama"), (4, "Alien (1979)", "Horror|Sci-Fi")]
    if layout == "ml-100k":
        (directory / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in ratings))
        (directory / "u.user").write_text("".join("|".join(map(str, u)) + "\n" for u in users))
        flags = {
            m: ["1" if g in genres.split("|") else "0" for g in movielens.ML100K_GENRES]
            for m, _, genres in movies
        }
        (directory / "u.item").write_text(
            "".join(f"{m}|{t}|01-Jan-{t[-5:-1]}||http://x|" + "|".join(flags[m]) + "\n" for m, t, _ in movies)
        )
    elif layout == "ml-1m":
        (directory / "ratings.dat").write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in ratings))
        occupation = {"technician": 17, "other": 0, "writer": 20}
        (directory / "users.dat").write_text(
            "".join(f"{u}::{g}::{25 if a < 35 else 50}::{occupation[o]}::{z}\n" for u, a, g, o, z in users)
        )
        (directory / "movies.dat").write_text("".join(f"{m}::{t}::{g}\n" for m, t, g in movies))
    else:
        (directory / "ratings.csv").write_text(
            "userId,movieId,rating,timestamp\n"
            + "".join(f"{u},{i},{r - 0.5},{t}\n" for u, i, r, t in ratings)
        )
        (directory / "movies.csv").write_text(
            "movieId,title,genres\n" + "".join(f'{m},"{t}",{g}\n' for m, t, g in movies)
        )


@pytest.mark.parametrize("layout", ["ml-100k", "ml-1m", "ml-20m"])
def test_movielens_layouts_become_time_ordered_records_without_future_history(tmp_path, layout):
    write_movielens(tmp_path / layout, layout)
    data = movielens.load(tmp_path / layout)
    assert data.layout == layout and len(data.users) == 12
    p = movielens.prepare(data, max_history=2, train=0.5, valid=0.25)
    assert p.splits == {"train": (0, 6), "valid": (6, 9), "test": (9, 12)}
    records = [r for _, r in movielens.movielens_records(p, (0, 12))]
    times = [r.timestamp for r in records]
    assert times == sorted(times)
    for r in records:
        assert (
            r.history_timestamps < r.timestamp
        ).all()  # strictly earlier: same-second ratings are not history
        codec.check_record(r, p.schema)
    by_user_time = {(r.user_id, r.timestamp, int(r.candidates[0])): r for r in records}
    third = by_user_time[(1, 300, 4)]  # user 1's ratings at 100 and 200 (two) before: the 2 most recent kept
    np.testing.assert_array_equal(third.history_timestamps, [200, 200])
    assert sorted(third.history_items.tolist()) == [2, 3]
    same_second = by_user_time[(1, 200, 3)]
    np.testing.assert_array_equal(same_second.history_items, [1])  # not item 2, rated in the same second
    like = by_user_time[(1, 100, 1)]
    assert like.labels[0, 0] == 1.0 and by_user_time[(1, 300, 4)].labels[0, 0] == 0.0
    # The action is the rating: 5 stars, or ML-20M's 4.5 stars as 9 (twice the rating).
    np.testing.assert_array_equal(same_second.history_actions, [9 if layout == "ml-20m" else 5])
    names = p.schema.sparse_names
    assert names[0] == "user" and names[-2:] == ("genres", "year")
    assert ("gender" in names) == (layout != "ml-20m")
    genres = like.sparse[names.index("genres")]
    assert len(genres) == 2
    assert like.sparse[names.index("year")][0] == 95


def _ml100k() -> Path | None:
    """The GroupLens ML-100K folder, looked up as every public data file is (tests/helpers.py)."""
    u_data = public_data_file("movielens/ml-100k/u.data")
    return None if u_data is None else u_data.parent


@pytest.mark.skipif(
    _ml100k() is None, reason='ML-100K is absent (README, "Public data": data/movielens/ml-100k)'
)
def test_real_ml100k_loads_with_its_published_counts():
    data = movielens.load(_ml100k())
    assert (len(data.users), len(set(data.users.tolist())), len(set(data.items.tolist()))) == (
        100_000,
        943,
        1682,
    )
    assert abs(float((data.ratings >= 4).mean()) - 0.554) < 0.001  # 55.4% of all 100,000 ratings are 4 or 5
    p = movielens.prepare(data, max_history=64)
    assert {k: b - a for k, (a, b) in p.splits.items()} == {"train": 80_000, "valid": 10_000, "test": 10_000}
    last_train = data.times[p.order[p.splits["train"][1] - 1]]
    assert (data.times[p.order[p.splits["valid"][0] :]] >= last_train).all()


# ----------------------------------------------------------------------------- the feature map


def test_feature_map_groups_bags_by_embedding_feature():
    from gem_jax.model.gem import _FEATURE_SALT, embedding_ids, sparse_feature_groups

    config = small_config(
        "data.num_sparse_features=3", 'data.kind=records', "data.path=x",
        'data.sparse_features={a = "users", b = "attrs", c = "attrs"}',
    )  # fmt: skip
    groups = sparse_feature_groups(config.data)
    assert groups == {"users": (0,), "attrs": (1, 2)}
    assert sparse_feature_groups(small_config().data) == {"sparse": (0, 1)}
    rng = np.random.default_rng(0)
    bags = [[rng.integers(1, 50, int(rng.integers(0, 4))) for _ in range(3)] for _ in range(4)]  # 4 examples
    examples = [
        {"item_ids": np.array([1, 2]), "action_ids": np.array([1, 0]), "timestamps": np.array([5, 6]),
         "num_targets": 1, "sparse_ids": example, "dense": np.zeros(0, np.float32), "labels": np.zeros((1, 1))}
        for example in bags
    ]  # fmt: skip
    pack = pack_examples(
        examples, examples_capacity=5, tokens_capacity=16, num_sparse_features=3, max_bag_size=4, prefix=0
    )
    ids = embedding_ids(pack, groups)
    for name, members in groups.items():
        want = [b + f * _FEATURE_SALT for example in bags for f, b in enumerate(example) if f in members]
        got_offsets = np.asarray(ids[name].offsets)
        expected = np.concatenate([[0], np.cumsum([len(b) for b in want])])
        np.testing.assert_array_equal(got_offsets[: len(expected)], expected)
        assert (got_offsets[len(expected) :] == expected[-1]).all()  # the padding example's empty bags
        got = np.asarray(ids[name].values)
        np.testing.assert_array_equal(got[: got_offsets[-1]], np.concatenate(want))
        assert not got[got_offsets[-1] :].any()


def test_a_glob_names_shards_of_one_schema_and_each_must_be_listed(tmp_path):
    records = [codec.encode(make_record(i)) for i in range(9)]
    write_raw(tmp_path / "a", SCHEMA, [records[:3], records[3:6], records[6:]])
    write_raw(tmp_path / "b", SCHEMA, [records[:2]])
    both = ShardSet.open(str(tmp_path / "*" / "part-0000[01]-*.array_record"))
    assert [s.records for s in both.shards] == [3, 3, 2]  # a's first two shards, then b's one
    stray = tmp_path / "b" / "part-00005-of-00009.array_record"
    stray.write_bytes((tmp_path / "b" / shard_name(0, 1)).read_bytes())
    with pytest.raises(BadShard, match=re.escape(f"{stray}: not listed in {tmp_path / 'b' / 'schema.json'}")):
        ShardSet.open(str(tmp_path / "b" / "*.array_record"))
    other = dataclasses.replace(SCHEMA, tasks=("click",))
    write_raw(
        tmp_path / "c", other, [[codec.encode(dataclasses.replace(make_record(0), labels=np.zeros((2, 1))))]]
    )
    with pytest.raises(BadShard, match="its schema differs"):
        ShardSet.open(str(tmp_path / "[ac]" / "*.array_record"))
