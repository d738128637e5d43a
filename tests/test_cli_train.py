"""The train, test, time and device_query commands: Caffe's flags, log lines
and exit codes.

Most runs are in process on a tiny DummyData net; one train run goes through
a real subprocess (stderr in glog format, parse_log on the result), and one
checks SIGHUP (snapshot) and SIGINT (stop) on a running trainer.
"""
import logging
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy
import pytest

from caffeplus import cli, log
from caffeplus.log import GlogFormatter
from caffeplus.proto import caffe_pb2
from conftest import REFERENCE, ROOT, one_blas_thread

TINY_NET = '''
name: "tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { shape { dim: 8 dim: 5 } shape { dim: 8 }
                           data_filler { type: "gaussian" std: 1 }
                           data_filler { type: "constant" value: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy"
        include { phase: TEST } }
'''

TINY_SOLVER = '''
net: "tiny.prototxt"
test_iter: 2
test_interval: 10
base_lr: 0.1
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
display: 5
max_iter: 20
snapshot: 10
snapshot_prefix: "snap/tiny"
solver_mode: CPU
random_seed: 1701
'''

GLOG = re.compile(r'^[IWEF]\d{8} \d\d:\d\d:\d\d\.\d{6} +\d+ [\w.]+:\d+\] ')
# Caffe's tools/extra/parse_log.py
REGEX_ITERATION = re.compile(r'Iteration (\d+)')
REGEX_TRAIN_OUTPUT = re.compile(r'Train net output #(\d+): (\S+) = ([\.\deE+-]+)')
REGEX_TEST_OUTPUT = re.compile(r'Test net output #(\d+): (\S+) = ([\.\deE+-]+)')
REGEX_LEARNING_RATE = re.compile(r'lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)')


@pytest.fixture(scope='module', autouse=True)
def _single_blas_thread():
    with one_blas_thread():
        yield


class Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.setFormatter(GlogFormatter())
        self.lines, self.messages = [], []

    def emit(self, record):
        self.lines.append(self.format(record))
        self.messages.append(record.getMessage())


def run_cli(cwd, *argv):
    """In process: (exit code, Capture)."""
    cap = Capture()
    log.logger.addHandler(cap)
    old = os.getcwd()
    os.chdir(cwd)
    try:
        rc = cli.main(list(argv))
    finally:
        os.chdir(old)
        log.logger.removeHandler(cap)
    return rc, cap


@pytest.fixture
def tiny(tmp_path):
    (tmp_path / 'tiny.prototxt').write_text(TINY_NET)
    (tmp_path / 'solver.prototxt').write_text(TINY_SOLVER)
    (tmp_path / 'snap').mkdir()
    return tmp_path


def env():
    e = dict(os.environ)
    e['PYTHONPATH'] = ROOT + os.pathsep + e.get('PYTHONPATH', '')
    e.setdefault('OPENBLAS_NUM_THREADS', '1')
    return e


# -- train -------------------------------------------------------------------------
def test_train_subprocess_log_format_and_parse_log(tiny):
    proc = subprocess.run([sys.executable, '-m', 'caffeplus', 'train', '-solver',
                           'solver.prototxt'], cwd=str(tiny), env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    glog = [l for l in lines if GLOG.match(l)]
    # everything else is a continuation of a multi-line parameter dump
    assert all(GLOG.match(l) or not l.startswith(('I2', 'W2', 'E2', 'F2')) for l in lines)
    messages = [GLOG.sub('', l) for l in glog]
    assert messages[0] == 'Use CPU.'
    assert messages[1] == 'Initializing solver from parameters: '
    for want in ('Solving tiny', 'Learning Rate Policy: inv', 'Iteration 0, Testing net (#0)',
                 'Snapshotting to binary proto file snap/tiny_iter_10.caffemodel',
                 'Snapshotting solver state to binary proto file snap/tiny_iter_10.solverstate',
                 'Snapshotting to binary proto file snap/tiny_iter_20.caffemodel',
                 'Starting Optimization', 'Optimization Done.'):
        assert want in messages, want
    assert messages[-2:] == ['Optimization Done.', 'Optimization Done.']
    train = [m for m in messages if REGEX_TRAIN_OUTPUT.search(m)]
    test = [m for m in messages if REGEX_TEST_OUTPUT.search(m)]
    lrs = [m for m in messages if REGEX_LEARNING_RATE.search(m)]
    assert len(train) == 4 and len(test) == 3 * 2 and len(lrs) == 4
    assert [int(REGEX_ITERATION.search(m).group(1)) for m in lrs] == [0, 5, 10, 15]
    for m in messages:
        g = re.match(r'^Iteration (\d+) \((\S+) iter/s, (\S+)s/5 iters\), loss = (\S+)$', m)
        if g:
            float(g.group(2)), float(g.group(3)), float(g.group(4))
    assert sorted(os.listdir(tiny / 'snap')) == [
        'tiny_iter_10.caffemodel', 'tiny_iter_10.solverstate',
        'tiny_iter_10.solverstate.caffeplus.json', 'tiny_iter_20.caffemodel',
        'tiny_iter_20.solverstate', 'tiny_iter_20.solverstate.caffeplus.json']
    # caffeplus's own parse_log (Caffe's parse_log.py) reads the log
    try:
        from caffeplus.commands.parse_log import parse_log
    except ImportError:
        return
    path = tiny / 'train.log'
    path.write_text(proc.stderr)
    train_rows, test_rows = parse_log(str(path))
    assert [r['NumIters'] for r in train_rows] == [0, 5, 10, 15]
    assert [r['NumIters'] for r in test_rows] == [0, 10, 20]
    assert all('loss' in r for r in train_rows)
    assert all('accuracy' in r and 'loss' in r for r in test_rows)
    assert train_rows[1]['LearningRate'] == pytest.approx(0.1 * (1 + 0.0001 * 5) ** -0.75,
                                                          rel=1e-5)


def _error(capsys):
    return capsys.readouterr().err


def test_train_bad_input_names_the_file(tiny, capsys):
    assert run_cli(tiny, 'train')[0] == 1
    assert 'Need a solver definition' in _error(capsys)
    assert run_cli(tiny, 'train', '-solver', 'nope.prototxt')[0] == 1
    assert 'nope.prototxt' in _error(capsys)
    (tiny / 'bad_net.prototxt').write_text(TINY_SOLVER.replace('tiny.prototxt',
                                                               'missing_net.prototxt'))
    assert run_cli(tiny, 'train', '-solver', 'bad_net.prototxt')[0] == 1
    err = _error(capsys)
    assert 'missing_net.prototxt' in err and 'bad_net.prototxt' in err
    assert run_cli(tiny, 'train', '-solver', 'solver.prototxt', '-weights', 'w.caffemodel')[0] == 1
    assert 'w.caffemodel' in _error(capsys)
    assert run_cli(tiny, 'train', '-solver', 'solver.prototxt', '-weights', 'w.caffemodel',
                   '-snapshot', 's.solverstate')[0] == 1
    assert 'not both' in _error(capsys)
    assert run_cli(tiny, 'train', '-solver', 'solver.prototxt', '-snapshot',
                   'snap/x.solverstate')[0] == 1
    assert 'snap/x.solverstate' in _error(capsys)
    (tiny / 'typo.prototxt').write_text(TINY_SOLVER + 'type: "Adamm"\n')
    assert run_cli(tiny, 'train', '-solver', 'typo.prototxt')[0] == 1
    assert 'Unknown solver type: Adamm' in _error(capsys)
    (tiny / 'syntax.prototxt').write_text(TINY_SOLVER + 'base_lr 0.1 }\n')
    assert run_cli(tiny, 'train', '-solver', 'syntax.prototxt')[0] == 1
    assert 'syntax.prototxt' in _error(capsys)
    with pytest.raises(SystemExit) as exc:
        run_cli(tiny, 'train', '-solver', 'solver.prototxt', '-sigint_effect', 'explode')
    assert exc.value.code == 2


def test_train_gpu_without_cupy(tiny, capsys):
    try:
        import cupy  # noqa: F401
        pytest.skip('CuPy is installed')
    except ImportError:
        pass
    assert run_cli(tiny, 'train', '-solver', 'solver.prototxt', '-gpu', '0')[0] == 1
    assert 'CuPy' in _error(capsys)
    # solver_mode GPU in the file (as in BVLC's solvers): a warning, then the CPU
    (tiny / 'gpu.prototxt').write_text(TINY_SOLVER.replace('solver_mode: CPU', 'solver_mode: GPU')
                                       .replace('max_iter: 20', 'max_iter: 2'))
    rc, cap = run_cli(tiny, 'train', '-solver', 'gpu.prototxt')
    assert rc == 0
    assert any('training on the CPU' in m for m in cap.messages)
    assert 'Use CPU.' in cap.messages


def test_finetune_from_several_weights_files(tiny):
    rc, _ = run_cli(tiny, 'train', '-solver', 'solver.prototxt')
    assert rc == 0
    (tiny / 'zero.prototxt').write_text(TINY_SOLVER.replace('max_iter: 20', 'max_iter: 0')
                                        .replace('snap/tiny', 'ft/tiny')
                                        .replace('snapshot: 10', 'snapshot: 0'))
    (tiny / 'ft').mkdir()
    rc, cap = run_cli(tiny, 'train', '-solver', 'zero.prototxt', '-weights',
                      'snap/tiny_iter_10.caffemodel,snap/tiny_iter_20.caffemodel')
    assert rc == 0
    # train net and test net, each file in order
    assert cap.messages.count('Finetuning from snap/tiny_iter_10.caffemodel') == 2
    assert cap.messages.count('Finetuning from snap/tiny_iter_20.caffemodel') == 2
    assert 'weights: "snap/tiny_iter_10.caffemodel,snap/tiny_iter_20.caffemodel"' in \
        '\n'.join(cap.messages)
    a, b = caffe_pb2.NetParameter(), caffe_pb2.NetParameter()
    a.ParseFromString((tiny / 'snap' / 'tiny_iter_20.caffemodel').read_bytes())
    b.ParseFromString((tiny / 'ft' / 'tiny_iter_0.caffemodel').read_bytes())
    assert a.layer[1].blobs[0].data == b.layer[1].blobs[0].data


def test_resume_via_cli_and_stage_level_flags(tiny):
    rc, _ = run_cli(tiny, 'train', '-solver', 'solver.prototxt')
    assert rc == 0
    final = (tiny / 'snap' / 'tiny_iter_20.caffemodel').read_bytes()
    os.remove(tiny / 'snap' / 'tiny_iter_20.caffemodel')
    rc, cap = run_cli(tiny, 'train', '-solver', 'solver.prototxt', '-snapshot',
                      'snap/tiny_iter_10.solverstate', '-level', '2', '-stage', 'a,b')
    assert rc == 0
    assert 'Resuming from snap/tiny_iter_10.solverstate' in cap.messages
    text = '\n'.join(cap.messages)
    assert 'train_state {\n  level: 2\n  stage: "a"\n  stage: "b"\n}' in text
    a, b = caffe_pb2.NetParameter(), caffe_pb2.NetParameter()
    a.ParseFromString(final)
    b.ParseFromString((tiny / 'snap' / 'tiny_iter_20.caffemodel').read_bytes())
    # the same weights (the file's net state differs: level 2, stages a, b)
    assert [list(x.data) for l in a.layer for x in l.blobs] == \
        [list(x.data) for l in b.layer for x in l.blobs]
    assert list(b.state.stage) == ['a', 'b'] and b.state.level == 2
    # the first iteration after the resume is 10
    assert [m for m in cap.messages if re.match(r'^Iteration \d+ \(', m)][0].startswith(
        'Iteration 10 (')


def test_memory_flags_are_parsed_and_stored(tiny):
    (tiny / 'short.prototxt').write_text(TINY_SOLVER.replace('max_iter: 20', 'max_iter: 1'))
    rc, cap = run_cli(tiny, 'train', '-solver', 'short.prototxt', '--memory', 'shared',
                      '--workspace_limit', '64M', '--memory_budget', '2G', '--keep', 'ip,loss',
                      '--offload', 'conv')
    assert rc == 0
    text = '\n'.join(cap.messages)
    assert 'memory_plan: "shared"' in text and 'workspace_limit: 67108864' in text
    assert 'memory_budget: 2147483648' in text
    assert 'keep: "ip"\n  keep: "loss"' in text and 'offload: "conv"' in text
    with pytest.raises(SystemExit):
        run_cli(tiny, 'train', '-solver', 'short.prototxt', '--memory', 'lots')
    # the spellings the issues use: dashes, and policy 'free'
    rc, cap = run_cli(tiny, 'train', '-solver', 'short.prototxt', '--memory', 'offload',
                      '--workspace-limit', '32M', '--memory-budget', '1G', '--offload', 'free')
    assert rc == 0
    text = '\n'.join(cap.messages)
    assert 'workspace_limit: 33554432' in text and 'memory_budget: 1073741824' in text
    assert 'offload: "free"' in text


def test_train_usage_lists_caffe_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(['train', '--help'])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ('--solver', '--weights', '--snapshot', '--gpu', '--sigint_effect',
                 '--sighup_effect', '--level', '--stage', '--memory', '--workspace_limit'):
        assert flag in out


# -- signals ------------------------------------------------------------------------
class TrainProcess:
    """`caffeplus train` in a subprocess, its log lines read by a thread, so
    the test waits for the line it needs (a deadline only guards a hang)."""

    DEADLINE_S = 300

    def __init__(self, cwd, *flags):
        self.proc = subprocess.Popen([sys.executable, '-m', 'caffeplus', 'train'] + list(flags),
                                     cwd=str(cwd), env=env(), stderr=subprocess.PIPE, text=True)
        self.lines = []
        self._queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self._queue.put(line.rstrip('\n'))
        self._queue.put(None)

    def wait_for(self, pattern):
        """The next log line matching `pattern`."""
        deadline = time.monotonic() + self.DEADLINE_S
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError('train ended (status %s) before %r:\n%s'
                                     % (self.proc.wait(), pattern, self.tail()))
            self.lines.append(line)
            if re.search(pattern, line):
                return line
        raise AssertionError('no %r within %d s:\n%s' % (pattern, self.DEADLINE_S, self.tail()))

    def send(self, signum):
        self.proc.send_signal(signum)

    def finish(self):
        """The exit status, once the process and its log have ended."""
        code = self.proc.wait(timeout=self.DEADLINE_S)
        self._reader.join()
        while True:
            line = self._queue.get()
            if line is None:
                return code
            self.lines.append(line)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def tail(self, n=30):
        return '\n'.join(self.lines[-n:])


def write_long_solver(folder):
    """TINY_SOLVER without an end in sight, its interval snapshots off."""
    (folder / 'long.prototxt').write_text(
        TINY_SOLVER.replace('max_iter: 20', 'max_iter: 10000000').replace('snapshot: 10',
                                                                          'snapshot: 0')
        .replace('display: 5', 'display: 200'))
    return 'long.prototxt'


SOLVERSTATE_LINE = r'Snapshotting solver state to binary proto file snap/tiny_iter_(\d+)'


def snapshot_iteration(line):
    return int(re.search(r'tiny_iter_(\d+)', line).group(1))


@pytest.mark.skipif(not hasattr(signal, 'SIGHUP'), reason='needs SIGHUP')
def test_sighup_snapshots_and_sigint_stops(tiny):
    train = TrainProcess(tiny, '-solver', write_long_solver(tiny))
    try:
        train.wait_for(r'\] Iteration 200 \(')
        train.send(signal.SIGHUP)
        hup = snapshot_iteration(train.wait_for(SOLVERSTATE_LINE))
        train.send(signal.SIGINT)
        # SIGINT stops; snapshot_after_train writes the last iteration too
        # (the same one as SIGHUP's when both land while the net tests,
        # before the iteration's training step, as in Caffe).
        final = snapshot_iteration(train.wait_for(SOLVERSTATE_LINE))
        train.wait_for(r'\] Optimization stopped early\.')
        train.wait_for(r'\] Optimization Done\.')
        assert train.finish() == 0, train.tail()
    finally:
        train.stop()
    assert final >= hup
    states = sorted(s for s in os.listdir(tiny / 'snap') if s.endswith('.solverstate'))
    assert states == sorted({'tiny_iter_%d.solverstate' % hup,
                             'tiny_iter_%d.solverstate' % final})


@pytest.mark.parametrize('sigint_effect', ['stop', 'snapshot', 'none'])
def test_sigterm_stops_with_the_final_snapshot_whatever_the_flags(tiny, sigint_effect):
    """SIGTERM (docker stop, systemd, a scheduler's pre-emption) ends the run
    as a SIGINT stop does: the final snapshot, Caffe's lines, status 0, even
    when -sigint_effect / -sighup_effect would only snapshot or do nothing."""
    train = TrainProcess(tiny, '-solver', write_long_solver(tiny),
                         '-sigint_effect', sigint_effect, '-sighup_effect', 'none')
    try:
        train.wait_for(r'\] Iteration 200 \(')
        train.send(signal.SIGTERM)
        final = snapshot_iteration(train.wait_for(SOLVERSTATE_LINE))
        train.wait_for(r'\] Optimization stopped early\.')
        train.wait_for(r'\] Optimization Done\.')
        assert train.finish() == 0, train.tail()
    finally:
        train.stop()
    assert final >= 200
    snapshots = sorted(f for f in os.listdir(tiny / 'snap')
                       if f.endswith(('.caffemodel', '.solverstate')))
    assert snapshots == ['tiny_iter_%d.caffemodel' % final, 'tiny_iter_%d.solverstate' % final]
    assert not any('Traceback' in line for line in train.lines), train.tail()


# -- test ----------------------------------------------------------------------------
def _copy_training(root):
    src = os.path.join(REFERENCE, 'training')
    if not os.path.isdir(src):
        pytest.fail('test data missing: %s' % src)
    dst = os.path.join(str(root), 'training')
    os.makedirs(os.path.join(dst, 'sgd'))
    shutil.copytree(os.path.join(src, 'data'), os.path.join(dst, 'data'))
    shutil.copy(os.path.join(src, 'lenet_train_test.prototxt'), dst)
    shutil.copy(os.path.join(src, 'sgd', 'lenet_iter_30.caffemodel'), os.path.join(dst, 'sgd'))
    return str(root)


def _messages(path):
    out = []
    with open(path) as f:
        for l in f:
            m = re.match(r'^[IWEF]\d+ [\d:.]+ +\d+ \S+\] (.*)$', l.rstrip('\n'))
            if m:
                out.append(m.group(1))
    return out


NUMBER = r'[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?'


def test_test_command_matches_caffe(tmp_path):
    root = _copy_training(tmp_path)
    rc, cap = run_cli(root, 'test', '-model', 'training/lenet_train_test.prototxt',
                      '-weights', 'training/sgd/lenet_iter_30.caffemodel', '-iterations', '2')
    assert rc == 0
    ref = _messages(os.path.join(REFERENCE, 'cli', 'test_lenet_sgd.log'))
    assert cap.messages[0] == ref[0] == 'Use CPU.'
    ours = cap.messages[cap.messages.index('Running for 2 iterations.'):]
    theirs = ref[ref.index('Running for 2 iterations.'):]
    theirs = [m for m in theirs if not m.startswith('Restarting data')]
    ours = [m for m in ours if not m.startswith('Restarting data')]
    assert [re.sub(NUMBER, '#', m) for m in ours] == [re.sub(NUMBER, '#', m) for m in theirs]
    for a, b in zip(ours, theirs):
        numpy.testing.assert_allclose([float(x) for x in re.findall(NUMBER, a)],
                                      [float(x) for x in re.findall(NUMBER, b)], rtol=1e-4)
    # the TEST net state as Caffe prints it (phase, level, the empty stage)
    assert 'state {\n  phase: TEST\n  level: 0\n  stage: ""\n}' in '\n'.join(cap.messages)


def test_test_command_errors(tmp_path, capsys):
    root = _copy_training(tmp_path)
    assert run_cli(root, 'test', '-model', 'training/lenet_train_test.prototxt')[0] == 1
    assert 'Need model weights' in _error(capsys)
    assert run_cli(root, 'test', '-model', 'nope.prototxt', '-weights', 'w')[0] == 1
    assert 'nope.prototxt' in _error(capsys)
    assert run_cli(root, 'test', '-model', 'training/lenet_train_test.prototxt', '-weights',
                   'training/sgd/nope.caffemodel', '-iterations', '1')[0] == 1
    assert 'nope.caffemodel' in _error(capsys)
    assert run_cli(root, 'test', '-model', 'training/lenet_train_test.prototxt', '-weights',
                   'training/sgd/lenet_iter_30.caffemodel', '-phase', 'VAL')[0] == 1
    assert 'TRAIN' in _error(capsys)


# -- time ----------------------------------------------------------------------------
def test_time_command_lines(tmp_path):
    src = os.path.join(REFERENCE, 'cli', 'lenet_dummy_b64.prototxt')
    if not os.path.exists(src):
        pytest.fail('test data missing: %s' % src)
    shutil.copy(src, tmp_path)
    rc, cap = run_cli(tmp_path, 'time', '-model', 'lenet_dummy_b64.prototxt', '-iterations', '5')
    assert rc == 0
    ref = _messages(os.path.join(REFERENCE, 'cli', 'time_lenet_dummy_b64.log'))
    ours = cap.messages[cap.messages.index('Performing Forward'):]
    theirs = ref[ref.index('Performing Forward'):]
    assert [re.sub(NUMBER, '#', m) for m in ours] == [re.sub(NUMBER, '#', m) for m in theirs]
    assert cap.messages[0] == 'Use CPU.'
    layer_lines = [m for m in ours if '\tforward: ' in m]
    assert [m.split('\t')[0] for m in layer_lines] == [m.split('\t')[0] for m in theirs
                                                        if '\tforward: ' in m]
    assert layer_lines[1].startswith('     conv1\tforward: ')
    # the average forward-backward agrees with the total
    total = float(re.match(r'Total Time: (\S+) ms\.', ours[-2]).group(1))
    avg = float(re.match(r'Average Forward-Backward: (\S+) ms\.', ours[-3]).group(1))
    assert avg == pytest.approx(total / 5, rel=1e-5)


def test_time_errors(tmp_path, capsys):
    assert run_cli(tmp_path, 'time')[0] == 1
    assert 'Need a model definition' in _error(capsys)
    (tmp_path / 'tiny.prototxt').write_text(TINY_NET)
    assert run_cli(tmp_path, 'time', '-model', 'tiny.prototxt', '-phase', 'test')[0] == 1
    assert 'phase must be' in _error(capsys)
    rc, cap = run_cli(tmp_path, 'time', '-model', 'tiny.prototxt', '-phase', 'TEST',
                      '-iterations', '2')
    assert rc == 0 and any(m.startswith('  accuracy\tforward: ') for m in cap.messages)


# -- device_query ---------------------------------------------------------------------
def test_device_query_without_gpu(tmp_path, capsys):
    assert run_cli(tmp_path, 'device_query')[0] == 1
    assert 'Need a device ID' in _error(capsys)
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip('a GPU is present')
    except Exception:
        pass
    assert run_cli(tmp_path, 'device_query', '-gpu', '0')[0] == 1
    err = _error(capsys)
    assert 'CuPy' in err or 'GPU' in err


@pytest.mark.gpu
def test_device_query_lists_properties(tmp_path):
    rc, cap = run_cli(tmp_path, 'device_query', '-gpu', '0')
    assert rc == 0
    assert cap.messages[0] == 'Querying GPUs 0'
    assert cap.messages[1] == 'Device id:                     0'
    assert cap.messages[4].startswith('Name:                          ')
    assert re.match(r'^Total global memory:           \d+$', cap.messages[5])


@pytest.mark.gpu
def test_train_test_time_on_gpu(tiny, monkeypatch):
    import caffeplus
    # DummyData drawn on the host in GPU mode too: the GPU run sees the CPU
    # run's numbers (by default the GPU draws its own, on the device).
    from caffeplus.layers import data as data_layers
    monkeypatch.setattr(data_layers, 'DUMMYDATA_ON_HOST', True)
    try:
        rc, cpu = run_cli(tiny, 'train', '-solver', 'solver.prototxt')
        assert rc == 0
        cpu_weights = (tiny / 'snap' / 'tiny_iter_20.caffemodel').read_bytes()
        rc, cap = run_cli(tiny, 'train', '-solver', 'solver.prototxt', '-gpu', '0')
        assert rc == 0
        assert 'Using GPUs 0' in cap.messages
        assert any(m.startswith('GPU 0: ') for m in cap.messages)
        a, b = caffe_pb2.NetParameter(), caffe_pb2.NetParameter()
        a.ParseFromString(cpu_weights)
        b.ParseFromString((tiny / 'snap' / 'tiny_iter_20.caffemodel').read_bytes())
        for la, lb in zip(a.layer, b.layer):
            for x, y in zip(la.blobs, lb.blobs):
                numpy.testing.assert_allclose(numpy.array(y.data), numpy.array(x.data),
                                              rtol=1e-4, atol=1e-5)
        rc, cap = run_cli(tiny, 'test', '-model', 'tiny.prototxt', '-weights',
                          'snap/tiny_iter_20.caffemodel', '-gpu', '0', '-iterations', '3')
        assert rc == 0 and 'Use GPU with device ID 0' in cap.messages
        rc, cap = run_cli(tiny, 'time', '-model', 'tiny.prototxt', '-gpu', '0',
                          '-iterations', '3')
        assert rc == 0 and cap.messages[-1] == '*** Benchmark ends ***'
    finally:
        caffeplus.set_mode_cpu()


def test_signal_handler_actions_and_double_sigint():
    from caffeplus.commands.train import SignalHandler
    h = SignalHandler('stop', 'snapshot')
    assert h.action() == 'none'
    if hasattr(signal, 'SIGHUP'):
        h._handle(signal.SIGHUP, None)
    h._handle(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        h._handle(signal.SIGINT, None)
    if hasattr(signal, 'SIGHUP'):
        assert h.action() == 'snapshot'
    assert h.action() == 'stop'
    assert h.action() == 'none'
    quiet = SignalHandler('none', 'none')
    quiet._handle(signal.SIGINT, None)
    assert quiet.action() == 'none'


@pytest.mark.parametrize('sigint_effect', ['stop', 'snapshot', 'none'])
def test_sigterm_always_stops_and_a_second_one_exits(sigint_effect):
    from caffeplus.commands.train import SignalHandler
    h = SignalHandler(sigint_effect, 'snapshot')
    if hasattr(signal, 'SIGHUP'):
        h._handle(signal.SIGHUP, None)
    h._handle(signal.SIGTERM, None)
    with pytest.raises(SystemExit) as info:
        h._handle(signal.SIGTERM, None)
    assert info.value.code == 128 + signal.SIGTERM
    # The stop outranks the snapshot queued before it.
    assert h.action() == 'stop'
    if hasattr(signal, 'SIGHUP'):
        assert h.action() == 'snapshot'
    assert h.action() == 'none'


def test_sigterm_policy_of_a_rank():
    """A training rank's SIGTERM: a stop request, never escalated by a
    repeat (a scheduler and the supervisor may both send one), but at once
    when the supervisor is stopping the ranks (its abort file exists)."""
    import tempfile
    from caffeplus.commands.train import SignalHandler
    from caffeplus.parallel.trainer import Terminated, unwind_if_aborting
    with tempfile.TemporaryDirectory() as rundir:
        abort = os.path.join(rundir, 'abort')
        h = SignalHandler('snapshot', 'none', on_sigterm=unwind_if_aborting(abort))
        h._handle(signal.SIGTERM, None)
        h._handle(signal.SIGTERM, None)
        assert h.action() == 'stop'
        assert h.action() == 'none'
        open(abort, 'w').close()
        with pytest.raises(Terminated):
            h._handle(signal.SIGTERM, None)


@pytest.mark.gpu
@pytest.mark.parametrize('name,kind', [('fp16', 'FLOAT16'), ('bf16', 'BFLOAT16')])
def test_train_in_16_bits_on_gpu_writes_fp32_weights(tiny, name, kind):
    """`caffeplus train --precision fp16|bf16 -gpu 0`: the net stores its
    maps in 16 bits on the device, and the snapshot's weights are FP32 (the
    masters), as stock Caffe reads them."""
    import caffeplus
    if name == 'bf16':
        pytest.importorskip('ml_dtypes')
    try:
        rc, cap = run_cli(tiny, 'train', '-solver', 'solver.prototxt', '-gpu', '0',
                          '--precision', name)
        assert rc == 0
        assert any('stores %s activations and gradients on the GPU' % kind in m
                   for m in cap.messages)
        weights = caffe_pb2.NetParameter()
        weights.ParseFromString((tiny / 'snap' / 'tiny_iter_20.caffemodel').read_bytes())
        blobs = [b for layer in weights.layer for b in layer.blobs]
        assert blobs and all(len(b.data) == numpy.prod(b.shape.dim) and not b.raw_data
                             for b in blobs)
        assert all(numpy.isfinite(b.data).all() for b in blobs)
    finally:
        caffeplus.set_mode_cpu()
