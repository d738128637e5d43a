"""benchmarks/bench_multigpu.py without GPUs: `caffeplus train` replaced by
canned Caffe-format logs, to check what it counts, prints and writes."""
import importlib.util
import json
import os
import sys

import pytest

from conftest import ROOT

_spec = importlib.util.spec_from_file_location(
    'bench_multigpu', os.path.join(ROOT, 'benchmarks', 'bench_multigpu.py'))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _log(per_iter_s, ngpu, iters=60, display=10, first=5.0):
    """A rank 0 log: display lines every `display` iterations; the first
    window (cuDNN search, start-up) takes `first` seconds."""
    lines = []
    lines.append('I1122 10:00:00.000000  1 train.py:96] GPU 0: NVIDIA H200')
    if ngpu > 1:
        lines.append('I1122 10:00:00.000000  1 trainer.py:146] Data-parallel training on %d '
                     'ranks (nccl): batch 64 per rank, %d in all (x iter_size 1)'
                     % (ngpu, 64 * ngpu))
        lines.append('I1122 10:00:00.000000  1 sync.py:284] Gradient all-reduce: 32 parameters '
                     '(527.8 MiB) in 6 buckets (largest 392.0 MiB) overlapped with backward')
    for it in range(0, iters + 1, display):
        lapse = 0.001 if it == 0 else (first if it == display else per_iter_s * display)
        lines.append('I1122 10:00:01.000000  1 solver.py:392] Iteration %d (%g iter/s, %gs/%d '
                     'iters), loss = 6.9' % (it, display / lapse, lapse, display))
    return '\n'.join(lines) + '\n'


@pytest.fixture
def fake_train(monkeypatch):
    calls = []
    speed = {('vgg16_b64', 1): 0.070, ('vgg16_b64', 2): 0.074,
             ('resnet50_b64', 1): 0.075, ('resnet50_b64', 2): 0.095}

    def run_train(workdir, solver, gpus, flags, timeout, log_path):
        name = os.path.basename(solver).replace('_solver.prototxt', '')
        k = len(gpus.split(','))
        calls.append((name, gpus, flags))
        text = _log(speed[(name, k)], k)
        with open(log_path, 'w') as f:
            f.write(text)
        return 0, text, 12.0, [sys.executable, '-m', 'caffeplus', 'train', '-gpu', gpus] + flags
    monkeypatch.setattr(bench, 'run_train', run_train)
    return calls


def _bench_dir(tmp_path):
    d = tmp_path / 'bench'
    d.mkdir()
    for name in ('vgg16_b64', 'resnet50_b64'):
        (d / (name + '.prototxt')).write_text(
            'layer { name: "data" type: "DummyData" top: "data" top: "label" '
            'dummy_data_param { shape { dim: 64 dim: 3 dim: 224 dim: 224 } shape { dim: 64 } } }')
    return str(d)


def test_throughput_leaves_out_the_warmup_windows():
    text = _log(0.07, 1, iters=60, first=9.0)
    rate, counted, seconds = bench.throughput(text, 10)
    assert counted == 50 and abs(seconds - 3.5) < 1e-9 and abs(rate - 1 / 0.07) < 1e-6
    rate, counted, _ = bench.throughput(text, 60)
    assert rate is None and counted == 0


def test_bench_reports_ratio_pass_fail_json_and_markdown(tmp_path, fake_train, capsys):
    out_json, out_md = tmp_path / 'r.json', tmp_path / 'r.md'
    code = bench.main(['--bench-dir', _bench_dir(tmp_path), '--memory', 'shared',
                       '--json', str(out_json), '--md', str(out_md),
                       '--keep', str(tmp_path / 'work')])
    printed = capsys.readouterr().out
    assert code == 1                                    # ResNet-50 falls short
    report = json.loads(out_json.read_text())
    vgg, resnet = report['nets']
    assert vgg['net'] == 'vgg16_b64' and vgg['pass'] and not resnet['pass']
    assert abs(vgg['ratio'] - 2 * 0.070 / 0.074) < 1e-3
    assert vgg['runs'][0]['images_per_s'] == round(64 / 0.070, 1)
    assert vgg['runs'][1]['timed_iterations'] == 50
    assert vgg['runs'][1]['gradient_plan'].startswith('Gradient all-reduce: 32 parameters')
    assert report['pass'] is False and report['memory'] == 'shared'
    assert [(n, g) for n, g, _ in fake_train] == [('vgg16_b64', '0'), ('vgg16_b64', '0,1'),
                                                  ('resnet50_b64', '0'),
                                                  ('resnet50_b64', '0,1')]
    assert all(flags[:2] == ['--memory', 'shared'] for _, _, flags in fake_train)
    assert 'ratio 1.89x -> pass' in printed and 'FAIL' in printed
    md = out_md.read_text()
    assert '| vgg16_b64 | 64 | 914.3 img/s | 1729.7 img/s | 1.89x (pass; 50 timed iterations) |' \
        in md, md
    assert 'NVIDIA H200' in md and 'memory plan shared' in md


def test_bench_default_memory_plan_is_caffeplus_trains(tmp_path, fake_train):
    bench.main(['--bench-dir', _bench_dir(tmp_path), '--nets', 'vgg16_b64'])
    assert all('--memory' not in flags for _, _, flags in fake_train)


def test_bench_counts_a_multi_gpu_run_without_ranks_as_failed(tmp_path, monkeypatch):
    def run_train(workdir, solver, gpus, flags, timeout, log_path):
        text = _log(0.07, 1)                    # no "Data-parallel training" line
        return 0, text, 1.0, ['caffeplus']
    monkeypatch.setattr(bench, 'run_train', run_train)
    out = tmp_path / 'r.json'
    assert bench.main(['--bench-dir', _bench_dir(tmp_path), '--nets', 'vgg16_b64',
                       '--json', str(out)]) == 1
    run = json.loads(out.read_text())['nets'][0]['runs'][1]
    assert 'data-parallel ranks' in run['error'] and run['images_per_s'] is None
