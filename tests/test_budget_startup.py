"""A memory budget holds for the whole process, start-up included: plan
auto's algorithm timing stays within the budget beside what the process
holds, and the samplers that check it (GPU runs are gpu-marked)."""
import importlib.util
import json
import os
import stat
import subprocess
import sys
import types

import pytest

from caffeplus.memory import calibration, sampler, shapes, workspace_model as wm
from caffeplus.proto import caffe_pb2

from conftest import ROOT, SHARED

MiB, GiB = 2 ** 20, 2 ** 30
BENCH = os.path.join(SHARED, 'bench')


def bench(name):
    path = os.path.join(BENCH, name + '.prototxt')
    if not os.path.exists(path):
        pytest.fail('test data missing: %s' % path)
    return path


class FakeDevice:
    """cupy as calibration sees it: a device of `total` bytes, `other`
    bytes used outside the pool, and a pool whose blocks are counted."""

    def __init__(self, total, other, pool_bytes):
        self.total, self.other = total, other
        self.pool_bytes = pool_bytes
        self.taken = []             # sizes of the arrays taken through cupy.empty
        self.peak = 0
        fake = self

        class Pool:
            def free_all_blocks(self):
                pass

            def get_limit(self):
                return 0

            def total_bytes(self):
                return fake.pool_bytes

        class Array:
            def __init__(self, n):
                self.nbytes = n
                self.data = types.SimpleNamespace(ptr=0x1000)
                fake.pool_bytes += n
                fake.taken.append(n)
                fake.peak = max(fake.peak, fake.used())

            def __del__(self):
                fake.pool_bytes -= self.nbytes

        pool = Pool()
        self.module = types.SimpleNamespace(
            get_default_memory_pool=lambda: pool, uint8='uint8',
            empty=lambda n, dtype=None: Array(n),
            cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(
                memGetInfo=lambda: (fake.total - fake.used(), fake.total))))

    def used(self):
        return self.other + self.pool_bytes


@pytest.fixture
def fake_device(monkeypatch):
    def make(total, other, pool_bytes):
        dev = FakeDevice(total, other, pool_bytes)
        monkeypatch.setitem(sys.modules, 'cupy', dev.module)
        return dev
    yield make
    calibration.clear()


def test_trial_workspace_leaves_the_budget_what_the_process_holds(fake_device):
    """Budget 12 GiB, the process holding 2 GiB in its pool and 500 MiB of
    context, trial arrays of 6 GiB: the workspace gets the rest less the
    margin, not the whole budget; without a budget, what the card has free."""
    dev = fake_device(total=140 * GiB, other=500 * MiB, pool_bytes=2 * GiB)
    room = calibration.trial_workspace_bytes(6 * GiB, budget=12 * GiB)
    assert room == 12 * GiB - (2 * GiB + 500 * MiB) - 6 * GiB - calibration.MEASURE_MARGIN
    free = dev.total - dev.used()
    assert calibration.trial_workspace_bytes(6 * GiB) == free - 6 * GiB - \
        calibration.MEASURE_MARGIN
    # Arrays that alone would break the budget: no search at all.
    assert calibration.trial_workspace_bytes(10 * GiB, budget=12 * GiB) is None


def test_other_processes_on_the_card_do_not_count_against_the_budget(fake_device):
    """40 GiB used by another job: the budget is this process's; the card's
    free bytes still bound the search."""
    fake_device(total=48 * GiB, other=40 * GiB, pool_bytes=1 * GiB)
    room = calibration.trial_workspace_bytes(1 * GiB, budget=12 * GiB)
    by_budget = 12 * GiB - 1 * GiB - wm.RUNTIME_BYTES - 1 * GiB - calibration.MEASURE_MARGIN
    by_card = 48 * GiB - 41 * GiB - 1 * GiB - calibration.MEASURE_MARGIN
    assert room == min(by_budget, by_card) == by_card


def test_measure_net_keeps_every_trial_within_the_budget(fake_device, monkeypatch):
    """VGG-16 b256 under 12 GiB (the issue's run): each convolution's trial
    workspace, its arrays and the process's holdings stay within the
    budget; before, the workspace alone was allowed the whole budget."""
    param = shapes.load_net_param(bench('vgg16_b256'), phase=caffe_pb2.TRAIN)
    with shapes.quiet():
        net = shapes.build_net(param)
    held = 1600 * MiB           # parameters, their diffs, history
    dev = fake_device(total=140 * GiB, other=500 * MiB, pool_bytes=held)
    limit = 12 * GiB
    trials = []
    for layer in net.layers:
        if not hasattr(layer, 'time_calls'):
            continue
        arrays = 4 * (layer.num * (layer.channels * _prod(layer.in_spatial) +
                                   layer.num_output * _prod(layer.out_spatial)) +
                      2 * layer.blobs[0].count)

        def time_calls(ptr, nbytes, _layer=layer, _arrays=arrays):
            # What the timer takes beside the workspace, while it runs.
            trials.append((_layer.name, nbytes, dev.used() + _arrays))
            return {}
        monkeypatch.setattr(layer, '_cd', object(), raising=False)
        monkeypatch.setattr(layer, 'time_calls', time_calls, raising=False)
    timed = calibration.measure_net(net, limit=limit)
    assert timed == len(trials) == 13
    for name, nbytes, used in trials:
        assert used <= limit, (name, nbytes, used)
    # conv1_2's arrays are 2 x 3.06 GiB: its workspace is what is left.
    conv12 = dict((n, b) for n, b, _ in trials)['conv1_2']
    assert 3 * GiB < conv12 < 5 * GiB
    assert dev.pool_bytes == held           # nothing kept


def test_measure_net_skips_a_convolution_whose_arrays_do_not_fit(fake_device, monkeypatch):
    param = shapes.load_net_param(bench('vgg16_b256'), phase=caffe_pb2.TRAIN)
    with shapes.quiet():
        net = shapes.build_net(param)
    fake_device(total=140 * GiB, other=500 * MiB, pool_bytes=1 * GiB)
    timed_names = []
    for layer in net.layers:
        if hasattr(layer, 'time_calls'):
            monkeypatch.setattr(layer, '_cd', object(), raising=False)
            monkeypatch.setattr(layer, 'time_calls',
                                lambda p, n, _l=layer: timed_names.append(_l.name) or {},
                                raising=False)
    # 5.5 GiB beside 1.5 held: conv1_1 (3.2 GiB of maps) fits, conv1_2 (6.1) does not.
    calibration.measure_net(net, limit=5.5 * GiB)
    assert 'conv1_1' in timed_names and 'conv1_2' not in timed_names
    assert 'conv5_3' in timed_names


def _prod(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _fake_nvidia_smi(directory, values):
    """An nvidia-smi on PATH that prints `values` (MiB) as -lms does, then
    waits to be ended; a bare query prints the first."""
    path = directory / 'nvidia-smi'
    lines = '\n'.join('echo %d' % v for v in values)
    path.write_text('#!/bin/sh\ncase "$*" in *-lms*) ;; *) echo %d; exit 0;; esac\n%s\n'
                    'exec sleep 600\n' % (values[0], lines))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_nvidia_smi_sampler_keeps_a_peak_per_phase(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, [100, 900, 300, 250])
    monkeypatch.setenv('PATH', '%s:%s' % (tmp_path, os.environ['PATH']))
    assert sampler.read_used_mib(0) == 100 * MiB
    s = sampler.NvidiaSmiSampler(0, interval_ms=10)
    s.start()
    try:
        assert s.wait_for_samples(2)
        s.set_phase('training')
        assert s.wait_for_samples(4)
    finally:
        s.stop()
    assert s.peak('startup') == 900 * MiB
    assert s.peak('training') <= 300 * MiB
    assert s.peak() == 900 * MiB
    assert [round(v / MiB) for _, v, _ in s.samples] == [100, 900, 300, 250]


def _load_bench():
    path = os.path.join(ROOT, 'benchmarks', 'bench_budget_startup.py')
    spec = importlib.util.spec_from_file_location('bench_budget_startup', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_solver_runs_the_net_for_the_iterations(tmp_path):
    from caffeplus.solver import read_solver_file
    bench_mod = _load_bench()
    param = read_solver_file(bench_mod.write_solver(str(tmp_path), bench('vgg16_b64'), 3))
    assert param.max_iter == 3 and param.display == 1
    assert param.net == os.path.abspath(bench('vgg16_b64'))
    assert bench_mod.FIRST_ITERATION.search(
        'I1202 10:00:00.000000  1 solver.py:433] Iteration 0 (0 iter/s, 1.2s/1 iters), '
        'loss = 6.9')


# -- on the GPU ------------------------------------------------------------------------
BUDGET_RUN = ('vgg16_b64', 4 * GiB)     # shared peaks at 4,283 MiB: the budget binds


def _peaks_mib(r):
    """A measured run's figures that explain a peak over the budget, in MiB."""
    keys = ('baseline_bytes', 'startup_peak_bytes', 'peak_bytes', 'process_peak_bytes',
            'arena_bytes')
    out = dict((k, round(r[k] / MiB)) for k in keys if r.get(k) is not None)
    out['breakdown'] = dict((k, round(v / MiB)) for k, v in (r.get('breakdown') or {}).items())
    out['planned'] = r.get('planned')
    return out


@pytest.mark.gpu
def test_budget_run_whole_process_peak_stays_within_the_budget():
    """`caffeplus train --memory auto --memory_budget 4G` on VGG-16 b64,
    nvidia-smi sampling every 50 ms: start-up (the algorithms' timing)
    and training stay within the budget."""
    name, limit = BUDGET_RUN
    r = _load_bench().watch_training(bench(name), 'auto', limit, iterations=4,
                                     interval_ms=50, timeout_s=400)
    assert r['exit_code'] == 0, '\n'.join(r['log_tail'])
    assert r['reached_training'] and r['samples'] > 10
    assert 0 < r['process_peak_bytes'] <= limit, r


@pytest.mark.gpu
def test_memory_command_reports_the_whole_process_peak():
    # In a process of its own, as a user runs it: a budget counts the
    # runtime's modelled fixed cost, and a process that already ran other
    # GPU work (this suite's earlier tests) holds more. Its figures are the
    # device's used memory: what this process holds is taken off.
    from caffeplus.memory import measure
    name, limit = BUDGET_RUN
    before = measure.device_used_bytes()
    proc = subprocess.run([sys.executable, '-m', 'caffeplus', 'memory', '-model', bench(name),
                           '-gpu', '0', '--plans', 'auto', '--budget', str(limit),
                           '--iterations', '1', '--json'],
                          capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)['plans']['auto']
    assert 'measure_error' not in r, r.get('measure_error')
    assert r['process_peak_bytes'] >= max(r['peak_bytes'], r['startup_peak_bytes']) > 0
    assert r['process_peak_bytes'] - before <= limit, dict(_peaks_mib(r),
                                                           others=round(before / MiB))
    assert r['device_name']
