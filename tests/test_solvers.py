"""Solvers against a float64 NumPy reimplementation of Caffe's rules.

The nets here use a test-only layer, SolverTestQuad: it owns two parameter
blobs (w of the shape in input_param, b of w's first axis) and outputs the
loss
    0.5*|w - t - x|^2 + 0.025*sum(w^4) + 0.5*|b - tb - 0.1*rowsum(x)|^2
for a bottom x from DummyData (Gaussian, fresh each forward), so gradients
change every pass and the solvers' histories matter. It records each x, so
the NumPy reference sees exactly the data caffeplus saw.
"""
import logging
import math
import os
import re
import zlib

import numpy
import pytest

import caffeplus
from caffeplus import backend, log
from caffeplus.blob import Blob
from caffeplus.errors import CaffeplusError
from caffeplus.io.prototxt import parse_text
from caffeplus.layer import Layer, layer_class, register
from caffeplus.proto import caffe_pb2
from caffeplus.solver import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver,
                              RMSPropSolver, SGDSolver, get_solver, lr_policy)


# -- the test layer ------------------------------------------------------------
class SolverTestQuad(Layer):
    type = 'SolverTestQuad'
    exact_num_bottom = 1
    exact_num_top = 1

    def setup(self, bottom, top):
        if len(self.layer_param.loss_weight) == 0:
            self.layer_param.loss_weight.append(1.0)
        super().setup(bottom, top)

    def layer_setup(self, bottom, top):
        shape = tuple(self.layer_param.input_param.shape[0].dim)
        rs = numpy.random.RandomState(zlib.crc32(self.name.encode()))
        if not self.blobs:
            w = Blob(shape, name=self.name + '.w')
            w.data = rs.uniform(-0.8, 0.8, size=shape)
            b = Blob((shape[0],), name=self.name + '.b')
            b.data = rs.uniform(-0.8, 0.8, size=shape[0])
            self.blobs = [w, b]
        else:
            rs.uniform(size=shape), rs.uniform(size=shape[0])
        self.t = rs.normal(0, 0.5, size=shape).astype(numpy.float32)
        self.tb = rs.normal(0, 0.5, size=shape[0]).astype(numpy.float32)
        self.seen = []

    def reshape(self, bottom, top):
        top[0].reshape(())

    def _forward(self, bottom, top):
        x = bottom[0].data
        xp = backend.get_array_module(x)
        self.seen.append(backend.to_numpy(x).copy())
        w, b = self.blobs[0].data, self.blobs[1].data
        t, tb = xp.asarray(self.t), xp.asarray(self.tb)
        rx = x.reshape(x.shape[0], -1).sum(axis=1)
        r = w - t - x
        rb = b - tb - numpy.float32(0.1) * rx
        top[0].data[...] = 0.5 * (r * r).sum() + 0.025 * (w ** 4).sum() + 0.5 * (rb * rb).sum()

    def _backward(self, top, propagate_down, bottom):
        x = bottom[0].data
        xp = backend.get_array_module(x)
        t, tb = xp.asarray(self.t), xp.asarray(self.tb)
        weight = top[0].diff.ravel()[0]
        w, b = self.blobs[0].data, self.blobs[1].data
        rx = x.reshape(x.shape[0], -1).sum(axis=1)
        if self.param_needs_backward(0):
            self.blobs[0].diff[...] += weight * ((w - t - x) + numpy.float32(0.1) * w ** 3)
        if self.param_needs_backward(1):
            self.blobs[1].diff[...] += weight * (b - tb - numpy.float32(0.1) * rx)


if layer_class('SolverTestQuad') is None:
    register(SolverTestQuad)


def quad_grads(w, b, t, tb, x):
    rx = x.reshape(x.shape[0], -1).sum(axis=1)
    return (w - t - x) + 0.1 * w ** 3, b - tb - 0.1 * rx


NET = '''
  name: "quad"
  layer { name: "data" type: "DummyData" top: "x1" top: "x2"
          dummy_data_param { shape { dim: 3 dim: 4 } shape { dim: 5 }
                             data_filler { type: "gaussian" std: 0.3 } } }
  layer { name: "q1" type: "SolverTestQuad" bottom: "x1" top: "l1"
          input_param { shape { dim: 3 dim: 4 } }
          param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 } }
  layer { name: "q2" type: "SolverTestQuad" bottom: "x2" top: "l2" loss_weight: 0.5
          input_param { shape { dim: 5 } } param { lr_mult: 0.5 decay_mult: 3 } }
'''


def solver_param(extra, net=NET):
    text = 'net_param {%s}\nrandom_seed: 5\n%s' % (net, extra)
    return parse_text(text, caffe_pb2.SolverParameter())


class LogLines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def logs():
    h = LogLines()
    log.logger.addHandler(h)
    yield h.lines
    log.logger.removeHandler(h)


# -- the NumPy reference ---------------------------------------------------------
def ref_lr(p, it):
    base = float(numpy.float32(p.base_lr))
    gamma, power = float(numpy.float32(p.gamma)), float(numpy.float32(p.power))
    policy = p.lr_policy
    if policy == 'fixed':
        return base
    if policy == 'step':
        return base * gamma ** (it // p.stepsize)
    if policy == 'exp':
        return base * gamma ** it
    if policy == 'inv':
        return base * (1 + gamma * it) ** (-power)
    if policy == 'multistep':
        return base * gamma ** sum(1 for s in p.stepvalue if it >= s)
    if policy == 'poly':
        return base * (1 - it / p.max_iter) ** power
    if policy == 'sigmoid':
        return base / (1 + math.exp(-gamma * (it - p.stepsize)))
    raise AssertionError(policy)


def reference_run(p, init, layers, iters):
    """init: float64 [w1, b1, w2, b2]; layers: (t, tb, seen xs, loss weight)
    per SolverTestQuad layer. Returns the params and the history after
    `iters` updates."""
    f = lambda v: float(numpy.float32(v))  # noqa: E731
    params = [a.astype(numpy.float64).copy() for a in init]
    lr_mult = [1.0, 2.0, 0.5, 1.0]
    decay_mult = [1.0, 0.0, 3.0, 1.0]
    n = len(params)
    hist = [numpy.zeros_like(a) for a in params]
    hist2 = [numpy.zeros_like(a) for a in params]
    kind = p.type
    for it in range(iters):
        grads = [numpy.zeros_like(a) for a in params]
        for j in range(p.iter_size):
            for k, (t, tb, seen, lw) in enumerate(layers):
                gw, gb = quad_grads(params[2 * k], params[2 * k + 1], t, tb,
                                    seen[it * p.iter_size + j].astype(numpy.float64))
                grads[2 * k] += lw * gw
                grads[2 * k + 1] += lw * gb
        rate = ref_lr(p, it)
        if p.clip_gradients >= 0:
            norm = math.sqrt(sum((g * g).sum() for g in grads))
            if norm > f(p.clip_gradients):
                grads = [g * (f(p.clip_gradients) / norm) for g in grads]
        for i in range(n):
            g = grads[i] / p.iter_size
            decay = f(p.weight_decay) * decay_mult[i]
            if p.regularization_type == 'L1':
                g = g + decay * numpy.sign(params[i])
            else:
                g = g + decay * params[i]
            lr = rate * lr_mult[i]
            m, delta = f(p.momentum), f(p.delta)
            if kind == 'SGD':
                hist[i] = m * hist[i] + lr * g
                step = hist[i]
            elif kind == 'Nesterov':
                old = hist[i]
                hist[i] = m * hist[i] + lr * g
                step = (1 + m) * hist[i] - m * old
            elif kind == 'AdaGrad':
                hist[i] = hist[i] + g * g
                step = lr * g / (numpy.sqrt(hist[i]) + delta)
            elif kind == 'RMSProp':
                d = f(p.rms_decay)
                hist[i] = d * hist[i] + (1 - d) * g * g
                step = lr * g / (numpy.sqrt(hist[i]) + delta)
            elif kind == 'AdaDelta':
                hist[i] = m * hist[i] + (1 - m) * g * g
                u = g * numpy.sqrt((hist2[i] + delta) / (hist[i] + delta))
                hist2[i] = m * hist2[i] + (1 - m) * u * u
                step = lr * u
            elif kind == 'Adam':
                b1, b2, t = f(p.momentum), f(p.momentum2), it + 1
                hist[i] = b1 * hist[i] + (1 - b1) * g
                hist2[i] = b2 * hist2[i] + (1 - b2) * g * g
                corr = math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                step = lr * corr * hist[i] / (numpy.sqrt(hist2[i]) + delta)
            else:
                raise AssertionError(kind)
            params[i] = params[i] - step
    history = hist + (hist2 if kind in ('AdaDelta', 'Adam') else [])
    return params, history


def run_and_compare(extra, iters=12, rtol=2e-4, atol=2e-6):
    solver = get_solver(solver_param(extra))
    net = solver.net
    init = [backend.to_numpy(p.data).astype(numpy.float64) for p in net.learnable_params]
    solver.step(iters)
    q1, q2 = net.layer_dict['q1'], net.layer_dict['q2']
    layers = [(q1.t.astype(numpy.float64), q1.tb.astype(numpy.float64), q1.seen, 1.0),
              (q2.t.astype(numpy.float64), q2.tb.astype(numpy.float64), q2.seen, 0.5)]
    assert len(q1.seen) == iters * solver.param.iter_size
    want, want_hist = reference_run(solver.param, init, layers, iters)
    got = [backend.to_numpy(p.data) for p in net.learnable_params]
    for i, (g, w) in enumerate(zip(got, want)):
        numpy.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg='param %d' % i)
    got_hist = [backend.to_numpy(h) for h in solver.history_arrays()]
    assert len(got_hist) == len(want_hist)
    for i, (g, w) in enumerate(zip(got_hist, want_hist)):
        numpy.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg='history %d' % i)
    # the params moved: the test is not vacuous
    assert max(abs(g - i).max() for g, i in zip(got, init)) > 1e-3
    return solver


SOLVER_CASES = {
    'sgd': 'type: "SGD" base_lr: 0.05 momentum: 0.9 lr_policy: "fixed"',
    'sgd_l2_inv': 'type: "SGD" base_lr: 0.05 momentum: 0.8 weight_decay: 0.01 '
                  'lr_policy: "inv" gamma: 0.1 power: 0.75',
    'sgd_l1_step': 'type: "SGD" base_lr: 0.05 momentum: 0.5 weight_decay: 0.02 '
                   'regularization_type: "L1" lr_policy: "step" gamma: 0.5 stepsize: 4',
    'sgd_iter_size': 'type: "SGD" base_lr: 0.05 momentum: 0.9 iter_size: 3 lr_policy: "fixed"',
    'sgd_clip': 'type: "SGD" base_lr: 0.05 momentum: 0.9 clip_gradients: 0.5 '
                'lr_policy: "fixed"',
    'sgd_clip_iter_size': 'type: "SGD" base_lr: 0.05 momentum: 0.9 clip_gradients: 0.8 '
                          'iter_size: 2 lr_policy: "fixed"',
    'nesterov': 'type: "Nesterov" base_lr: 0.05 momentum: 0.9 weight_decay: 0.005 '
                'lr_policy: "multistep" gamma: 0.3 stepvalue: 3 stepvalue: 7',
    'adagrad': 'type: "AdaGrad" base_lr: 0.1 weight_decay: 0.005 lr_policy: "fixed" delta: 1e-6',
    'rmsprop': 'type: "RMSProp" base_lr: 0.02 rms_decay: 0.95 weight_decay: 0.005 '
               'lr_policy: "exp" gamma: 0.97',
    'adadelta': 'type: "AdaDelta" base_lr: 1.0 momentum: 0.95 delta: 1e-6 weight_decay: 0.005 '
                'lr_policy: "fixed"',
    'adam': 'type: "Adam" base_lr: 0.05 momentum: 0.9 momentum2: 0.999 weight_decay: 0.005 '
            'lr_policy: "poly" power: 1.5 max_iter: 20',
    'adam_sigmoid': 'type: "Adam" base_lr: 0.05 momentum: 0.8 momentum2: 0.99 delta: 1e-4 '
                    'lr_policy: "sigmoid" gamma: -0.0 stepsize: 5',
    'adam_l1_iter_size': 'type: "Adam" base_lr: 0.02 momentum: 0.9 momentum2: 0.999 '
                         'weight_decay: 0.01 regularization_type: "L1" iter_size: 2 '
                         'lr_policy: "fixed"',
}


@pytest.mark.parametrize('case', sorted(SOLVER_CASES))
def test_update_rule_matches_numpy_reference(case):
    run_and_compare(SOLVER_CASES[case])


@pytest.mark.gpu
@pytest.mark.parametrize('fused', [True, False], ids=['fused', 'generic'])
@pytest.mark.parametrize('case', sorted(SOLVER_CASES))
def test_update_rule_on_gpu(case, fused, monkeypatch):
    from caffeplus.solver import sgd
    monkeypatch.setattr(sgd.SGDSolver, 'use_fused_kernels', fused)
    caffeplus.set_mode_gpu(0)
    try:
        solver = run_and_compare(SOLVER_CASES[case])
        assert type(solver.history_arrays()[0]).__module__.startswith('cupy')
    finally:
        caffeplus.set_mode_cpu()


@pytest.mark.gpu
def test_gpu_snapshot_and_resume(tmp_path):
    caffeplus.set_mode_gpu(0)
    try:
        test_resume_is_bit_identical(tmp_path, 'Adam', 'BINARYPROTO')
    finally:
        caffeplus.set_mode_cpu()


def test_solver_classes_and_factory():
    for cls, name in ((SGDSolver, 'SGD'), (NesterovSolver, 'Nesterov'),
                      (AdaGradSolver, 'AdaGrad'), (RMSPropSolver, 'RMSProp'),
                      (AdaDeltaSolver, 'AdaDelta'), (AdamSolver, 'Adam')):
        s = get_solver(solver_param('type: "%s" base_lr: 0.1 lr_policy: "fixed"' % name))
        assert type(s) is cls and s.type == name
        s2 = cls(solver_param('base_lr: 0.1 lr_policy: "fixed"'))
        assert s2.type == name
        per = 2 if name in ('AdaDelta', 'Adam') else 1
        assert len(s.history_arrays()) == per * len(s.net.learnable_params)


def test_legacy_solver_type_enum():
    s = get_solver(solver_param('solver_type: ADAM base_lr: 0.01 lr_policy: "fixed"'))
    assert type(s) is AdamSolver


def test_solver_from_file(tmp_path, logs):
    path = tmp_path / 's.prototxt'
    path.write_text('net_param {%s}\nbase_lr: 0.1 lr_policy: "fixed" snapshot: 5' % NET)
    s = get_solver(str(path))
    # Caffe's default snapshot_prefix: the solver file without its extension
    assert s.param.snapshot_prefix == str(tmp_path / 's')
    assert 'snapshot_prefix was not specified and is set to %s' % (tmp_path / 's') in logs
    s2 = SGDSolver(str(path))
    assert s2.param.base_lr == pytest.approx(0.1)


# -- learning-rate policies --------------------------------------------------------
LR_CASES = {
    'fixed': 'base_lr: 0.01 lr_policy: "fixed"',
    'step': 'base_lr: 0.01 lr_policy: "step" gamma: 0.1 stepsize: 100',
    'exp': 'base_lr: 0.01 lr_policy: "exp" gamma: 0.99',
    'inv': 'base_lr: 0.01 lr_policy: "inv" gamma: 0.0001 power: 0.75',
    'multistep': 'base_lr: 0.01 lr_policy: "multistep" gamma: 0.5 stepvalue: 50 '
                 'stepvalue: 120 stepvalue: 121 stepvalue: 300',
    'poly': 'base_lr: 0.01 lr_policy: "poly" power: 2 max_iter: 400',
    'sigmoid': 'base_lr: 0.01 lr_policy: "sigmoid" gamma: -0.05 stepsize: 200',
}


@pytest.mark.parametrize('policy', sorted(LR_CASES))
def test_lr_policy_formula(policy):
    p = parse_text(LR_CASES[policy], caffe_pb2.SolverParameter())
    current_step = 0
    for it in range(400):
        rate, current_step = lr_policy.learning_rate(p, it, current_step)
        assert isinstance(rate, numpy.float32)
        assert float(rate) == pytest.approx(ref_lr(p, it), rel=2e-6), (policy, it)


def test_lr_inv_matches_reference_log():
    """The rates logged by stock Caffe in training/sgd/train.log."""
    p = parse_text('base_lr: 0.01 lr_policy: "inv" gamma: 0.0001 power: 0.75',
                   caffe_pb2.SolverParameter())
    logged = {0: '0.01', 1: '0.00999925', 2: '0.0099985', 9: '0.00999326',
              29: '0.0099783'}
    for it, text in logged.items():
        assert '%g' % lr_policy.learning_rate(p, it, 0)[0] == text


def test_multistep_logs_and_current_step(logs):
    s = get_solver(solver_param('type: "SGD" base_lr: 0.1 lr_policy: "multistep" gamma: 0.5 '
                                'stepvalue: 2 stepvalue: 4 display: 1'))
    s.step(5)
    assert 'MultiStep Status: Iteration 2, step = 1' in logs
    assert 'MultiStep Status: Iteration 4, step = 2' in logs
    assert s.current_step == 2
    assert 'Iteration 4, lr = 0.025' in logs


def test_bad_lr_policy_and_regularization():
    with pytest.raises(CaffeplusError, match='Unknown learning rate policy'):
        get_solver(solver_param('base_lr: 0.1 lr_policy: "cosine"'))
    with pytest.raises(CaffeplusError, match='Unknown learning rate policy'):
        get_solver(solver_param('base_lr: 0.1'))
    with pytest.raises(CaffeplusError, match='stepsize'):
        get_solver(solver_param('base_lr: 0.1 lr_policy: "step" gamma: 0.1'))
    with pytest.raises(CaffeplusError, match='regularization type'):
        get_solver(solver_param('base_lr: 0.1 lr_policy: "fixed" regularization_type: "L3"'))


def test_momentum_refused_by_adagrad_and_rmsprop():
    with pytest.raises(CaffeplusError, match='Momentum cannot be used with AdaGrad'):
        get_solver(solver_param('type: "AdaGrad" base_lr: 0.1 lr_policy: "fixed" momentum: 0.9'))
    with pytest.raises(CaffeplusError, match='Momentum cannot be used with RMSProp'):
        get_solver(solver_param('type: "RMSProp" base_lr: 0.1 lr_policy: "fixed" momentum: 0.9'))
    with pytest.raises(CaffeplusError, match='rms_decay'):
        get_solver(solver_param('type: "RMSProp" base_lr: 0.1 lr_policy: "fixed" rms_decay: 1'))


def test_unknown_solver_type():
    with pytest.raises(CaffeplusError, match='Unknown solver type: Adamax'):
        get_solver(solver_param('type: "Adamax" base_lr: 0.1 lr_policy: "fixed"'))


def test_missing_net_file_is_named(tmp_path):
    p = parse_text('net: "no/such/net.prototxt" base_lr: 0.1 lr_policy: "fixed"',
                   caffe_pb2.SolverParameter())
    with pytest.raises(CaffeplusError, match='no/such/net.prototxt'):
        get_solver(p)
    with pytest.raises(CaffeplusError, match='must specify a train net'):
        get_solver(parse_text('base_lr: 0.1 lr_policy: "fixed"', caffe_pb2.SolverParameter()))


def test_snapshot_prefix_must_be_writable(tmp_path):
    with pytest.raises(CaffeplusError, match='Cannot write to snapshot prefix'):
        get_solver(solver_param('base_lr: 0.1 lr_policy: "fixed" snapshot: 2 '
                                'snapshot_prefix: "%s/missing_dir/x"' % tmp_path))


# -- gradient clipping, smoothed loss, display -------------------------------------
def test_clip_gradients_logs_and_scales(logs):
    s = get_solver(solver_param('type: "SGD" base_lr: 0.05 lr_policy: "fixed" '
                                'clip_gradients: 0.1'))
    s.step(1)
    lines = [l for l in logs if l.startswith('Gradient clipping')]
    assert len(lines) == 1
    m = re.match(r'Gradient clipping: scaling down gradients \(L2 norm (\S+) > 0.1\) by scale '
                 r'factor (\S+)$', lines[0])
    assert m and float(m.group(2)) == pytest.approx(0.1 / float(m.group(1)), rel=1e-5)
    # the update's size is lr * clip
    total = math.sqrt(sum(float((numpy.asarray(p.diff, numpy.float64) ** 2).sum())
                          for p in s.net.learnable_params))
    lr_mults = s.net.params_lr
    assert total > 0 and len(lr_mults) == 4


def test_no_clip_below_threshold(logs):
    s = get_solver(solver_param('type: "SGD" base_lr: 0.05 lr_policy: "fixed" '
                                'clip_gradients: 1000'))
    s.step(2)
    assert not [l for l in logs if l.startswith('Gradient clipping')]


def _train_losses(logs):
    return [float(m.group(2)) for m in
            (re.match(r'Iteration (\d+) \(.* iter/s, .*s/\d+ iters\), loss = (\S+)$', l)
             for l in logs) if m]


def test_average_loss_smoothing(logs):
    s = get_solver(solver_param('type: "SGD" base_lr: 0.05 momentum: 0.9 lr_policy: "fixed" '
                                'display: 1 average_loss: 3'))
    raw = []
    orig = s.net.forward_prefilled

    def spy(*args, **kwargs):
        loss = orig(*args, **kwargs)
        raw.append(float(loss))
        return loss
    s.net.forward_prefilled = spy
    s.step(8)
    shown = _train_losses(logs)
    assert len(shown) == 8
    for k in range(8):
        window = raw[max(0, k - 2):k + 1]
        assert shown[k] == pytest.approx(sum(window) / len(window), rel=2e-5)


def test_display_lines_match_caffe_format(logs):
    s = get_solver(solver_param('type: "SGD" base_lr: 0.05 lr_policy: "fixed" display: 2'))
    s.step(5)
    it_lines = [l for l in logs if re.match(r'Iteration \d+ \(', l)]
    assert [int(l.split()[1]) for l in it_lines] == [0, 2, 4]
    for l in it_lines:
        assert re.match(r'^Iteration \d+ \([-+.e\d]+ iter/s, [.e\d]+s/2 iters\), loss = '
                        r'[-+.e\d]+$', l), l
    outs = [l for l in logs if 'Train net output' in l]
    assert len(outs) == 6
    assert re.match(r'^    Train net output #0: l1 = \S+ \(\* 1 = \S+ loss\)$', outs[0])
    assert re.match(r'^    Train net output #1: l2 = \S+ \(\* 0.5 = \S+ loss\)$', outs[1])
    assert [l for l in logs if re.match(r'^Iteration \d+, lr = 0.05$', l)] == \
        ['Iteration 0, lr = 0.05', 'Iteration 2, lr = 0.05', 'Iteration 4, lr = 0.05']


def test_solve_tail_and_done(logs):
    s = get_solver(solver_param('type: "SGD" base_lr: 0.05 lr_policy: "fixed" display: 2 '
                                'max_iter: 4 snapshot_after_train: false'))
    s.solve()
    assert logs[logs.index('Solving quad'):][:2] == ['Solving quad',
                                                       'Learning Rate Policy: fixed']
    assert re.match(r'^Iteration 4, loss = \S+$', logs[-2])
    assert logs[-1] == 'Optimization Done.'
    assert s.iter == 4


# -- shared parameters, lr_mult 0 ---------------------------------------------------
def test_shared_params_and_frozen_layer():
    net = '''
      name: "shared"
      layer { name: "data" type: "DummyData" top: "x1" top: "x2"
              dummy_data_param { shape { dim: 2 dim: 3 } data_filler { type: "gaussian" std: 1 } } }
      layer { name: "a" type: "SolverTestQuad" bottom: "x1" top: "la"
              input_param { shape { dim: 2 dim: 3 } } param { name: "w" } param { name: "bb" } }
      layer { name: "b" type: "SolverTestQuad" bottom: "x2" top: "lb"
              input_param { shape { dim: 2 dim: 3 } } param { name: "w" } param { lr_mult: 0 } }
    '''
    s = get_solver(solver_param('type: "SGD" base_lr: 0.1 lr_policy: "fixed"', net))
    n = s.net
    assert len(n.learnable_params) == 3
    assert len(s.history_arrays()) == 3
    frozen = numpy.array(n.layer_dict['b'].blobs[1].data)
    s.step(3)
    numpy.testing.assert_array_equal(n.layer_dict['a'].blobs[0].data,
                                     n.layer_dict['b'].blobs[0].data)
    numpy.testing.assert_array_equal(n.layer_dict['b'].blobs[1].data, frozen)


# -- test nets -------------------------------------------------------------------------
TEST_NET = '''
  name: "staged"
  layer { name: "data" type: "DummyData" top: "x1"
          dummy_data_param { shape { dim: 3 dim: 4 } data_filler { type: "gaussian" std: 0.3 } } }
  layer { name: "q1" type: "SolverTestQuad" bottom: "x1" top: "l1"
          input_param { shape { dim: 3 dim: 4 } } }
  layer { name: "extra" type: "DummyData" top: "e" include { phase: TEST stage: "more" }
          dummy_data_param { shape { dim: 2 } data_filler { type: "constant" value: 7 } } }
'''


def test_several_test_nets_with_states(logs):
    p = solver_param('type: "SGD" base_lr: 0.05 lr_policy: "fixed" test_iter: 2 test_iter: 3 '
                     'test_interval: 2 test_state { stage: "more" } test_state { } display: 0',
                     TEST_NET)
    s = get_solver(p)
    assert len(s.test_nets) == 2
    assert s.test_nets[0].phase == caffeplus.TEST
    assert 'e' in s.test_nets[0].outputs and 'e' not in s.test_nets[1].outputs
    assert 'Creating test net (#0) specified by net_param' in logs
    s.step(3)
    tests = [l for l in logs if 'Testing net' in l]
    assert tests == ['Iteration 0, Testing net (#0)', 'Iteration 0, Testing net (#1)',
                     'Iteration 2, Testing net (#0)', 'Iteration 2, Testing net (#1)']
    outs = [l for l in logs if 'Test net output' in l]
    # outputs in Caffe's order, sorted by name: e (two values) before l1
    assert outs[:2] == ['    Test net output #0: e = 7', '    Test net output #1: e = 7']
    assert outs[2].startswith('    Test net output #2: l1 = ')
    assert any(re.match(r'^    Test net output #0: l1 = \S+ \(\* 1 = \S+ loss\)$', l) for l in outs)
    # the test nets see the train net's weights
    numpy.testing.assert_array_equal(s.test_nets[1].layer_dict['q1'].blobs[0].data,
                                     s.net.layer_dict['q1'].blobs[0].data)


def test_test_initialization_false_and_compute_loss(logs):
    p = solver_param('type: "SGD" base_lr: 0.05 lr_policy: "fixed" test_iter: 2 '
                     'test_interval: 2 test_initialization: false test_compute_loss: true',
                     TEST_NET)
    s = get_solver(p)
    s.step(3)
    assert [l for l in logs if 'Testing net' in l] == ['Iteration 2, Testing net (#0)']
    assert [l for l in logs if l.startswith('Test loss: ')]


def test_test_iter_count_must_match():
    p = parse_text('train_net_param {%s} test_net_param {%s} base_lr: 0.1 lr_policy: "fixed" '
                   'test_interval: 1' % (NET, NET), caffe_pb2.SolverParameter())
    with pytest.raises(CaffeplusError, match='test_iter must be specified'):
        get_solver(p)


# -- callbacks and actions -----------------------------------------------------------
def test_callbacks_and_stop_action(logs):
    s = get_solver(solver_param('type: "SGD" base_lr: 0.05 lr_policy: "fixed" max_iter: 10 '
                                'snapshot_after_train: false'))
    events = []
    s.add_callback(lambda: events.append('start'), lambda: events.append('ready'))

    class CB:
        def on_start(self):
            events.append('start2')

        def on_gradients_ready(self):
            events.append('ready2')
    s.add_callback(CB())
    s.set_action_function(lambda: 'stop' if s.iter >= 3 else 'none')
    s.solve()
    assert s.iter == 3
    assert events[:4] == ['start', 'start2', 'ready', 'ready2'] and len(events) == 12
    assert logs[-1] == 'Optimization stopped early.'


def test_snapshot_action(tmp_path, logs):
    s = get_solver(solver_param('type: "SGD" base_lr: 0.05 lr_policy: "fixed" '
                                'snapshot_prefix: "%s/q"' % tmp_path))
    s.set_action_function(lambda: 'snapshot' if s.iter == 2 else 'none')
    s.step(4)
    assert sorted(os.listdir(tmp_path)) == ['q_iter_2.caffemodel', 'q_iter_2.solverstate',
                                            'q_iter_2.solverstate.caffeplus.json']


# -- snapshots and restore ---------------------------------------------------------
def _params(solver):
    return [backend.to_numpy(p.data).copy() for p in solver.net.learnable_params]


@pytest.mark.parametrize('kind', ['SGD', 'Nesterov', 'AdaGrad', 'RMSProp', 'AdaDelta', 'Adam'])
@pytest.mark.parametrize('fmt', ['BINARYPROTO', 'HDF5'])
def test_resume_is_bit_identical(tmp_path, kind, fmt):
    extra = ('type: "%s" base_lr: 0.05 lr_policy: "multistep" stepvalue: 3 stepvalue: 12 '
             'gamma: 0.5 weight_decay: 0.001 snapshot_format: %s max_iter: 20 '
             'snapshot_prefix: "%s/q" test_iter: 1 test_interval: 5 net_param {%s}'
             % (kind, fmt, tmp_path, TEST_NET))
    if kind in ('SGD', 'Nesterov'):
        extra += ' momentum: 0.9'
    if kind in ('AdaDelta', 'Adam'):
        extra += ' momentum: 0.9'
    text = 'random_seed: 11\n' + extra
    straight = get_solver(parse_text(text, caffe_pb2.SolverParameter()))
    straight.step(20)
    want = _params(straight)
    want_hist = [backend.to_numpy(h).copy() for h in straight.history_arrays()]

    first = get_solver(parse_text(text, caffe_pb2.SolverParameter()))
    first.step(10)
    model, state = first.snapshot()
    ext = '.h5' if fmt == 'HDF5' else ''
    assert model == '%s/q_iter_10.caffemodel%s' % (tmp_path, ext)
    assert state == '%s/q_iter_10.solverstate%s' % (tmp_path, ext)
    # the RNG moves on after the snapshot: the resumed run must not see that
    first.step(3)

    caffeplus.set_random_seed(999)
    resumed = get_solver(parse_text(text.replace('random_seed: 11', 'random_seed: 12'),
                                    caffe_pb2.SolverParameter()))
    resumed.solve(state)
    assert resumed.iter == 20
    for g, w in zip(_params(resumed), want):
        numpy.testing.assert_array_equal(g, w)
    for g, w in zip(resumed.history_arrays(), want_hist):
        numpy.testing.assert_array_equal(backend.to_numpy(g), w)


def test_solverstate_layout_binaryproto(tmp_path):
    s = get_solver(solver_param('type: "Adam" base_lr: 0.05 lr_policy: "multistep" '
                                'stepvalue: 1 gamma: 0.5 snapshot: 3 '
                                'snapshot_prefix: "%s/adam"' % tmp_path))
    s.step(3)
    state = caffe_pb2.SolverState()
    with open(tmp_path / 'adam_iter_3.solverstate', 'rb') as f:
        state.ParseFromString(f.read())
    assert state.iter == 3 and state.current_step == 1
    assert state.learned_net == '%s/adam_iter_3.caffemodel' % tmp_path
    assert len(state.history) == 8
    for proto, arr in zip(state.history, s.history_arrays()):
        assert tuple(proto.shape.dim) == arr.shape
        numpy.testing.assert_array_equal(numpy.array(proto.data, numpy.float32), arr.ravel())
    weights = caffe_pb2.NetParameter()
    with open(state.learned_net, 'rb') as f:
        weights.ParseFromString(f.read())
    assert [l.name for l in weights.layer] == ['data', 'q1', 'q2']
    numpy.testing.assert_array_equal(numpy.array(weights.layer[1].blobs[0].data),
                                     s.net.layer_dict['q1'].blobs[0].data.ravel())
    assert not weights.layer[1].blobs[0].diff


def test_solverstate_layout_hdf5_as_caffe(tmp_path):
    h5py = pytest.importorskip('h5py')
    s = get_solver(solver_param('type: "SGD" momentum: 0.9 base_lr: 0.05 lr_policy: "fixed" '
                                'snapshot: 2 snapshot_format: HDF5 snapshot_diff: true '
                                'snapshot_prefix: "%s/sgd"' % tmp_path))
    s.step(2)
    with h5py.File(tmp_path / 'sgd_iter_2.solverstate.h5', 'r') as f:
        assert f['iter'].shape == (1,) and f['iter'].dtype == numpy.int32 and f['iter'][0] == 2
        assert f['current_step'].shape == (1,) and f['current_step'][0] == 0
        ln = f['learned_net']
        assert ln.shape == () and ln.id.get_type().get_strpad() == h5py.h5t.STR_NULLTERM
        assert ln[()] == ('%s/sgd_iter_2.caffemodel.h5' % tmp_path).encode()
        assert sorted(f['history']) == ['0', '1', '2', '3']
        numpy.testing.assert_array_equal(f['history/0'][...], s.history_arrays()[0])
    with h5py.File(tmp_path / 'sgd_iter_2.caffemodel.h5', 'r') as f:
        assert sorted(f) == ['data', 'diff']
        numpy.testing.assert_array_equal(f['data/q1/0'][...], s.net.layer_dict['q1'].blobs[0].data)


def test_restore_reads_stock_caffe_hdf5_and_binary_states():
    """Caffe's own lenet_iter_2 states parse (history count and shapes)."""
    from caffeplus.solver import state as state_io
    from conftest import REFERENCE
    ref = os.path.join(REFERENCE, 'io')
    if not os.path.exists(ref):
        pytest.fail('test data missing')
    a = state_io.read_state(os.path.join(ref, 'lenet_iter_2.solverstate'))
    b = state_io.read_state(os.path.join(ref, 'lenet_iter_2.solverstate.h5'))
    assert a.iter == b.iter == 2 and a.current_step == b.current_step == 0
    assert a.learned_net == 'io/lenet_iter_2.caffemodel'
    assert b.learned_net == 'io/lenet_iter_2.caffemodel.h5'
    assert [h.shape for h in a.history] == [h.shape for h in b.history]
    assert [h.shape for h in a.history][4] == (500, 800)
    for x, y in zip(a.history, b.history):
        numpy.testing.assert_array_equal(x, y)


def test_restore_errors(tmp_path):
    p = 'type: "SGD" momentum: 0.9 base_lr: 0.05 lr_policy: "fixed" snapshot_prefix: "%s/s"' \
        % tmp_path
    s = get_solver(solver_param(p))
    s.step(2)
    model, state = s.snapshot()
    with pytest.raises(CaffeplusError, match='not found'):
        get_solver(solver_param(p)).restore(str(tmp_path / 'nope.solverstate'))
    # the weights file moved away: clear error naming it
    os.rename(model, model + '.moved')
    with pytest.raises(CaffeplusError, match=re.escape(model)):
        get_solver(solver_param(p)).restore(state)
    # a different weights file under the right name: the sidecar notices
    os.rename(model + '.moved', model)
    other = get_solver(solver_param(p))
    other.step(1)
    other.net.save(model)
    with pytest.raises(CaffeplusError, match='not the one written with it'):
        get_solver(solver_param(p)).restore(state)
    # without the sidecar it resumes as stock Caffe would
    os.remove(state + '.caffeplus.json')
    r = get_solver(solver_param(p))
    r.restore(state)
    assert r.iter == 2
    # a solver of another type: history length differs
    adam = get_solver(solver_param(p.replace('"SGD"', '"Adam"')))
    with pytest.raises(CaffeplusError, match='Incorrect length of history blobs'):
        adam.restore(state)


@pytest.mark.parametrize('fmt', ['BINARYPROTO', 'HDF5'])
def test_snapshot_writes_the_state_file_last(tmp_path, monkeypatch, logs, fmt):
    """The sidecar is written before the state file (a kill between them
    leaves no state without its sidecar); it matches the state written after."""
    if fmt == 'HDF5':
        pytest.importorskip('h5py')
    from caffeplus.solver import state as state_io
    p = ('type: "SGD" momentum: 0.9 base_lr: 0.05 lr_policy: "fixed" snapshot_prefix: "%s/s" '
         'snapshot_format: %s' % (tmp_path, fmt))
    s = get_solver(solver_param(p))
    s.step(2)
    order = []
    write_sidecar = state_io.write_sidecar

    def spy(state_file, payload, state_sha256=None):
        order.append(('sidecar', os.path.exists(state_file)))
        return write_sidecar(state_file, payload, state_sha256)
    monkeypatch.setattr(state_io, 'write_sidecar', spy)
    model, state = s.snapshot()
    assert order == [('sidecar', False)]
    assert state_io.read_sidecar(state)[0]['iter'] == 2
    r = get_solver(solver_param(p))
    r.restore(state)
    assert 'Restored caffeplus RNG and layer state from %s.caffeplus.json' % state in logs


def test_resume_warns_when_a_caffeplus_state_has_no_sidecar(tmp_path, logs):
    p = 'type: "SGD" momentum: 0.9 base_lr: 0.05 lr_policy: "fixed" snapshot_prefix: "%s/s"' \
        % tmp_path
    s = get_solver(solver_param(p))
    s.step(1)
    s.snapshot()
    s.step(1)
    _, state = s.snapshot()
    os.remove(state + '.caffeplus.json')
    get_solver(solver_param(p)).restore(state)
    warned = [m for m in logs if 'has no caffeplus sidecar' in m]
    assert warned and state in warned[0] and 's_iter_1.solverstate.caffeplus.json' in warned[0]
    assert 'not continue exactly' in warned[0]


def test_stale_snapshot_temp_files_are_removed_at_start(tmp_path, logs):
    """A run killed while snapshotting leaves caffeplus.io.atomic's temporary
    files; the next run of that prefix removes them, and nothing else."""
    stale = ['.s_iter_20.caffemodel.ab_3x9qz.tmp', '.s_iter_20.solverstate.h5.0a1b2c3d.tmp',
             '.s_iter_7.solverstate.caffeplus.json.zzzzzzzz.tmp',
             '.s_iter_7.solverstate.ranks.json.k2k2k2k2.tmp']
    kept = ['.other_iter_20.caffemodel.ab_3x9qz.tmp', '.s_iter_20.caffemodel.tmp',
            's_iter_20.caffemodel', '.s_iter_x.caffemodel.abcdefgh.tmp', 'notes.tmp',
            '.s_iter_20.caffemodel.ab_3x9qz.tmp.bak']
    for name in stale + kept:
        (tmp_path / name).write_bytes(b'x')
    p = ('type: "SGD" momentum: 0.9 base_lr: 0.05 lr_policy: "fixed" snapshot: 5 '
         'snapshot_prefix: "%s/s"' % tmp_path)
    get_solver(solver_param(p))
    assert sorted(os.listdir(tmp_path)) == sorted(kept)
    assert sum('left by an interrupted snapshot' in m for m in logs) == len(stale)


def test_learned_net_found_beside_state(tmp_path, monkeypatch):
    sub = tmp_path / 'run'
    sub.mkdir()
    monkeypatch.chdir(sub)
    p = 'type: "SGD" momentum: 0.9 base_lr: 0.05 lr_policy: "fixed" snapshot_prefix: "s"'
    s = get_solver(solver_param(p))
    s.step(2)
    s.snapshot()
    want = _params(s)
    monkeypatch.chdir(tmp_path)
    r = get_solver(solver_param(p))
    r.restore('run/s_iter_2.solverstate')
    for g, w in zip(_params(r), want):
        numpy.testing.assert_array_equal(g, w)


def test_interrupted_snapshot_keeps_previous_file(tmp_path, monkeypatch):
    p = 'type: "SGD" momentum: 0.9 base_lr: 0.05 lr_policy: "fixed" snapshot_prefix: "%s/s"' \
        % tmp_path
    s = get_solver(solver_param(p))
    s.step(2)
    model, state = s.snapshot()
    before = open(state, 'rb').read()
    s.iter = 2  # snapshot again at the same iteration, failing mid-write
    from caffeplus.solver import state as state_io

    def boom(*args, **kwargs):
        raise OSError('disk full')
    monkeypatch.setattr(state_io.caffe_pb2.SolverState, 'SerializeToString', boom)
    with pytest.raises(CaffeplusError, match='disk full'):
        s.snapshot()
    assert open(state, 'rb').read() == before
    assert sorted(os.listdir(tmp_path)) == sorted(['s_iter_2.caffemodel', 's_iter_2.solverstate',
                                                   's_iter_2.solverstate.caffeplus.json'])


def test_train_net_and_test_net_files(tmp_path, logs, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'train.prototxt').write_text(NET)
    (tmp_path / 'test.prototxt').write_text(TEST_NET)
    p = parse_text('train_net: "train.prototxt" test_net: "test.prototxt" test_net_param {%s} '
                   'test_iter: 1 test_iter: 2 test_interval: 3 base_lr: 0.1 lr_policy: "fixed"'
                   % NET, caffe_pb2.SolverParameter())
    s = get_solver(p)
    assert 'Creating training net from train_net file: train.prototxt' in logs
    # test_net_param first, then the files (Caffe's order)
    assert 'Creating test net (#0) specified by test_net_param' in logs
    assert 'Creating test net (#1) specified by test_net file: test.prototxt' in logs
    assert [n.name for n in s.test_nets] == ['quad', 'staged']
    s.step(1)
    assert 'Iteration 0, Testing net (#1)' in logs
    p2 = parse_text('train_net_param {%s} base_lr: 0.1 lr_policy: "fixed"' % NET,
                    caffe_pb2.SolverParameter())
    assert get_solver(p2).test_nets == []
    assert 'Creating training net specified in train_net_param.' in logs
    p3 = parse_text('net: "train.prototxt" train_net: "train.prototxt" base_lr: 0.1 '
                    'lr_policy: "fixed"', caffe_pb2.SolverParameter())
    with pytest.raises(CaffeplusError, match='more than one'):
        get_solver(p3)
    p4 = parse_text('train_net: "train.prototxt" test_net: "missing_test.prototxt" test_iter: 1 '
                    'test_interval: 1 base_lr: 0.1 lr_policy: "fixed"',
                    caffe_pb2.SolverParameter())
    with pytest.raises(CaffeplusError, match='missing_test.prototxt'):
        get_solver(p4)


def test_debug_info_logs_forward_backward(logs):
    s = get_solver(solver_param('type: "SGD" base_lr: 0.05 lr_policy: "fixed" display: 2 '
                                'debug_info: true'))
    s.step(2)
    fwd = [l for l in logs if l.startswith('    [Forward] ')]
    bwd = [l for l in logs if l.startswith('    [Backward] ')]
    # only on display iterations (0), as Caffe
    assert fwd and bwd
    assert len([l for l in logs if l.startswith('    [Backward] All net params')]) == 1


@pytest.mark.parametrize('policy', ['poly', 'step', 'fixed'])
def test_nvcaffe_min_lr_is_a_floor_under_the_rate(policy):
    from caffeplus.solver.lr_policy import check_policy, learning_rate
    p = parse_text('base_lr: 0.02 lr_policy: "%s" power: 2 max_iter: 100 gamma: 0.1 '
                   'stepsize: 10 min_lr: 0.000005' % policy, caffe_pb2.SolverParameter())
    check_policy(p)
    for it in (0, 10, 50, 95, 99, 100):
        plain = caffe_pb2.SolverParameter()
        plain.CopyFrom(p)
        plain.ClearField('min_lr')
        want = max(float(learning_rate(plain, it, 0, announce=False)[0]),
                   float(numpy.float32(0.000005)))
        assert float(learning_rate(p, it, 0, announce=False)[0]) == want
    if policy == 'poly':            # the rate its schedule ends at
        assert float(learning_rate(p, 100, 0, announce=False)[0]) == float(numpy.float32(5e-6))
    p.min_lr = -1
    with pytest.raises(CaffeplusError, match='min_lr'):
        check_policy(p)

