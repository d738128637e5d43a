"""Benchmark scripts (benchmarks/README.md lists them and their results).

Run from a source checkout (`python3 benchmarks/NAME.py --help`); tests
import some of them (`from benchmarks import bench_gpu`). Not installed.
"""
