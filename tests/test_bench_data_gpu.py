"""benchmarks/bench_data_gpu.py without a GPU: `caffeplus train` replaced by
a canned Caffe-format log, to check the runs it asks for and what it reads."""
import importlib.util
import json
import os
import subprocess

from google.protobuf import text_format

from caffeplus.proto import caffe_pb2
from conftest import ROOT

_spec = importlib.util.spec_from_file_location(
    'bench_data_gpu', os.path.join(ROOT, 'benchmarks', 'bench_data_gpu.py'))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _log(ms):
    """Iteration lines every 10 iterations, `ms` apart per iteration."""
    lines = []
    for it in range(0, 70, 10):
        s = 10.0 + it * ms / 1000.0
        lines.append('I1205 10:00:%09.6f  1 solver.py:392] Iteration %d (1 iter/s, 1s/10 iters), '
                     'loss = 6.9' % (s, it))
    return '\n'.join(lines) + '\n'


def test_precision_reaches_caffeplus_train_and_the_record(monkeypatch, tmp_path, capsys):
    runs = []

    def fake_run(cmd, cwd=None, capture_output=True, text=True):
        solver = caffe_pb2.SolverParameter()
        text_format.Parse(open(cmd[cmd.index('-solver') + 1]).read(), solver)
        net = caffe_pb2.NetParameter()
        text_format.Parse(open(solver.net).read(), net)
        runs.append((cmd, net))
        return subprocess.CompletedProcess(cmd, 0, _log(5.0), '')

    monkeypatch.setattr(bench.subprocess, 'run', fake_run)
    out = tmp_path / 'out.json'
    assert bench.main(['--nets', 'alexnettv_b128', '--inputs', 'constant',
                       '--precision', 'fp16', '--json', str(out)]) == 0
    (cmd, net), = runs
    assert cmd[cmd.index('--precision') + 1] == 'fp16'
    # torchvision's AlexNet comes from benchmarks/nets, its image filled with a constant
    assert net.name == 'AlexNet-torchvision'
    filler = net.layer[0].dummy_data_param.data_filler[0]
    assert (filler.type, filler.value) == ('constant', 0.5)
    record = json.loads(out.read_text())
    assert record['precision'] == 'fp16'
    (row,) = record['results']
    assert (row['net'], row['batch']) == ('alexnettv_b128', 128)
    assert abs(row['ms'] - 5.0) < 1e-6
    assert '| alexnettv_b128 | constant | 5.0 |' in capsys.readouterr().out


def test_without_precision_the_nets_run_as_written(monkeypatch, tmp_path):
    cmds = []

    def fake_run(cmd, cwd=None, capture_output=True, text=True):
        cmds.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, _log(11.0), '')

    monkeypatch.setattr(bench.subprocess, 'run', fake_run)
    assert bench.main(['--nets', 'alexnet_b128', '--inputs', 'constant']) == 0
    assert '--precision' not in cmds[0]
