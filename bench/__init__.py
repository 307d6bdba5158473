"""Benchmarks, run through ``switchyard bench``; each prints a table and writes PNG plots."""
