"""LeNet training against stock Caffe's reference runs (training/ and cli/).

Each run is `caffeplus train -solver training/<run>/solver.prototxt -weights
training/init.caffemodel`, run in a temporary copy of the reference set's
root (snapshots must not land in the shared folder), in process. Checked
against stock Caffe's log and files:
  * the log, message for message (timings and data-prefetch lines aside);
  * every logged loss (rtol 2e-3) and learning rate (as printed);
  * test accuracy and loss at iterations 0, 10, 20, 30;
  * the final weights and solver history (lenet_iter_30.*).
Plus resuming: a run resumed from a snapshot is bit-identical to an
uninterrupted one, and a resume from a stock-Caffe state (no caffeplus
sidecar) reproduces Caffe's own resume log.
"""
import logging
import os
import re
import shutil

import numpy
import pytest

from caffeplus import cli, log
from caffeplus.log import GlogFormatter
from caffeplus.proto import caffe_pb2
from conftest import REFERENCE, one_blas_thread

TRAINING = os.path.join(REFERENCE, 'training')
RUNS = ['sgd', 'nesterov', 'adagrad', 'adam']
ADAPTIVE = {'adagrad', 'adam'}


@pytest.fixture(scope='module', autouse=True)
def _single_blas_thread():
    with one_blas_thread():
        yield


class Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.setFormatter(GlogFormatter())
        self.lines = []
        self.messages = []

    def emit(self, record):
        self.lines.append(self.format(record))
        self.messages.append(record.getMessage())


def copy_reference(root, runs=RUNS, cli_dir=False):
    """The parts of the reference set a training run reads, under `root`."""
    dst = os.path.join(root, 'training')
    os.makedirs(dst, exist_ok=True)
    shutil.copytree(os.path.join(TRAINING, 'data'), os.path.join(dst, 'data'))
    for name in ('lenet_train_test.prototxt', 'init.caffemodel'):
        shutil.copy(os.path.join(TRAINING, name), dst)
    for run in runs:
        os.makedirs(os.path.join(dst, run))
        shutil.copy(os.path.join(TRAINING, run, 'solver.prototxt'), os.path.join(dst, run))
    if cli_dir:
        shutil.copytree(os.path.join(REFERENCE, 'cli'), os.path.join(root, 'cli'))
    return root


def caffeplus_main(argv, cwd):
    """Run the CLI in process in `cwd`; (exit code, Capture)."""
    cap = Capture()
    log.logger.addHandler(cap)
    old = os.getcwd()
    os.chdir(cwd)
    try:
        rc = cli.main(argv)
    finally:
        os.chdir(old)
        log.logger.removeHandler(cap)
    return rc, cap


@pytest.fixture(scope='module', params=['as_is', 'every_update_in_backward'])
def runs(request, tmp_path_factory):
    """Train every reference run once (about a second each); a second time
    with every parameter updated in backward (caffeplus.solver.
    update_in_backward: LeNet's gradients are all under the size that
    leaves by default), which must change no number and no log line."""
    from caffeplus.memory import liveness
    root = copy_reference(str(tmp_path_factory.mktemp('reference')))
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        if request.param == 'every_update_in_backward':
            mp.setattr(liveness, 'MIN_APPLIED_GRADIENT_BYTES', 0)
        for run in RUNS:
            rc, cap = caffeplus_main(['train', '-solver', 'training/%s/solver.prototxt' % run,
                                      '-weights', 'training/init.caffemodel'], root)
            out[run] = (rc, cap, root)
    return out


def ref_messages(path):
    with open(path) as f:
        lines = [l.rstrip('\n') for l in f]
    # glog continuation lines (the multi-line parameter dumps) have no prefix
    out = []
    for l in lines:
        m = re.match(r'^[IWEF]\d+ [\d:.]+ +\d+ \S+\] (.*)$', l)
        out.append(m.group(1) if m else None)
    return [m for m in out if m is not None]


NUMBER = r'[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?'
SKIP = re.compile(r'^(Restarting data prefetching from start\.|Opened lmdb |'
                  r'output data size: |Creating layer )')
TIMING = re.compile(r'^Iteration \d+ \(\S+ iter/s, \S+s/\d+ iters\)')


def solver_part(messages):
    """From 'Solving ...' to the end, without lines that depend on threads."""
    start = messages.index('Solving LeNet')
    return [m for m in messages[start:] if not SKIP.match(m)]


def split_numbers(message):
    if TIMING.match(message):
        message = re.sub(r'\(\S+ iter/s, \S+s/', '(T iter/s, Ts/', message)
    nums = [float(x) for x in re.findall(NUMBER, message)]
    return re.sub(NUMBER, '#', message), nums


@pytest.mark.parametrize('run', RUNS)
def test_log_matches_caffe_line_by_line(runs, run):
    rc, cap, _ = runs[run]
    assert rc == 0
    ours = solver_part(cap.messages)
    theirs = solver_part(ref_messages(os.path.join(TRAINING, run, 'train.log')))
    # "Optimization Done." twice: the solver's and the tool's
    assert len(ours) == len(theirs), '\n'.join(ours)
    for a, b in zip(ours, theirs):
        ta, na = split_numbers(a)
        tb, nb = split_numbers(b)
        assert ta == tb, (a, b)
        if b.startswith('Iteration 0 ('):
            na, nb = na[2:], nb[2:]  # Caffe's first iter/s is uninitialised memory
        numpy.testing.assert_allclose(na, nb, rtol=2e-3, atol=1e-6, err_msg='%s vs %s' % (a, b))


@pytest.mark.parametrize('run', RUNS)
def test_losses_lrs_and_tests(runs, run):
    rc, cap, _ = runs[run]
    ref = numpy.load(os.path.join(TRAINING, run, 'loss.npz'))
    losses, lrs, tests = {}, {}, {}
    testing = None
    for m in cap.messages:
        g = re.match(r'^Iteration (\d+) \(.*\), loss = (\S+)$', m) or \
            re.match(r'^Iteration (\d+), loss = (\S+)$', m)
        if g:
            losses[int(g.group(1))] = float(g.group(2))
        g = re.match(r'^Iteration (\d+), lr = (\S+)$', m)
        if g:
            lrs[int(g.group(1))] = g.group(2)
        g = re.match(r'^Iteration (\d+), Testing net \(#0\)$', m)
        if g:
            testing = int(g.group(1))
        g = re.match(r'^    Test net output #\d+: (\w+) = (\S+)', m)
        if g:
            tests.setdefault(testing, {})[g.group(1)] = float(g.group(2))
    assert sorted(losses) == list(ref['loss_log_iter'])
    got = numpy.array([losses[i] for i in ref['loss_log_iter']])
    numpy.testing.assert_allclose(got, ref['loss_log'], rtol=2e-3, atol=1e-6)
    # the first iterations agree much more closely than the tolerance
    numpy.testing.assert_allclose(got[:10], ref['loss_log'][:10], rtol=1e-4)
    assert [float(lrs[i]) for i in ref['iter']] == pytest.approx(list(ref['lr']), rel=1e-6)
    assert sorted(tests) == list(ref['test_iter'])
    for i, it in enumerate(ref['test_iter']):
        assert abs(tests[it]['accuracy'] - ref['test_accuracy'][i]) <= 1 / 64 + 1e-9
        assert tests[it]['loss'] == pytest.approx(ref['test_loss'][i], rel=2e-3, abs=1e-6)


def _read(path, message):
    with open(path, 'rb') as f:
        message.ParseFromString(f.read())
    return message


@pytest.mark.parametrize('run', RUNS)
def test_final_weights_and_history(runs, run):
    rc, cap, root = runs[run]
    base = os.path.join(root, 'training', run, 'lenet_iter_30')
    ours = _read(base + '.caffemodel', caffe_pb2.NetParameter())
    theirs = _read(os.path.join(TRAINING, run, 'lenet_iter_30.caffemodel'),
                   caffe_pb2.NetParameter())
    assert [l.name for l in ours.layer] == [l.name for l in theirs.layer]
    atol = 5e-4 if run in ADAPTIVE else 1e-4
    compared = 0
    for a, b in zip(ours.layer, theirs.layer):
        assert len(a.blobs) == len(b.blobs)
        for x, y in zip(a.blobs, b.blobs):
            assert list(x.shape.dim) == list(y.shape.dim)
            numpy.testing.assert_allclose(numpy.array(x.data), numpy.array(y.data),
                                          rtol=5e-3, atol=atol, err_msg=a.name)
            compared += 1
    assert compared == 8
    s_ours = _read(base + '.solverstate', caffe_pb2.SolverState())
    s_theirs = _read(os.path.join(TRAINING, run, 'lenet_iter_30.solverstate'),
                     caffe_pb2.SolverState())
    assert s_ours.iter == s_theirs.iter == 30
    assert s_ours.current_step == s_theirs.current_step
    assert s_ours.learned_net == s_theirs.learned_net == 'training/%s/lenet_iter_30.caffemodel' \
        % run
    assert len(s_ours.history) == len(s_theirs.history)
    for i, (x, y) in enumerate(zip(s_ours.history, s_theirs.history)):
        assert list(x.shape.dim) == list(y.shape.dim)
        a, b = numpy.array(x.data), numpy.array(y.data)
        numpy.testing.assert_allclose(a, b, rtol=5e-3, atol=5e-3 * numpy.abs(b).max() + 1e-12,
                                      err_msg='history %d' % i)


# -- resuming ---------------------------------------------------------------------------
RESUME_SOLVER = '''
net: "training/lenet_train_test.prototxt"
test_iter: 1
test_interval: 5
display: 3
max_iter: 12
snapshot: 6
snapshot_prefix: "out/lenet"
solver_mode: CPU
random_seed: 1701
type: "%s"
base_lr: 0.01
momentum: 0.9
momentum2: 0.999
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
snapshot_format: %s
'''


@pytest.mark.parametrize('in_backward', [False, True])
@pytest.mark.parametrize('kind,fmt', [('SGD', 'BINARYPROTO'), ('Adam', 'HDF5')])
def test_resume_bit_identical(tmp_path, monkeypatch, kind, fmt, in_backward):
    """12 iterations straight == 6 (mid-epoch: 384 of 256 records), snapshot,
    resume, 6 more (CPU); also with every update in backward (the snapshot
    has no gradients to write)."""
    if in_backward:
        from caffeplus.memory import liveness
        monkeypatch.setattr(liveness, 'MIN_APPLIED_GRADIENT_BYTES', 0)
    root = copy_reference(str(tmp_path), runs=[])
    os.makedirs(os.path.join(root, 'out'))
    with open(os.path.join(root, 'solver.prototxt'), 'w') as f:
        f.write(RESUME_SOLVER % (kind, fmt))
    rc, _ = caffeplus_main(['train', '-solver', 'solver.prototxt',
                            '-weights', 'training/init.caffemodel'], root)
    assert rc == 0
    h5 = '.h5' if fmt == 'HDF5' else ''
    out = os.path.join(root, 'out')
    assert sorted(os.listdir(out)) == sorted(
        ['lenet_iter_%d.%s%s' % (i, ext, h5) for i in (6, 12)
         for ext in ('caffemodel', 'solverstate')] +
        ['lenet_iter_%d.solverstate%s.caffeplus.json' % (i, h5) for i in (6, 12)])
    straight = {name: open(os.path.join(out, name), 'rb').read()
                for name in ('lenet_iter_12.caffemodel' + h5, 'lenet_iter_12.solverstate' + h5)}
    for name in straight:
        os.remove(os.path.join(out, name))
    rc, cap = caffeplus_main(['train', '-solver', 'solver.prototxt',
                              '-snapshot', 'out/lenet_iter_6.solverstate' + h5], root)
    assert rc == 0
    assert any(m.startswith('Restored caffeplus RNG and layer state from') for m in cap.messages)
    if fmt == 'BINARYPROTO':
        for name, data in straight.items():
            assert open(os.path.join(out, name), 'rb').read() == data, name
    else:
        import h5py
        import io
        for name, data in straight.items():
            with h5py.File(io.BytesIO(data), 'r') as a, \
                    h5py.File(os.path.join(out, name), 'r') as b:
                items_a, items_b = [], []
                a.visititems(lambda n, o: items_a.append((n, o[()] if isinstance(
                    o, h5py.Dataset) else None)))
                b.visititems(lambda n, o: items_b.append((n, o[()] if isinstance(
                    o, h5py.Dataset) else None)))
                assert [n for n, _ in items_a] == [n for n, _ in items_b]
                for (n, x), (_, y) in zip(items_a, items_b):
                    if x is not None:
                        numpy.testing.assert_array_equal(x, y, err_msg=n)


def test_resume_from_stock_caffe_state_matches_caffe_log(tmp_path):
    """Resuming from Caffe's own iteration-30 state (no caffeplus sidecar):
    the data layer starts from the top, as in Caffe's train_resume_sgd.log."""
    root = copy_reference(str(tmp_path), runs=['sgd'], cli_dir=True)
    for ext in ('caffemodel', 'solverstate'):
        shutil.copy(os.path.join(TRAINING, 'sgd', 'lenet_iter_30.' + ext),
                    os.path.join(root, 'training', 'sgd'))
    rc, cap = caffeplus_main(['train', '-solver', 'cli/resume_sgd_solver.prototxt',
                              '-snapshot', 'training/sgd/lenet_iter_30.solverstate'], root)
    assert rc == 0
    ours = solver_part(cap.messages)
    theirs = solver_part(ref_messages(os.path.join(REFERENCE, 'cli', 'train_resume_sgd.log')))
    assert len(ours) == len(theirs), '\n'.join(ours)
    for a, b in zip(ours, theirs):
        ta, na = split_numbers(a)
        tb, nb = split_numbers(b)
        assert ta == tb, (a, b)
        if TIMING.match(b):
            na, nb = na[2:], nb[2:]
        numpy.testing.assert_allclose(na, nb, rtol=2e-3, atol=1e-6, err_msg='%s vs %s' % (a, b))
    assert 'Resuming from training/sgd/lenet_iter_30.solverstate' in cap.messages
    assert 'SGDSolver: restoring history' in cap.messages
