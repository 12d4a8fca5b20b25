"""Ranking records on disk (docs/data.md): the log schema as ArrayRecord shards that grain reads.

schema.py    schema.json beside the shards; finding and checking the shards of a path
codec.py     one request <-> bytes (np.frombuffer), and the schema's rules (`check`)
writer.py    records -> shards on every core, then schema.json
reader.py    shards -> examples: grain source, decoder, bad-record policy and counters
dataset.py   the config's splits as grain datasets for the ranking task
parquet.py   Parquet (one row per request) in and out
movielens.py GroupLens MovieLens layouts -> ranking records
synthetic.py the synthetic task's examples written out as records
"""
