"""Interruptions lose nothing: signals, kill -9, resume, numerical faults.

  * SIGINT / SIGHUP during `caffeplus train` do what -sigint_effect /
    -sighup_effect say (snapshot, stop, none); the snapshot is complete and
    the process exits 0. SIGTERM never leaves a broken snapshot.
  * kill -9 at random moments while training and snapshotting (a snapshot
    every iteration) never leaves a truncated or mixed snapshot as the
    newest: every file parses, the newest .solverstate names an existing
    .caffemodel of its iteration, and training resumes from it
    (dev/kill_test.py runs many more trials).
  * Resuming is exact: N iterations straight and N/2 + resume + N/2 give
    bit-identical weights and solver history on the CPU, with Dropout masks,
    mirror/crop draws, the data cursor and ImageData shuffles all in play.
  * A NaN or Inf in the loss or a gradient stops training (or warns) naming
    the iteration and the first layer where it appeared
    (caffeplus.solver.nan_check).

The training runs use a small LeNet-like net over copies of the reference
LMDBs (dev/kill_test.py builds the folders).
"""
import filecmp
import os
import random
import re
import signal
import sys

import numpy
import pytest

from conftest import ROOT, need

sys.path.insert(0, ROOT)
from dev import kill_test as kt  # noqa: E402

from caffeplus.errors import CaffeplusError  # noqa: E402
from caffeplus.io.prototxt import parse_text  # noqa: E402
from caffeplus.proto import caffe_pb2  # noqa: E402

KILL_TRIALS = 10


@pytest.fixture(scope='module')
def reference_data():
    need(os.path.join(kt.TRAINING_DATA, 'mnist_synth_train_lmdb'))
    need(os.path.join(kt.IMAGES, 'list.txt'))


@pytest.fixture
def workdir(tmp_path, reference_data):
    return kt.make_workdir(str(tmp_path / 'run'))


def _snapshot_line(t, timeout=120):
    line = t.wait_for(r'Snapshotting solver state to .* (\S+_iter_(\d+)\.solverstate\S*)',
                      timeout)
    return int(re.search(r'_iter_(\d+)\.solverstate', line).group(1))


def _assert_snapshots_ok(workdir):
    problems = kt.check_snapshots(os.path.join(workdir, 'snap'),
                                  os.path.join(workdir, 'net.prototxt'), workdir)
    assert not problems, '\n'.join(problems)
    return kt.snapshot_files(os.path.join(workdir, 'snap'))


# -- signals ----------------------------------------------------------------------
SIGNAL_FLAGS = {signal.SIGINT: '-sigint_effect', signal.SIGHUP: '-sighup_effect'}
OTHER = {signal.SIGINT: signal.SIGHUP, signal.SIGHUP: signal.SIGINT}


@pytest.mark.parametrize('signum', [signal.SIGINT, signal.SIGHUP], ids=['SIGINT', 'SIGHUP'])
@pytest.mark.parametrize('effect', ['stop', 'snapshot', 'none'])
def test_signal_follows_its_effect_flag(workdir, signum, effect):
    max_iter = 1500 if effect == 'none' else 100000
    solver = kt.write_solver(workdir, max_iter=max_iter, snapshot=0)
    other = OTHER[signum]
    # The other signal stops the run where the one under test does not.
    t = kt.Train(workdir, '-solver', solver, SIGNAL_FLAGS[signum], effect,
                 SIGNAL_FLAGS[other], 'stop')
    try:
        t.wait_for(r'\] Iteration 30 \(')
        t.signal(signum)
        if effect == 'snapshot':
            k = _snapshot_line(t)
            t.wait_for(r'\] Iteration %d \(' % (k + 10))
            t.signal(other)
        if effect != 'none':
            t.wait_for(r'\] Optimization stopped early\.')
        rc = t.wait()
    finally:
        t.kill()
    assert rc == 0, t.tail()
    log_text = t.log()
    assert 'Traceback' not in log_text
    files = _assert_snapshots_ok(workdir)
    states = sorted(files['solverstate'])
    if effect == 'none':
        assert 'Optimization stopped early' not in log_text
        assert 'Optimization Done.' in log_text
        assert states == [max_iter], states     # only snapshot_after_train's
    elif effect == 'stop':
        assert len(states) == 1 and 30 <= states[0] < max_iter, states
    else:
        assert len(states) == 2 and states[0] == k and states[1] > k, (states, k)


def test_sigterm_never_leaves_a_broken_snapshot(workdir):
    solver = kt.write_solver(workdir, snapshot=1)
    t = kt.Train(workdir, '-solver', solver)
    try:
        _snapshot_line(t)
        t.wait_for(r'\] Iteration 40 \(')
        t.signal(signal.SIGTERM)
        rc = t.wait()
    finally:
        t.kill()
    assert rc == 0, t.tail()          # SIGTERM stops at the iteration's end
    files = _assert_snapshots_ok(workdir)
    assert files['solverstate']


def test_sigterm_stops_cleanly_with_a_final_snapshot(workdir):
    solver = kt.write_solver(workdir, snapshot=0)
    t = kt.Train(workdir, '-solver', solver)
    try:
        t.wait_for(r'\] Iteration 30 \(')
        t.signal(signal.SIGTERM)
        rc = t.wait()
    finally:
        t.kill()
    assert rc == 0, t.tail()
    assert 'Optimization stopped early' in t.log()
    files = _assert_snapshots_ok(workdir)
    assert len(files['solverstate']) == 1


# -- kill -9 -------------------------------------------------------------------------
@pytest.mark.parametrize('fmt', ['BINARYPROTO', 'HDF5'])
def test_kill_9_at_random_moments_leaves_usable_snapshots(tmp_path, reference_data, fmt):
    workdir = kt.make_workdir(str(tmp_path / fmt.lower()))
    rnd = random.Random(1701 if fmt == 'HDF5' else 17)
    for trial in range(KILL_TRIALS // 2):
        _, problems = kt.kill_trial(workdir, rnd, fmt, snapshot_every=1, max_delay=1.0)
        assert not problems, 'trial %d:\n%s' % (trial, '\n'.join(problems))
    problems = kt.resume_check(workdir, fmt, iterations=2)
    assert not problems, '\n'.join(problems)


# -- resume is exact ----------------------------------------------------------------------
@pytest.mark.parametrize('variant, fmt', [('data', 'BINARYPROTO'), ('images', 'BINARYPROTO'),
                                          ('data', 'HDF5')])
def test_resume_is_bit_identical_through_the_cli(tmp_path, reference_data, variant, fmt):
    """40 iterations straight == 20, then resume for 20 more: the same bytes
    in the iteration-40 weights and solver state. The net has Dropout, the
    train data is mirrored and cropped (and shuffled, for ImageData), and
    there are test passes every 10 iterations."""
    n = 40
    ext = '.h5' if fmt == 'HDF5' else ''
    straight = kt.make_workdir(str(tmp_path / 'straight'), variant)
    split = kt.make_workdir(str(tmp_path / 'split'), variant)
    common = dict(snapshot=n // 2, fmt=fmt, display=5, test_interval=10)
    kt.write_solver(straight, 'full.prototxt', max_iter=n, **common)
    kt.write_solver(split, 'full.prototxt', max_iter=n, **common)
    kt.write_solver(split, 'half.prototxt', max_iter=n // 2, **common)

    t = kt.Train(straight, '-solver', 'full.prototxt')
    assert t.wait(300) == 0, t.tail()
    t = kt.Train(split, '-solver', 'half.prototxt')
    assert t.wait(300) == 0, t.tail()
    t = kt.Train(split, '-solver', 'full.prototxt', '-snapshot',
                 'snap/small_iter_%d.solverstate%s' % (n // 2, ext))
    assert t.wait(300) == 0, t.tail()
    assert 'Restored caffeplus RNG and layer state' in t.log(), t.tail()

    for it in (n // 2, n):
        for kind in ('caffemodel', 'solverstate'):
            name = 'small_iter_%d.%s%s' % (it, kind, ext)
            a, b = os.path.join(straight, 'snap', name), os.path.join(split, 'snap', name)
            if fmt == 'HDF5':
                _assert_same_h5(a, b)
            else:
                assert filecmp.cmp(a, b, shallow=False), '%s differs after resuming' % name


def _assert_same_h5(a, b):
    h5py = pytest.importorskip('h5py')
    with h5py.File(a, 'r') as fa, h5py.File(b, 'r') as fb:
        names = []
        fa.visit(names.append)
        other = []
        fb.visit(other.append)
        assert names == other
        for name in names:
            if isinstance(fa[name], h5py.Dataset):
                numpy.testing.assert_array_equal(fa[name][()], fb[name][()], err_msg=name)


# -- NaN / Inf -------------------------------------------------------------------------------
NAN_NET = '''
layer { name: "d" type: "DummyData" top: "x" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 }
                     data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "ip0" type: "InnerProduct" bottom: "x" top: "h"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 1 } } }
%s
layer { name: "ip" type: "InnerProduct" bottom: "s" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''
# x -> relu -> sqrt: forward finite (sqrt 0 = 0), backward 0/0 = NaN at 'sqrt'.
GRADIENT_NAN = '''
layer { name: "relu" type: "ReLU" bottom: "h" top: "r" }
layer { name: "sqrt" type: "Power" bottom: "r" top: "s" power_param { power: 0.5 } }'''
# log of -(h^2) - 1 < 0: NaN in the forward pass at 'log'.
FORWARD_NAN = '''
layer { name: "sq" type: "Power" bottom: "h" top: "q" power_param { power: 2 } }
layer { name: "neg" type: "Power" bottom: "q" top: "n" power_param { scale: -1 shift: -1 } }
layer { name: "log" type: "Log" bottom: "n" top: "s" }'''


def _solver(body, base_lr=0.1, **fields):
    from caffeplus.solver import get_solver
    fields.setdefault('lr_policy', 'fixed')
    sp = caffe_pb2.SolverParameter(base_lr=base_lr, max_iter=50, random_seed=3, **fields)
    parse_text(NAN_NET % body, sp.net_param)
    return get_solver(sp)


def _weights(solver):
    return [numpy.array(p.data) for p in solver.net.learnable_params]


@pytest.mark.parametrize('in_backward', ['0', '1'])
def test_nan_in_a_gradient_stops_at_the_layer_that_made_it(monkeypatch, in_backward):
    """With the update in backward (caffeplus.solver.update_in_backward) ip,
    after the NaN in backward, was updated with its finite gradient before
    ip0's NaN was seen; ip0 was not."""
    from caffeplus.memory import liveness
    from caffeplus.solver import nan_check, update_in_backward
    monkeypatch.setenv(update_in_backward.ENV, in_backward)
    monkeypatch.setattr(liveness, 'MIN_APPLIED_GRADIENT_BYTES', 0)     # tiny ones leave too
    solver = _solver(GRADIENT_NAN)
    assert nan_check.install(solver) is not None
    before = _weights(solver)
    with numpy.errstate(all='ignore'), pytest.raises(nan_check.NumericalError) as info:
        solver.step(5)
    err = info.value
    assert isinstance(err, CaffeplusError)
    assert err.iteration == 0 and err.layer == 'sqrt', str(err)
    text = str(err)
    assert text.startswith('Iteration 0:') and "'sqrt' (Power)" in text and 'backward' in text
    assert 'ip0[0]' in text and 'NaN' in text
    after = _weights(solver)
    assert all(numpy.isfinite(w).all() for w in after)
    if in_backward == '1':
        assert solver.net.applied_plan.plan.param_diffs
        assert 'the layers after them were updated in backward' in text
        changed = [not numpy.array_equal(a, b) for a, b in zip(before, after)]
        assert changed == [False, False, True, True]        # ip0's weights, bias; ip's
        return
    # It stopped before the update: the weights are the finite ones of before.
    for a, b in zip(before, after):
        numpy.testing.assert_array_equal(a, b)


def test_nan_in_the_forward_pass_names_the_first_layer():
    from caffeplus.solver import nan_check
    solver = _solver(FORWARD_NAN)
    nan_check.install(solver, 'stop')
    with numpy.errstate(all='ignore'), pytest.raises(nan_check.NumericalError) as info:
        solver.step(3)
    assert info.value.layer == 'log', str(info.value)
    assert 'forward' in str(info.value) and 'the loss is not finite' in str(info.value)


def test_divergence_stops_at_the_iteration_it_happens():
    from caffeplus.solver import nan_check
    body = 'layer { name: "relu" type: "ReLU" bottom: "h" top: "s" }'
    solver = _solver(body, base_lr=1e30)
    nan_check.install(solver)
    with numpy.errstate(all='ignore'), pytest.raises(nan_check.NumericalError) as info:
        solver.step(40)
    err = info.value
    assert 0 < err.iteration < 40 and solver.iter == err.iteration, str(err)
    assert 'Iteration %d:' % err.iteration in str(err)
    for w in _weights(solver):
        assert numpy.isfinite(w).all()


def test_warn_mode_logs_and_trains_on(caplog_caffeplus):
    from caffeplus.solver import nan_check
    solver = _solver(GRADIENT_NAN)
    cb = nan_check.install(solver, 'warn')
    records = caplog_caffeplus
    with numpy.errstate(all='ignore'):
        solver.step(3)
    assert solver.iter == 3 and cb.problems == 3
    warned = [r for r in records if re.match(r'Iteration \d+: ', r)]
    assert len(warned) == 3 and 'Training goes on' in warned[0]
    assert "'sqrt'" in warned[0]     # later ones: the weights themselves went NaN


def test_warn_mode_diagnosis_leaves_training_as_it_was():
    """Locating the layer re-runs the iteration; parameters, gradients,
    layer state and the random stream come back as they were, so a warned
    run trains exactly as an unchecked one."""
    from caffeplus.solver import nan_check
    body = GRADIENT_NAN.replace('"relu" type: "ReLU" bottom: "h" top: "r" }',
                                '"relu" type: "ReLU" bottom: "h" top: "r0" }\n'
                                'layer { name: "drop" type: "Dropout" bottom: "r0" top: "r" }')
    from caffeplus import rng
    results, states = [], []
    for mode in ('off', 'warn'):
        solver = _solver(body)
        nan_check.install(solver, mode)
        with numpy.errstate(all='ignore'):
            solver.step(1)
        results.append(_weights(solver))
        states.append(rng.get_state())
    assert states[0] == states[1]
    assert numpy.isfinite(results[0][-1]).all()    # ip's weights: updated, finite
    for a, b in zip(*results):
        numpy.testing.assert_array_equal(a, b)


def test_mode_from_the_environment(monkeypatch):
    from caffeplus import config
    from caffeplus.solver import nan_check
    monkeypatch.setenv('CAFFEPLUS_NAN_CHECK', 'off')
    solver = _solver(GRADIENT_NAN)
    assert nan_check.install(solver) is None
    with numpy.errstate(all='ignore'):
        solver.step(2)           # trains on NaN, as stock Caffe
    monkeypatch.setenv('CAFFEPLUS_NAN_CHECK', 'sometimes')
    config.reload_environment()         # (read once a process otherwise)
    with pytest.raises(CaffeplusError, match="environment variable CAFFEPLUS_NAN_CHECK must "
                                             "be one of stop, warn, off, not 'sometimes'"):
        nan_check.install(_solver(GRADIENT_NAN))


def test_finite_training_is_untouched():
    from caffeplus.solver import nan_check
    body = 'layer { name: "relu" type: "ReLU" bottom: "h" top: "s" }'
    a = _solver(body)          # (the solvers share the global RNG: one at a time)
    a.step(5)
    b = _solver(body)
    cb = nan_check.install(b)
    b.step(5)
    assert cb.problems == 0
    for x, y in zip(_weights(a), _weights(b)):
        numpy.testing.assert_array_equal(x, y)


def test_cli_train_stops_on_nan(tmp_path):
    net = NAN_NET % GRADIENT_NAN
    (tmp_path / 'net.prototxt').write_text(net)
    (tmp_path / 'solver.prototxt').write_text(
        'net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed" max_iter: 50 display: 1 '
        'snapshot_prefix: "snap" random_seed: 3 solver_mode: CPU')
    t = kt.Train(str(tmp_path), '-solver', 'solver.prototxt')
    rc = t.wait(120)
    assert rc != 0
    assert 'Traceback' not in t.log()
    assert re.search(r"Iteration 0: .*'sqrt'", t.log()), t.tail()


def test_a_stopped_iteration_leaves_the_learning_rate_step_as_it_was():
    """The check's verdict is read after the update is queued (the update
    skips on its guard): the iteration count and a multistep policy's step
    go back to the stopped iteration's, as if it had stopped before the
    update."""
    from caffeplus.solver import nan_check
    body = 'layer { name: "relu" type: "ReLU" bottom: "h" top: "s" }'
    solver = _solver(body, lr_policy='multistep', stepvalue=[2], gamma=0.5)
    nan_check.install(solver, 'stop')
    solver.step(2)
    assert solver.iter == 2 and solver.current_step == 0
    before = _weights(solver)
    x = solver.net.layers[0]
    x.refill = [False] * len(x.refill)       # keep the poisoned input below
    solver.net.blobs['x'].data[...] = numpy.nan
    with numpy.errstate(all='ignore'), pytest.raises(nan_check.NumericalError) as info:
        solver.step(3)
    assert info.value.iteration == 2 and solver.iter == 2
    assert solver.current_step == 0          # iteration 2's update would have moved it to 1
    for a, b in zip(before, _weights(solver)):
        numpy.testing.assert_array_equal(a, b)


def test_emulated_bad_label_stops_before_the_update(emulated):
    """On the GPU the fused SoftmaxWithLoss reports a bad label when the loss
    is read, after the update is queued; the loss and its gradient are then
    NaN, so the guarded update skipped: the label error is raised, the
    weights are those of before and the iteration did not happen."""
    from caffeplus.errors import NetError
    solver = _solver('layer { name: "relu" type: "ReLU" bottom: "h" top: "s" }')
    loss_layer = solver.net.layers[solver.net.layer_index('loss')]
    assert type(loss_layer).__name__ == 'GPUSoftmaxWithLossLayer'
    solver.step(2)
    assert solver.iter == 2
    before = _weights(solver)
    solver.net.blobs['label'].data[1] = 7
    with pytest.raises(NetError, match='label value 7 is out of range'):
        solver.step(3)
    assert solver.iter == 2
    for a, b in zip(before, _weights(solver)):
        numpy.testing.assert_array_equal(a, b)
    solver.net.blobs['label'].data[1] = 1      # the flag was cleared: training goes on
    solver.step(1)
    assert solver.iter == 3


def test_emulated_loss_is_read_after_the_update_is_queued(emulated, monkeypatch):
    """With the check guarding the update, nothing reads the fused loss
    layer's report (a GPU synchronisation) until the update is queued; the
    losses and weights are those of a run that reads it first."""
    from caffeplus.solver import nan_check
    from caffeplus.layers import fused_loss
    body = 'layer { name: "relu" type: "ReLU" bottom: "h" top: "s" }'
    runs = []
    read = fused_loss._LossReport.read
    for mode in ('stop', 'off'):
        solver = _solver(body, average_loss=2)
        nan_check.install(solver, mode)
        events = []
        apply = solver.apply_update
        monkeypatch.setattr(solver, 'apply_update', lambda: (events.append('update'), apply()))
        monkeypatch.setattr(fused_loss._LossReport, 'read',
                            lambda self, events=events: (
                                self._host is None and events.append('read'), read(self))[1])
        smoothed = []
        for _ in range(4):
            solver.step(1)
            smoothed.append(float(solver.smoothed_loss))
        runs.append((events, smoothed, _weights(solver)))
    guarded, unguarded = runs
    assert guarded[0] == ['update', 'read'] * 4
    assert unguarded[0] == ['read', 'update'] * 4
    assert guarded[1] == unguarded[1]
    for a, b in zip(guarded[2], unguarded[2]):
        numpy.testing.assert_array_equal(a, b)
