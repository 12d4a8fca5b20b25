"""MovieLens (GroupLens layouts) as ranking records: every rating is a request with one candidate.

Layouts, recognised by their files: ML-100K (`u.data` tab-separated, `u.user` and `u.item` with `|`,
or RecBole's `items_genres.tsv`), ML-1M (`ratings.dat`, `users.dat`, `movies.dat`, `::`-separated) and
ML-20M / ML-25M (`ratings.csv`, `movies.csv`; no user file).

A record per rating (user u rates item i at time t):
  - the candidate is i, its one label "like" = rating >= 4;
  - the history is u's ratings strictly before t (same-second ratings are not history: their order is
    unknown), the most recent `max_history` of them: item, action = the rating (ML-20M's half stars:
    twice the rating), time;
  - sparse features: user (the id), gender, age (ML-1M's seven groups), occupation, zip (first three
    characters) where a user file exists, and the candidate's genres (a bag) and release year;
  - dense features: log(1 + the number of u's earlier ratings), and age / 100 where known.
Splits are by time over all ratings: the earliest `train` fraction trains, the next `valid` fraction
validates, the rest tests (so no request is trained on after a later one is scored; a user's history in
any split holds only their earlier ratings).
"""

from __future__ import annotations

import csv
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from gem_jax.data.records.codec import Record
from gem_jax.data.records.schema import RecordSchema, SparseFeature

LIKE = 4.0  # ratings >= 4 are positives
AGE_GROUPS = (1, 18, 25, 35, 45, 50, 56)  # ML-1M's age codes (lower bounds); ML-100K ages are bucketed so
ML100K_GENRES = (
    "unknown Action Adventure Animation Children's Comedy Crime Documentary Drama Fantasy Film-Noir Horror "
    "Musical Mystery Romance Sci-Fi Thriller War Western"
).split()


@dataclasses.dataclass
class MovieLens:
    """Ratings (one row per rating) and the user and item features, ids as in the files."""

    layout: str
    users: np.ndarray  # int64 [N]
    items: np.ndarray  # int64 [N]
    ratings: np.ndarray  # float32 [N]
    times: np.ndarray  # int64 [N] seconds
    user_features: dict[str, np.ndarray]  # name -> feature id per user id (0: unknown)
    user_feature_vocab: dict[str, int]
    user_age: np.ndarray | None  # age in years per user id (NaN unknown)
    genre_names: list[str]
    item_genres: list[np.ndarray]  # per item id: genre ids (1-based)
    item_year: np.ndarray  # per item id: release year - 1900 (0: unknown)


def detect_layout(directory: Path) -> str:
    for layout, marker in (("ml-100k", "u.data"), ("ml-1m", "ratings.dat"), ("ml-20m", "ratings.csv")):
        if (directory / marker).exists():
            return layout
    raise FileNotFoundError(f"{directory}: no MovieLens ratings file (u.data, ratings.dat or ratings.csv)")


def _age_group(age: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.array(AGE_GROUPS), age, side="right").astype(np.int64)  # 1..7, 0 below 1


def _vocabulary(values: list[str]) -> tuple[dict[str, int], int]:
    ids = {v: i + 1 for i, v in enumerate(sorted(set(values)))}
    return ids, len(ids) + 1


def _user_table(rows: list[tuple[int, int, str, str, str]]) -> tuple[dict, dict, np.ndarray]:
    """(features, vocab, age) from (user, age in years, gender, occupation, zip) rows."""
    n = max(r[0] for r in rows) + 1
    occupations, occ_vocab = _vocabulary([r[3] for r in rows])
    zips, zip_vocab = _vocabulary([r[4][:3] for r in rows])
    feats = {k: np.zeros(n, np.int64) for k in ("gender", "age", "occupation", "zip")}
    age = np.full(n, np.nan, np.float32)
    for user, years, gender, occupation, zipcode in rows:
        feats["gender"][user] = {"M": 1, "F": 2}.get(gender, 0)
        feats["age"][user] = _age_group(np.array([years]))[0]
        feats["occupation"][user] = occupations[occupation]
        feats["zip"][user] = zips[zipcode[:3]]
        age[user] = years
    vocab = {"gender": 3, "age": len(AGE_GROUPS) + 1, "occupation": occ_vocab, "zip": zip_vocab}
    return feats, vocab, age


def _year(text: str) -> int:
    """A year field; 0 where it holds none (ML-100K has "unkonwn" and "V")."""
    text = text.strip()
    return int(text[-4:]) if text[-4:].isdigit() else 0


def _title_year(title: str) -> int:
    m = re.search(r"\((\d{4})\)\s*$", title.strip())
    return int(m.group(1)) if m else 0


def _item_table(rows: list[tuple[int, int, list[str]]], genre_names: list[str] | None = None):
    """(genre names, genres per item, year per item) from (item, year, genre names) rows."""
    if genre_names is None:
        genre_names = sorted({g for _, _, gs in rows for g in gs})
    ids = {g: i + 1 for i, g in enumerate(genre_names)}
    n = max((r[0] for r in rows), default=0) + 1
    genres = [np.zeros(0, np.int64)] * n
    year = np.zeros(n, np.int64)
    for item, y, gs in rows:
        genres[item] = np.array(sorted(ids[g] for g in gs if g in ids), np.int64)
        year[item] = min(max(y - 1900, 0), 199) if y else 0
    return genre_names, genres, year


def _read_lines(path: Path, sep: str) -> list[list[str]]:
    with open(path, encoding="latin-1") as f:
        return [line.rstrip("\n").split(sep) for line in f if line.strip()]


def load(directory: str | Path) -> MovieLens:
    """Reads a MovieLens directory of any of the three layouts."""
    d = Path(directory)
    layout = detect_layout(d)
    user_rows = item_rows = None
    genre_names = None
    if layout == "ml-100k":
        r = np.loadtxt(d / "u.data", dtype=np.int64, ndmin=2)
        users, items, ratings, times = r[:, 0], r[:, 1], r[:, 2].astype(np.float32), r[:, 3]
        if (d / "u.user").exists():
            user_rows = [(int(u), int(a), g, o, z) for u, a, g, o, z in _read_lines(d / "u.user", "|")]
        if (d / "u.item").exists():
            genre_names = ML100K_GENRES
            item_rows = []
            for f in _read_lines(d / "u.item", "|"):
                genres = [g for g, flag in zip(ML100K_GENRES, f[5:]) if flag == "1"]
                item_rows.append((int(f[0]), _year(f[2]), genres))
        elif (d / "items_genres.tsv").exists():
            lines = _read_lines(d / "items_genres.tsv", "\t")
            item_rows = [(int(f[0]), _year(f[1]), f[2].split("|") if f[2] else []) for f in lines[1:]]
    elif layout == "ml-1m":
        r = np.array([[int(x) for x in f[:4]] for f in _read_lines(d / "ratings.dat", "::")], np.int64)
        users, items, ratings, times = r[:, 0], r[:, 1], r[:, 2].astype(np.float32), r[:, 3]
        if (d / "users.dat").exists():
            user_rows = [(int(u), int(a), g, o, z) for u, g, a, o, z in _read_lines(d / "users.dat", "::")]
        if (d / "movies.dat").exists():
            item_rows = [
                (int(f[0]), _title_year(f[1]), f[2].split("|")) for f in _read_lines(d / "movies.dat", "::")
            ]
    else:
        users, items, ratings, times = _read_ratings_csv(d / "ratings.csv")
        if (d / "movies.csv").exists():
            with open(d / "movies.csv", encoding="utf-8", newline="") as f:
                rows = list(csv.reader(f))[1:]
            item_rows = [
                (int(m), _title_year(t), [] if g == "(no genres listed)" else g.split("|"))
                for m, t, g, *_ in rows
            ]
    user_features, vocab, age = _user_table(user_rows) if user_rows else ({}, {}, None)
    genre_names, genres, year = _item_table(item_rows or [], genre_names)
    return MovieLens(
        layout, users, items, ratings, times, user_features, vocab, age, genre_names, genres, year
    )


def _read_ratings_csv(path: Path):
    try:
        import pyarrow.csv as pcsv  # optional dependency: the data extra (Parquet)

        t = pcsv.read_csv(path)
        cols = {name: t.column(name).to_numpy() for name in ("userId", "movieId", "rating", "timestamp")}
    except ImportError:
        r = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)
        cols = {"userId": r[:, 0], "movieId": r[:, 1], "rating": r[:, 2], "timestamp": r[:, 3]}
    return (
        cols["userId"].astype(np.int64),
        cols["movieId"].astype(np.int64),
        cols["rating"].astype(np.float32),
        cols["timestamp"].astype(np.int64),
    )


@dataclasses.dataclass
class Prepared:
    """Ratings in time order with what every record needs (built once, shared by the writer's workers)."""

    data: MovieLens
    schema: RecordSchema
    order: np.ndarray  # rating indices in time order (request i = rating order[i])
    by_user: np.ndarray  # rating indices sorted by (user, time, item)
    history_start: np.ndarray  # per time-ordered request: its user's history in by_user[start:stop]
    history_stop: np.ndarray
    earlier: np.ndarray  # per time-ordered request: number of the user's earlier ratings (before the cut)
    splits: dict[str, tuple[int, int]]  # split -> [start, stop) of time-ordered requests


def actions(ratings: np.ndarray, layout: str) -> np.ndarray:
    """Rating -> action id: the rating (1-5), or twice it for ML-20M's half stars (1-10)."""
    return np.rint(ratings * (2 if layout == "ml-20m" else 1)).astype(np.int64)


def prepare(data: MovieLens, *, max_history: int, train: float = 0.8, valid: float = 0.1) -> Prepared:
    """Orders the ratings by time, finds every rating's history and cuts the splits."""
    if not (0 < train and 0 <= valid and train + valid <= 1):
        raise ValueError(f"split fractions train {train}, valid {valid}: need train > 0, train + valid <= 1")
    n = len(data.users)
    order = np.lexsort((data.items, data.users, data.times))
    by_user = np.lexsort((data.items, data.times, data.users))
    key = data.users[by_user] * (1 << 33) + data.times[by_user]
    first_same_time = np.searchsorted(key, key, side="left")  # history ends before the same (user, time)
    user_start = np.searchsorted(data.users[by_user], data.users[by_user], side="left")
    position = np.empty(n, np.int64)
    position[by_user] = np.arange(n)
    stop = first_same_time[position[order]]
    start = np.maximum(user_start[position[order]], stop - max_history)
    earlier = stop - user_start[position[order]]
    cut_train, cut_valid = int(round(n * train)), int(round(n * (train + valid)))
    splits = {"train": (0, cut_train), "valid": (cut_train, cut_valid), "test": (cut_valid, n)}
    return Prepared(data, movielens_schema(data), order, by_user, start, stop, earlier, splits)


def movielens_schema(data: MovieLens) -> RecordSchema:
    user_vocab = int(data.users.max()) + 1
    sparse = [SparseFeature("user", user_vocab)]
    sparse += [SparseFeature(k, data.user_feature_vocab[k]) for k in data.user_features]
    sparse += [SparseFeature("genres", len(data.genre_names) + 1), SparseFeature("year", 200)]
    dense = ["log_history_len", *(["age"] if data.user_age is not None else [])]
    return RecordSchema(
        tasks=("like",),
        num_candidates=1,
        item_vocab=int(data.items.max()) + 1,
        action_vocab=11 if data.layout == "ml-20m" else 6,
        sparse_features=tuple(sparse),
        dense_features=tuple(dense),
    )


def movielens_records(p: Prepared, request_range: tuple[int, int]) -> Iterator[tuple[str, Record]]:
    """`writer.write_shards` records function: time-ordered requests `start..stop-1`."""
    d = p.data
    acts = actions(d.ratings, d.layout)
    empty = np.zeros(0, np.int64)
    for r in range(*request_range):
        e = p.order[r]
        user, item = int(d.users[e]), int(d.items[e])
        hist = p.by_user[p.history_start[r] : p.history_stop[r]]
        sparse = [np.array([user])]
        sparse += [np.array([d.user_features[k][user]]) for k in d.user_features]
        in_table = item < len(d.item_genres)
        sparse += [
            d.item_genres[item] if in_table else empty,
            np.array([d.item_year[item] if in_table else 0]),
        ]
        dense = [np.log1p(p.earlier[r])]
        if d.user_age is not None:
            dense.append(np.nan_to_num(d.user_age[user] / 100.0) if user < len(d.user_age) else 0.0)
        yield (
            f"rating {e} (user {user}, item {item})",
            Record(
                request_id=r,
                user_id=user,
                timestamp=int(d.times[e]),
                candidates=np.array([item]),
                labels=np.array([[float(d.ratings[e] >= LIKE)]], np.float32),
                sparse=sparse,
                dense=np.array(dense, np.float32),
                history_items=d.items[hist],
                history_actions=acts[hist],
                history_timestamps=d.times[hist],
            ),
        )
