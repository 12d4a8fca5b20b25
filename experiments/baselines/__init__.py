"""Baselines for the real-data examples (docs/results.md)."""
