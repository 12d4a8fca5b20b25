"""Kernel benchmarks, one module per benchmark (`python -m experiments bench NAME`), each checking
correctness on fresh random inputs before it times; shapes.py names the shapes they share with the tests."""
