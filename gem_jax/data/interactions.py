"""Public sequential-recommendation interaction files: load, validate, remap, split, sample.

Two text formats are read (the README's "Public data" says where the public files come from):

* ``"pairs"`` (SASRec): one ``user item`` pair per line, each user's lines in time order.
* ``"user_lines"`` (ICLRec): one line per user, ``uid i1 i2 ...`` in time order.

Decisions (every one of them counted in :class:`Interactions`, nothing is dropped silently):

* Ids are non-negative base-10 integers (ASCII digits only) that fit int64. Anything else, a wrong
  field count, a negative id, an id above 2**63 - 1, or (``user_lines``) a uid repeated on a second
  line is a ``ValueError`` naming the file, the 1-based line number and the offending content (cut
  to 80 characters). So is a file that is not UTF-8 text or holds NUL bytes (binary data).
* Blank (whitespace-only) lines carry no interaction; they are skipped and counted
  (``blank_lines``).
* ``pairs``: a user whose lines come in several non-contiguous blocks keeps all of them,
  concatenated in order of appearance in the file (the file order is the time order); such
  users are counted (``noncontiguous_users``).
* Repeated ``(user, item)`` interactions are real events and are kept; they are counted
  (``repeated_interactions``).
* Dense ids: items ``1..num_items`` (0 is padding) and users ``0..num_users-1``, both in
  increasing order of raw id, so files whose ids are already dense 1-based (all three public
  files) keep their item numbering.

Everything is numpy on the host; the per-line validation loop is the only Python loop over
lines, and :func:`sample_negatives` is vectorised over users.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Literal

import numpy as np
from jaxtyping import Int

FORMATS = ("pairs", "user_lines")
# How many leading non-empty lines `format="auto"` looks at.
DETECT_LINES = 100
PAD_ITEM = 0
# Stand-in raw id for the padding row in `Interactions.item_ids`.
NO_RAW_ID = -1


@dataclasses.dataclass(frozen=True)
class Interactions:
    """A loaded interaction file, with dense ids and a jagged item layout.

    Attributes:
      path: the file read.
      format: ``"pairs"`` or ``"user_lines"``.
      items: int32[num_interactions], dense item ids (1..num_items) of all users, user by user,
        each user's items in time order.
      offsets: int32[num_users + 1]; user ``u``'s items are ``items[offsets[u]:offsets[u+1]]``.
      user_ids: int64[num_users], raw id of each dense user id.
      item_ids: int64[num_items + 1], raw id of each dense item id (``item_ids[0] = -1``, padding).
      blank_lines: blank lines skipped.
      noncontiguous_users: ``pairs`` users whose lines were not one contiguous block.
      repeated_interactions: interactions whose ``(user, item)`` pair occurred before.
    """

    path: str
    format: str
    items: np.ndarray
    offsets: np.ndarray
    user_ids: np.ndarray
    item_ids: np.ndarray
    blank_lines: int = 0
    noncontiguous_users: int = 0
    repeated_interactions: int = 0

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    @property
    def num_items(self) -> int:
        return len(self.item_ids) - 1

    @property
    def num_interactions(self) -> int:
        return len(self.items)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def seqs(self) -> list[np.ndarray]:
        """Per dense user, its dense item ids in time order (views into ``items``)."""
        return np.split(self.items, self.offsets[1:-1])

    def user_index(self) -> dict[int, int]:
        """Raw user id -> dense user id."""
        return {int(raw): u for u, raw in enumerate(self.user_ids)}

    def item_index(self) -> dict[int, int]:
        """Raw item id -> dense item id (1-based)."""
        return {int(raw): i for i, raw in enumerate(self.item_ids) if i != PAD_ITEM}

    def summary(self) -> str:
        return (
            f"{self.path} ({self.format}): {self.num_interactions} interactions, "
            f"{self.num_users} users, {self.num_items} items; skipped {self.blank_lines} blank "
            f"lines; {self.noncontiguous_users} users in non-contiguous blocks (merged in file "
            f"order); {self.repeated_interactions} repeated (user, item) interactions (kept)"
        )


MAX_ID = 2**63 - 1  # ids are held as int64


def _shown(text: str, limit: int = 80) -> str:
    """repr of a line or token, cut to `limit` characters (a binary file may hold one huge "line")."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def _parse_id(token: str, path: str, lineno: int, line: str) -> int:
    if token.isascii() and token.isdigit():
        value = int(token)
        if value <= MAX_ID:
            return value
        problem = f"id {_shown(token)} does not fit int64 (max {MAX_ID})"
    elif token.startswith("-") and token[1:].isascii() and token[1:].isdigit():
        problem = f"negative id {_shown(token)}"
    else:
        problem = f"non-integer token {_shown(token)}"
    raise ValueError(f"{path}:{lineno}: {problem} in line {_shown(line)}")


def _read_lines(path: str | os.PathLike) -> tuple[str, list[str]]:
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = data.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"{path}:{lineno}: not a UTF-8 text file (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "expected lines of integer ids"
        ) from None
    if "\x00" in text:
        lineno = text.count("\n", 0, text.index("\x00")) + 1
        raise ValueError(
            f"{path}:{lineno}: NUL byte in the file (binary data?); expected lines of integer ids"
        )
    return path, text.splitlines()


def _detect_format(path: str, lines: list[str]) -> str:
    """Any of the first `DETECT_LINES` non-empty lines with more than two fields: user_lines."""
    seen = 0
    for line in lines:
        fields = line.split()
        if not fields:
            continue
        if len(fields) > 2:
            return "user_lines"
        seen += 1
        if seen == DETECT_LINES:
            break
    if seen == 0:
        raise ValueError(f"{path}: no interactions (empty or blank file)")
    # Every line seen has (at most) two fields: that is the pair format, or a user-lines file
    # whose first users each have one item; `load_pairs` names the format in its errors.
    return "pairs"


def _dense(raw: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray]:
    """Raw ids -> dense ids first, first+1, ... in increasing raw order; returns (dense, uniq)."""
    uniq, inverse = np.unique(raw, return_inverse=True)
    return (inverse + first).astype(np.int32), uniq.astype(np.int64)


def _count_repeats(user: np.ndarray, item: np.ndarray) -> int:
    keys = user.astype(np.int64) * (int(item.max(initial=0)) + 1) + item
    return int(len(keys) - len(np.unique(keys)))


def _build(path, fmt, raw_users_per_event, raw_items, blank, noncontiguous) -> Interactions:
    """Dense remap of event arrays already grouped by user (stable order within a user)."""
    users, user_ids = _dense(raw_users_per_event, 0)
    items, item_ids = _dense(raw_items, 1)
    # Group by dense user, keeping file (= time) order within a user.
    order = np.argsort(users, kind="stable")
    users, items = users[order], items[order]
    counts = np.bincount(users, minlength=len(user_ids))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return Interactions(
        path=path,
        format=fmt,
        items=items,
        offsets=offsets,
        user_ids=user_ids,
        item_ids=np.concatenate([[NO_RAW_ID], item_ids]).astype(np.int64),
        blank_lines=blank,
        noncontiguous_users=noncontiguous,
        repeated_interactions=_count_repeats(users, items),
    )


def _load_pairs(path: str, lines: list[str], detected: bool) -> Interactions:
    users, items, blank = [], [], 0
    hint = " (format 'pairs' was auto-detected from the first lines; pass format=)"
    hint = hint if detected else ""
    for lineno, line in enumerate(lines, 1):
        fields = line.split()
        if not fields:
            blank += 1
            continue
        if len(fields) != 2:
            raise ValueError(
                f"{path}:{lineno}: expected 2 fields 'user item', got {len(fields)} in line {_shown(line)}{hint}"
            )
        users.append(_parse_id(fields[0], path, lineno, line))
        items.append(_parse_id(fields[1], path, lineno, line))
    if not users:
        raise ValueError(f"{path}: no interactions (empty or blank file)")
    users_a = np.asarray(users, np.int64)
    # A user is non-contiguous when it starts more than one run of consecutive lines.
    starts = np.concatenate([[True], users_a[1:] != users_a[:-1]])
    runs_per_user = np.unique(users_a[starts], return_counts=True)[1]
    return _build(path, "pairs", users_a, np.asarray(items, np.int64), blank, int(np.sum(runs_per_user > 1)))


def _load_user_lines(path: str, lines: list[str]) -> Interactions:
    users, lengths, items, blank = [], [], [], 0
    first_line: dict[int, int] = {}
    for lineno, line in enumerate(lines, 1):
        fields = line.split()
        if not fields:
            blank += 1
            continue
        if len(fields) < 2:
            raise ValueError(
                f"{path}:{lineno}: expected 'uid i1 i2 ...' (at least 2 fields), got "
                f"{len(fields)} in line {_shown(line)}"
            )
        uid = _parse_id(fields[0], path, lineno, line)
        if uid in first_line:
            raise ValueError(
                f"{path}:{lineno}: user {uid} already had line {first_line[uid]}, in line {_shown(line)}"
            )
        first_line[uid] = lineno
        users.append(uid)
        lengths.append(len(fields) - 1)
        items.extend(_parse_id(tok, path, lineno, line) for tok in fields[1:])
    if not users:
        raise ValueError(f"{path}: no interactions (empty or blank file)")
    raw_users = np.repeat(np.asarray(users, np.int64), lengths)
    return _build(path, "user_lines", raw_users, np.asarray(items, np.int64), blank, 0)


def load_pairs(path: str | os.PathLike) -> Interactions:
    """Loads a ``user item`` per line file (SASRec format); see the module docstring."""
    path, lines = _read_lines(path)
    return _load_pairs(path, lines, detected=False)


def load_user_lines(path: str | os.PathLike) -> Interactions:
    """Loads a ``uid i1 i2 ...`` per line file (ICLRec format); see the module docstring."""
    path, lines = _read_lines(path)
    return _load_user_lines(path, lines)


def load_interactions(path: str | os.PathLike, format: str = "auto") -> Interactions:
    """Loads either format; ``"auto"`` picks ``user_lines`` iff one of the first 100 non-empty
    lines has more than two fields (a file of one-item users is ambiguous: pass ``format``)."""
    if format not in ("auto", *FORMATS):
        raise ValueError(f"format={format!r}; expected 'auto' or one of {FORMATS}")
    path, lines = _read_lines(path)
    detected = format == "auto"
    if detected:
        format = _detect_format(path, lines)
    if format == "pairs":
        return _load_pairs(path, lines, detected)
    return _load_user_lines(path, lines)


# ---------------------------------------------------------------------------------------------
# Leave-one-out split
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LeaveOneOutSplit:
    """Per user: last item = test target, second to last = validation target, rest = training.

    Users with fewer than ``min_len`` interactions are kept in training only (their whole
    sequence is training data, as in SASRec) and are not evaluated; they are listed in
    ``short_users`` and counted in ``summary()``.

    Attributes:
      train: per dense user, the training sequence (all users; short users' full sequence).
      eval_users: int32[E], the evaluated users (same set for validation and test).
      valid_target: int32[E], their validation targets.
      test_target: int32[E], their test targets.
      short_users: int32[S], users kept in training only.
      min_len: the threshold used.
    """

    train: list[np.ndarray]
    eval_users: np.ndarray
    valid_target: np.ndarray
    test_target: np.ndarray
    short_users: np.ndarray
    min_len: int

    @property
    def num_users(self) -> int:
        return len(self.train)

    @property
    def num_evaluated(self) -> int:
        return len(self.eval_users)

    @property
    def num_short(self) -> int:
        return len(self.short_users)

    @property
    def num_train_interactions(self) -> int:
        return int(sum(len(s) for s in self.train))

    def history(self, split: Literal["valid", "test"]) -> list[np.ndarray]:
        """Model input per evaluated user: training items, plus the validation item for test."""
        if split == "valid":
            return [self.train[u] for u in self.eval_users]
        if split == "test":
            return [
                np.append(self.train[u], v).astype(np.int32)
                for u, v in zip(self.eval_users, self.valid_target)
            ]
        raise ValueError(f"split={split!r}; expected 'valid' or 'test'")

    def targets(self, split: Literal["valid", "test"]) -> np.ndarray:
        if split == "valid":
            return self.valid_target
        if split == "test":
            return self.test_target
        raise ValueError(f"split={split!r}; expected 'valid' or 'test'")

    def all_items(self) -> list[np.ndarray]:
        """Per dense user, every item it interacted with (training + both targets)."""
        out = list(self.train)
        for u, v, t in zip(self.eval_users, self.valid_target, self.test_target):
            out[u] = np.append(out[u], [v, t]).astype(np.int32)
        return out

    def summary(self) -> str:
        return (
            f"leave-one-out: {self.num_users} users, {self.num_evaluated} evaluated "
            f"({self.num_evaluated} validation + {self.num_evaluated} test targets), "
            f"{self.num_short} with fewer than {self.min_len} interactions kept in training only "
            f"(not evaluated); {self.num_train_interactions} training interactions"
        )


def leave_one_out(seqs: Sequence[np.ndarray] | Interactions, min_len: int = 3) -> LeaveOneOutSplit:
    """Splits time-ordered per-user sequences; ``min_len >= 3`` keeps a training item."""
    if min_len < 3:
        raise ValueError(f"min_len={min_len}; need >= 3 (1 training + validation + test item)")
    if isinstance(seqs, Interactions):
        seqs = seqs.seqs
    train, users, valid, test, short = [], [], [], [], []
    for u, seq in enumerate(seqs):
        seq = np.asarray(seq, np.int32)
        if seq.ndim != 1:
            raise ValueError(f"user {u}: sequence has shape {seq.shape}; expected 1-D")
        if len(seq) < min_len:
            train.append(seq)
            short.append(u)
            continue
        train.append(seq[:-2])
        users.append(u)
        valid.append(seq[-2])
        test.append(seq[-1])
    as32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return LeaveOneOutSplit(train, as32(users), as32(valid), as32(test), as32(short), min_len)


def pad_sequences(seqs: Sequence[np.ndarray], max_len: int | None = None, pad: int = PAD_ITEM) -> np.ndarray:
    """int32[U, L]: each sequence's last ``max_len`` items, right-aligned (left padding).

    ``max_len=None`` keeps everything (L = longest sequence), e.g. for exclusion lists.
    """
    lengths = np.fromiter((len(s) for s in seqs), np.int64, len(seqs))
    width = int(lengths.max(initial=0)) if max_len is None else max_len
    if width < 0:
        raise ValueError(f"max_len={max_len}; expected >= 0")
    out = np.full((len(seqs), width), pad, np.int32)
    if width == 0:
        return out
    for u, s in enumerate(seqs):
        tail = np.asarray(s)[-width:] if len(s) else s
        if len(tail):
            out[u, width - len(tail) :] = tail
    return out


# ---------------------------------------------------------------------------------------------
# Sampled negatives (the SASRec 100-negative protocol)
# ---------------------------------------------------------------------------------------------


def sample_negatives(
    user_items: Sequence[np.ndarray],
    num_items: int,
    num: int = 100,
    seed: int = 0,
) -> Int[np.ndarray, "U num"]:
    """Per user, ``num`` distinct items drawn uniformly from the items it never interacted with.

    Args:
      user_items: per user, every item it interacted with (ids in 1..num_items; pass all of
        them, targets included, e.g. ``LeaveOneOutSplit.all_items()``, so a target is never a
        negative).
      num_items: items are 1..num_items (0 is padding and never sampled).
      num: negatives per user.
      seed: the result is a deterministic function of all arguments.

    Returns:
      int32[U, num], each row sorted ascending.

    This follows the README's protocol ("items the user has not interacted with", distinct).
    The SASRec reference code differs slightly: it excludes only training items and draws with
    replacement; with 100 of ~20k items the effect should be small (not measured).

    Draws uniform ranks among each user's allowed items (with replacement, then redraws the
    duplicates until a row is distinct: a permutation-invariant procedure, hence uniform over
    subsets) and maps rank r to the r-th allowed item with one vectorised searchsorted.
    """
    if num_items < 1:
        raise ValueError(f"num_items={num_items}; expected >= 1")
    if num < 0:
        raise ValueError(f"num={num}; expected >= 0")
    num_users = len(user_items)
    lengths = np.fromiter((len(s) for s in user_items), np.int64, num_users)
    flat = (
        np.concatenate([np.asarray(s, np.int64).ravel() for s in user_items])
        if num_users and lengths.sum()
        else np.zeros(0, np.int64)
    )
    if len(flat) and (flat.min() < 1 or flat.max() > num_items):
        bad = int(flat[(flat < 1) | (flat > num_items)][0])
        raise ValueError(f"user_items holds item {bad}; expected ids in 1..num_items={num_items}")
    stride = num_items + 1
    owner = np.repeat(np.arange(num_users, dtype=np.int64), lengths)
    keys = np.unique(owner * stride + flat)  # sorted by user, then item; duplicates gone
    owner, excl = np.divmod(keys, stride)
    counts = np.bincount(owner, minlength=num_users)
    starts = np.concatenate([[0], np.cumsum(counts)])
    allowed = num_items - counts
    if num_users and allowed.min() < num:
        u = int(np.argmin(allowed))
        raise ValueError(
            f"user {u} has only {int(allowed[u])} non-interacted items of {num_items}; "
            f"cannot draw num={num} distinct negatives"
        )
    # g_i = number of allowed items before the i-th excluded item (non-decreasing per user).
    gaps = excl - (np.arange(len(keys)) - starts[owner]) - 1
    gap_keys = owner * stride + gaps

    rng = np.random.default_rng(seed)
    ranks = rng.integers(0, np.maximum(allowed, 1)[:, None], size=(num_users, num))
    # Rows with few allowed items would need many redraw rounds: draw them exactly, one by one.
    crowded = np.nonzero(allowed < 4 * num)[0]
    for u in crowded:
        ranks[u] = rng.choice(allowed[u], size=num, replace=False)
    rows = np.setdiff1d(np.arange(num_users), crowded)
    while num > 1 and len(rows):
        sub = np.sort(ranks[rows], axis=1)
        dup = np.zeros_like(sub, dtype=bool)
        dup[:, 1:] = sub[:, 1:] == sub[:, :-1]
        redraw = np.nonzero(dup)
        sub[redraw] = rng.integers(0, allowed[rows][redraw[0]])
        ranks[rows] = sub
        rows = np.unique(rows[redraw[0]])
    # The r-th allowed item (0-based) is r + 1 + #{i : g_i <= r}.
    query = np.arange(num_users, dtype=np.int64)[:, None] * stride + ranks
    before = np.searchsorted(gap_keys, query, side="right") - starts[:num_users, None]
    return np.sort(ranks + 1 + before, axis=1).astype(np.int32)
