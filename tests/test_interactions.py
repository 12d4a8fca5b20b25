"""Interaction loaders, dense remapping, leave-one-out split and sampled negatives."""

import time

import numpy as np
import pytest

from gem_jax.data import interactions as ix
from tests.helpers import public_data_file


def write(tmp_path, text, name="data.txt"):
    path = tmp_path / name
    path.write_text(text)
    return path


def as_lists(seqs):
    return [list(map(int, s)) for s in seqs]


# --- loading ---------------------------------------------------------------------------------


def test_pairs_remap_blank_lines_and_noncontiguous_users(tmp_path):
    # Raw users 7, 3; raw items 40, 10, 25, 99. User 7 appears in two blocks (lines 1-2 and 6).
    path = write(tmp_path, "7 40\n7 10\n\n3 25\n3 40\n7 99\n   \n")
    data = ix.load_pairs(path)
    assert data.format == "pairs"
    # Users in raw-id order: 3 -> 0, 7 -> 1. Items in raw-id order: 10->1, 25->2, 40->3, 99->4.
    np.testing.assert_array_equal(data.user_ids, [3, 7])
    np.testing.assert_array_equal(data.item_ids, [-1, 10, 25, 40, 99])
    # User 7's blocks are merged in file order: 40, 10, 99 -> 3, 1, 4.
    assert as_lists(data.seqs) == [[2, 3], [3, 1, 4]]
    np.testing.assert_array_equal(data.offsets, [0, 2, 5])
    assert (data.num_users, data.num_items, data.num_interactions) == (2, 4, 5)
    assert data.blank_lines == 2
    assert data.noncontiguous_users == 1
    assert data.repeated_interactions == 0
    assert data.user_index() == {3: 0, 7: 1}
    assert data.item_index() == {10: 1, 25: 2, 40: 3, 99: 4}
    summary = data.summary()
    assert "5 interactions" in summary and "2 blank lines" in summary
    assert "1 users in non-contiguous blocks" in summary


def test_user_lines_and_repeats(tmp_path):
    path = write(tmp_path, "5 1 2 3\n2 3 3 8\n")
    data = ix.load_user_lines(path)
    assert data.format == "user_lines"
    np.testing.assert_array_equal(data.user_ids, [2, 5])
    np.testing.assert_array_equal(data.item_ids, [-1, 1, 2, 3, 8])
    # User 2 (dense 0): items 3, 3, 8 -> 3, 3, 4 (the repeated item 3 is kept and counted).
    assert as_lists(data.seqs) == [[3, 3, 4], [1, 2, 3]]
    assert data.repeated_interactions == 1
    assert data.blank_lines == 0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1 2\n1 3\n2 4\n", "pairs"),
        ("1 2 3\n2 4 5 6\n", "user_lines"),
        ("\n1 2\n2 3 4\n", "user_lines"),  # a 2-field first line, then a longer one
    ],
)
def test_auto_detects_format(tmp_path, text, expected):
    assert ix.load_interactions(write(tmp_path, text)).format == expected


def test_auto_and_explicit_agree(tmp_path):
    path = write(tmp_path, "1 2 3 4\n2 5 6\n")
    auto, explicit = ix.load_interactions(path), ix.load_interactions(path, format="user_lines")
    np.testing.assert_array_equal(auto.items, explicit.items)
    np.testing.assert_array_equal(auto.offsets, explicit.offsets)


@pytest.mark.parametrize(
    "loader, text, line, needle",
    [
        (ix.load_pairs, "1 2\n1 x\n", 2, "non-integer token 'x'"),
        (ix.load_pairs, "1 2\n1 2.5\n", 2, "non-integer token '2.5'"),
        (ix.load_pairs, "1 2\n\n1 -4\n", 3, "negative id '-4'"),
        (ix.load_pairs, "1 2\n1 2 3\n", 2, "expected 2 fields"),
        (ix.load_pairs, "1\n", 1, "expected 2 fields"),
        (ix.load_user_lines, "1 2 3\n2\n", 2, "at least 2 fields"),
        (ix.load_user_lines, "1 2 3\n-2 4\n", 2, "negative id '-2'"),
        (ix.load_user_lines, "1 2 3\n2 4 +5\n", 2, "non-integer token '+5'"),
        (ix.load_user_lines, "1 2 3\n2 4\n1 5\n", 3, "user 1 already had line 1"),
        (ix.load_interactions, "1 2\n" * 100 + "1 2 3\n", 101, "auto-detected"),
    ],
)
def test_malformed_line_names_file_line_and_content(tmp_path, loader, text, line, needle):
    path = write(tmp_path, text, name="bad_file.txt")
    with pytest.raises(ValueError) as err:
        loader(path)
    message = str(err.value)
    assert f"bad_file.txt:{line}:" in message
    assert needle in message
    assert repr(text.splitlines()[line - 1]) in message  # the bad content itself


@pytest.mark.parametrize(
    "loader, line, needle",
    [(ix.load_pairs, 2, "does not fit int64"), (ix.load_user_lines, 2, "does not fit int64")],
)
def test_id_beyond_int64_names_file_and_line(tmp_path, loader, line, needle):
    path = write(tmp_path, f"1 2 3\n{2**70} 4 5\n" if loader is ix.load_user_lines else f"1 2\n1 {2**70}\n")
    with pytest.raises(ValueError) as err:
        loader(path)
    assert f"{path}:{line}:" in str(err.value) and needle in str(err.value)
    ix.load_pairs(write(tmp_path, f"1 {2**63 - 1}\n1 2\n"))  # the largest int64 is still an id


@pytest.mark.parametrize(
    "content, line, needle",
    [
        (bytes(range(256)) * 40, 2, "not a UTF-8 text file (byte 0x80 at offset 128)"),
        (b"1 2\n1 3\n\xff\xfe 4\n", 3, "not a UTF-8 text file"),
        (b"1 2\n\x00\x00 3\n", 2, "NUL byte"),
    ],
)
def test_binary_file_is_one_line_naming_the_file(tmp_path, content, line, needle):
    path = tmp_path / "binary.bin"
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        ix.load_interactions(path)
    message = str(err.value)
    assert message.startswith(f"{path}:{line}:") and needle in message and "\n" not in message
    assert len(message) < 300


def test_long_bad_line_is_cut_in_the_message(tmp_path):
    with pytest.raises(ValueError) as err:
        ix.load_pairs(write(tmp_path, "1 2\n" + "x" * 100_000 + " 3\n"))
    assert len(str(err.value)) < 400 and "(100000 characters)" in str(err.value)


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_empty_file_is_an_error(tmp_path, text):
    with pytest.raises(ValueError, match="no interactions"):
        ix.load_interactions(write(tmp_path, text))


def test_unknown_format_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="format='csv'"):
        ix.load_interactions(write(tmp_path, "1 2\n"), format="csv")


# --- leave-one-out ---------------------------------------------------------------------------


def test_leave_one_out_by_hand():
    seqs = [np.array([1, 2, 3, 4]), np.array([5, 6]), np.array([7, 8, 9]), np.array([3])]
    split = ix.leave_one_out(seqs)
    assert as_lists(split.train) == [[1, 2], [5, 6], [7], [3]]
    np.testing.assert_array_equal(split.eval_users, [0, 2])
    np.testing.assert_array_equal(split.valid_target, [3, 8])
    np.testing.assert_array_equal(split.test_target, [4, 9])
    np.testing.assert_array_equal(split.short_users, [1, 3])
    assert as_lists(split.history("valid")) == [[1, 2], [7]]
    assert as_lists(split.history("test")) == [[1, 2, 3], [7, 8]]
    np.testing.assert_array_equal(split.targets("test"), [4, 9])
    assert as_lists(split.all_items()) == as_lists(seqs)
    assert (split.num_users, split.num_evaluated, split.num_short) == (4, 2, 2)
    summary = split.summary()
    assert "4 users, 2 evaluated" in summary
    assert "2 with fewer than 3 interactions kept in training only" in summary
    # Nothing is lost: training + 2 targets per evaluated user = all interactions.
    assert split.num_train_interactions + 2 * split.num_evaluated == 4 + 2 + 3 + 1


def test_leave_one_out_min_len():
    seqs = [np.arange(1, 5), np.arange(1, 4)]
    assert ix.leave_one_out(seqs, min_len=4).num_short == 1
    with pytest.raises(ValueError, match="min_len=2"):
        ix.leave_one_out(seqs, min_len=2)


def test_pad_sequences_keeps_most_recent():
    padded = ix.pad_sequences([np.array([1, 2, 3]), np.array([4]), np.array([], np.int32)], 2)
    np.testing.assert_array_equal(padded, [[2, 3], [0, 4], [0, 0]])
    full = ix.pad_sequences([np.array([5, 6]), np.array([7])])
    np.testing.assert_array_equal(full, [[5, 6], [0, 7]])


# --- negatives -------------------------------------------------------------------------------


def check_negatives(negatives, user_items, num_items, num):
    assert negatives.shape == (len(user_items), num) and negatives.dtype == np.int32
    for row, items in zip(negatives, user_items):
        assert len(set(row.tolist())) == num, "duplicate negative"
        assert not set(row.tolist()) & set(np.asarray(items).tolist()), "negative was interacted"
        assert row.min() >= 1 and row.max() <= num_items


def test_negatives_valid_and_deterministic():
    rng = np.random.default_rng(1)
    num_items = 300
    items = np.arange(1, num_items + 1)
    user_items = [rng.choice(items, size=n, replace=False) for n in (1, 5, 150, 250)]
    user_items.append(np.array([], np.int64))
    a = ix.sample_negatives(user_items, num_items, num=20, seed=7)
    check_negatives(a, user_items, num_items, 20)  # user 3 takes the exact per-row path
    np.testing.assert_array_equal(a, ix.sample_negatives(user_items, num_items, num=20, seed=7))
    assert not np.array_equal(a, ix.sample_negatives(user_items, num_items, num=20, seed=8))


def test_negatives_exhaust_allowed_items():
    # 6 items, 2 interacted: the only 4 allowed items must all be drawn, never the target 5.
    negatives = ix.sample_negatives([np.array([2, 5])], num_items=6, num=4, seed=0)
    np.testing.assert_array_equal(negatives, [[1, 3, 4, 6]])


def test_negatives_are_uniform():
    # 2000 users, items 1..10, each user interacted with {2, 5}: each of the 8 allowed items
    # should appear in 3/8 of the rows. Binomial std of a frequency: sqrt(.375 * .625 / 2000).
    num_users, num = 2000, 3
    negatives = ix.sample_negatives([np.array([2, 5])] * num_users, 10, num=num, seed=3)
    check_negatives(negatives[:50], [np.array([2, 5])] * 50, 10, num)
    freq = np.bincount(negatives.ravel(), minlength=11)[1:] / num_users
    assert freq[1] == freq[4] == 0
    allowed = np.delete(freq, [1, 4])
    assert np.all(np.abs(allowed - 3 / 8) < 5 * np.sqrt(3 / 8 * 5 / 8 / num_users)), freq


def test_negatives_vectorised_path_is_uniform():
    # Many allowed items (the vectorised redraw path), 10 negatives among 60 allowed items.
    num_users, num_items = 3000, 64
    user_items = [np.array([1, 2, 3, 4])] * num_users
    negatives = ix.sample_negatives(user_items, num_items, num=10, seed=5)
    check_negatives(negatives[:50], user_items[:50], num_items, 10)
    freq = np.bincount(negatives.ravel(), minlength=num_items + 1)[5:] / num_users
    p = 10 / 60
    assert np.all(np.abs(freq - p) < 5 * np.sqrt(p * (1 - p) / num_users)), freq


@pytest.mark.parametrize(
    "user_items, num_items, num, needle",
    [
        ([np.array([1, 2])], 5, 4, "only 3 non-interacted items"),
        ([np.array([0, 2])], 5, 1, "item 0"),
        ([np.array([6])], 5, 1, "item 6"),
    ],
)
def test_negatives_errors(user_items, num_items, num, needle):
    with pytest.raises(ValueError, match=needle):
        ix.sample_negatives(user_items, num_items, num=num)


# --- the real files --------------------------------------------------------------------------

# (file, format, interactions, users, items) of the public files (README, "Public data"), counted once.
README_NUMBERS = [
    ("sasrec/Games.txt", "pairs", 287_107, 31_013, 23_715),
    ("iclrec/Beauty.txt", "user_lines", 198_502, 22_363, 12_101),
    ("iclrec/Sports_and_Outdoors.txt", "user_lines", 296_337, 35_598, 18_357),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, fmt, interactions, users, items", README_NUMBERS)
def test_real_files_match_readme(name, fmt, interactions, users, items):
    path = public_data_file(name)
    if path is None:
        pytest.skip(f"no copy of the public file {name} here")
    data = ix.load_interactions(path)
    assert data.format == fmt
    assert (data.num_interactions, data.num_users, data.num_items) == (interactions, users, items)
    # The public files use dense 1-based ids already: remapping keeps the item numbering.
    np.testing.assert_array_equal(data.item_ids[1:], np.arange(1, items + 1))
    split = ix.leave_one_out(data)
    assert split.num_train_interactions + 2 * split.num_evaluated == interactions
    assert split.num_evaluated + split.num_short == users

    start = time.perf_counter()
    all_items = split.all_items()
    negatives = ix.sample_negatives(all_items, data.num_items, num=100, seed=0)
    elapsed = time.perf_counter() - start
    check_negatives(negatives[::101], all_items[::101], data.num_items, 100)
    # A guard against a per-user Python loop (minutes), not a benchmark: under 10 s on a quiet machine,
    # 11.5 s once on a 2-core machine running the suite beside other jobs.
    assert elapsed < 60.0, f"sampling 100 negatives for {users} users took {elapsed:.1f}s"
