"""The answers bad data gets: one line naming the shard file (and record) and what is wrong.

`python -m experiments train` prints a `DataError` as one line and exits with code 2, as it does for a
config error; the `data` commands do the same.
"""

from __future__ import annotations


class DataError(ValueError):
    """The data cannot be read as the schema says; the message is one line naming file (and record)."""


class BadRecord(DataError):
    """A record breaks its shard set's schema (wrong type, id out of range, NaN, lists of unequal length)."""


class BadShard(DataError):
    """A shard file is missing, truncated, rewritten since its schema was written, or unreadable."""


class TooManyBadRecords(DataError):
    """More bad records were skipped than `data.max_bad_records` allows."""
