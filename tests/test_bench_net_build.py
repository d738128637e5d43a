"""benchmarks/bench_net_build.py's measurements: the window it times in
stock Caffe's logs and in caffeplus's build, and what it counts as drawn.
(Its ratios are the benchmark's to print, not a test's to assert.)"""
import importlib.util
import logging
import os

import pytest

import caffeplus
from caffeplus import log
from caffeplus.proto import caffe_pb2
from conftest import ROOT

_spec = importlib.util.spec_from_file_location(
    'bench_net_build', os.path.join(ROOT, 'benchmarks', 'bench_net_build.py'))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

REFERENCE = os.path.join(ROOT, 'tests', 'data', 'reference')
LENET_DUMMY = os.path.join(REFERENCE, 'cli', 'lenet_dummy_b64.prototxt')


def test_stock_windows_run_from_the_first_line_to_the_second():
    lines = [
        'I20261122 07:18:59.000000 20030 net.cpp:53] Initializing net from parameters: ',
        'name: "LeNet"',
        'I20261122 07:18:59.001500 20030 net.cpp:255] Network initialization done.',
        'I20261122 07:18:59.100000 20030 net.cpp:53] Initializing net from parameters: ',
        'I20261122 07:19:00.002000 20030 net.cpp:255] Network initialization done.',
    ]
    assert bench._windows(lines) == pytest.approx([0.0015, 0.902])


def test_the_reference_logs_give_each_nets_window():
    with open(os.path.join(REFERENCE, 'training', 'sgd', 'train.log')) as f:
        windows = bench._windows(f.read().splitlines())
    assert len(windows) == 2 and all(0 < w < 0.1 for w in windows)


def test_caffeplus_window_is_timed_with_the_command_lines_handler(monkeypatch):
    seen = []
    real = log.GlogHandler.__init__

    def spy(self, stream=None):
        seen.append(stream)
        real(self, stream)
    monkeypatch.setattr(log.GlogHandler, '__init__', spy)
    handlers, level = log.logger.handlers[:], log.logger.level
    caffeplus.set_mode_cpu()
    seconds = bench.caffeplus_window_seconds(LENET_DUMMY, caffe_pb2.TRAIN)
    assert 0 < seconds < 10
    assert len(seen) == 1 and set(seen[0].times) == set(bench._StampedDevnull.KEYS)
    first, last = (seen[0].times[key] for key in bench._StampedDevnull.KEYS)
    assert first < last
    assert log.logger.handlers == handlers and log.logger.level == level


def test_the_census_counts_every_filled_value():
    caffeplus.set_mode_cpu()
    level = log.logger.level
    log.logger.setLevel(logging.WARNING)
    try:
        draws = bench.census(LENET_DUMMY, caffe_pb2.TRAIN)
    finally:
        log.logger.setLevel(level)
    net = caffeplus.Net(LENET_DUMMY, caffe_pb2.TRAIN)
    params = sum(b.count for layer in net.layers for b in layer.blobs)
    # Every parameter blob, plus the DummyData tops filled at build: those
    # with constant fillers (the others are drawn at each forward, as Caffe).
    dummy = sum(top.count for layer, tops in zip(net.layers, net.top_vecs)
                if layer.type == 'DummyData'
                for top, refill in zip(tops, layer.refill) if not refill)
    assert dummy == 64
    assert sum(count for _, count, _ in draws) == params + dummy
    assert bench.parse_seconds(caffe_pb2.NetParameter()) is None
    assert bench.parse_seconds(LENET_DUMMY) > 0
