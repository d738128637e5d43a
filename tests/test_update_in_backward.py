"""Each parameter's update right after its backward (caffeplus.solver.update_in_backward):
the gradients live in the plan's arena only between their first backward write
and that update, and training stays bit-identical to Caffe's order."""
import logging
import os
import sys

import numpy
import pytest

from caffeplus import config
from caffeplus import log
from caffeplus.errors import CaffeplusError
from caffeplus.memory import budget, liveness, shapes
from caffeplus.solver import update_in_backward
from caffeplus.solver.nan_check import NumericalError
from plan_helpers import param_of
from conftest import ROOT, SHARED

sys.path.insert(0, ROOT)
from dev import check_plans_equal as cpe  # noqa: E402

# Two convolutions sharing their weights (conv_b owns nothing), a frozen one
# (lr_mult 0: no gradient written), inner products; the loss at the end.
NET = '''
name: "tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 dim: 10 dim: 10 } shape { dim: 4 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "frozen" type: "Convolution" bottom: "data" top: "frozen"
  param { lr_mult: 0 decay_mult: 0 } param { lr_mult: 0 decay_mult: 0 }
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "conv_a" type: "Convolution" bottom: "frozen" top: "a"
  param { name: "shared_w" } param { name: "shared_b" }
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu_a" type: "ReLU" bottom: "a" top: "a" }
layer { name: "conv_b" type: "Convolution" bottom: "a" top: "b"
  param { name: "shared_w" } param { name: "shared_b" }
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "pool" type: "Pooling" bottom: "b" top: "pool"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool" top: "ip1"
  inner_product_param { num_output: 16 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
'''


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv(update_in_backward.ENV, raising=False)
    # The tiny net's gradients are all small: every one leaves here.
    monkeypatch.setattr(liveness, 'MIN_APPLIED_GRADIENT_BYTES', 0)
    monkeypatch.delenv('CAFFEPLUS_NAN_CHECK', raising=False)
    level = log.logger.level
    log.logger.setLevel(logging.WARNING)
    yield
    log.logger.setLevel(level)


def train(plan, iters=5, hook=None):
    return _train_with(param_of(NET), plan, iters, 'SGD', hook, {})


def _adapt(sp, solver_type, fields):
    """SolverParameter `sp` made a `solver_type` one (AdaGrad and RMSProp
    take no momentum, AdaDelta a rate of 1), with `fields` set."""
    sp.type = solver_type
    if solver_type in ('AdaGrad', 'RMSProp'):
        sp.momentum = 0.0
    if solver_type == 'AdaDelta':
        sp.base_lr = 1.0
    for k, v in fields.items():
        setattr(sp, k, v)
    return sp


def _train_with(param, plan, iters, solver_type, hook, fields, **train_kw):
    """cpe.train with other solver fields (type, iter_size, clip_gradients...)."""
    original = cpe.solver_param
    cpe.solver_param = lambda *args, **kw: _adapt(original(*args, **kw), solver_type, fields)
    try:
        return cpe.train(param, plan, iters, solver_hook=hook, **train_kw)
    finally:
        cpe.solver_param = original


def in_backward(result):
    applied = result.solver.net.applied_plan
    plan = getattr(applied, 'plan', None)
    return bool(getattr(plan, 'param_diffs', False))


# -- which plans, which solvers -------------------------------------------------------
def test_the_gradients_live_from_their_first_backward_write_to_the_update():
    net = shapes.build_net(param_of(NET))
    L = len(net.layers)
    spans = liveness.param_diff_spans(net)
    names = net._layer_names
    bwd = {n: 2 * L - 1 - names.index(n) for n in names}
    by_owner = {}
    for pid, (layer_id, index) in enumerate(net.param_layer_indices):
        if net.param_owners[pid] == -1:
            by_owner[(names[layer_id], index)] = net.learnable_param_ids[pid]
    # The shared weights: written first by conv_b's backward, complete after conv_a's.
    assert spans[by_owner[('conv_a', 0)]] == (bwd['conv_b'], bwd['conv_a'])
    assert spans[by_owner[('ip2', 0)]] == (bwd['ip2'], bwd['ip2'])
    # frozen does no backward (nothing below it needs a gradient): left out.
    assert by_owner[('frozen', 0)] not in spans


@pytest.mark.parametrize('plan, placed', [('stock', False), ('arena', False), ('shared', True),
                                          ('offload', True), ('auto', True)])
def test_the_reusing_plans_update_in_backward(plan, placed):
    result = train(plan, iters=1)
    assert in_backward(result) == placed


def test_the_environment_turns_it_off(monkeypatch):
    config.set('update_in_backward', '0')
    assert not in_backward(train('shared', iters=1))


@pytest.mark.parametrize('fields', [{'iter_size': 2}, {'clip_gradients': 1.0},
                                    {'snapshot_diff': True}])
def test_settings_that_need_every_gradient_keep_them_whole(fields):
    result = _train_with(param_of(NET), 'shared', 3, 'SGD', None, fields)
    assert not in_backward(result)
    stock = _train_with(param_of(NET), 'stock', 3, 'SGD', None, fields)
    assert not cpe.differences(stock, result)


# -- the same numbers ----------------------------------------------------------------
@pytest.mark.parametrize('solver_type', ['SGD', 'Nesterov', 'AdaGrad', 'RMSProp', 'AdaDelta',
                                         'Adam'])
def test_training_is_bit_identical_to_stock(solver_type):
    stock = _train_with(param_of(NET), 'stock', 6, solver_type, None, {})
    result = _train_with(param_of(NET), 'shared', 6, solver_type, None, {})
    assert in_backward(result)
    assert not cpe.differences(stock, result), cpe.differences(stock, result)


def test_auto_training_is_bit_identical_to_stock():
    stock = _train_with(param_of(NET), 'stock', 6, 'SGD', None, {})
    result = _train_with(param_of(NET), 'auto', 6, 'SGD', None, {})
    assert in_backward(result)
    assert not cpe.differences(stock, result), cpe.differences(stock, result)


def test_lenet_and_cifar10_bn_are_bit_identical_to_stock(tmp_path):
    for name in ('lenet', 'cifar10_bn'):
        try:
            param, tests = cpe.net_param(name, str(tmp_path))
        except FileNotFoundError:
            pytest.fail('test data missing')
        stock = cpe.train(param, 'stock', 8, tests)
        shared = cpe.train(param, 'shared', 8, tests)
        assert in_backward(shared)
        assert not cpe.differences(stock, shared), (name, cpe.differences(stock, shared))


@pytest.mark.parametrize('plan', ['shared', 'auto'])
def test_a_callback_added_later_places_the_gradients_again(monkeypatch, plan):
    """A data-parallel sync (here: any callback) reads every gradient before
    the update: the next iteration keeps them whole, with the same numbers
    (`auto` plans again without them)."""
    seen = []

    class Reader:
        def on_start(self):
            pass

        def on_gradients_ready(self):
            seen.append(float(numpy.abs(self.solver.net.learnable_params[-1].diff).sum()))

    def hook(solver):
        reader = Reader()
        reader.solver = solver
        solver.step(1)                      # in backward
        assert solver.net.applied_plan.plan.param_diffs
        solver.add_callback(reader)
    said = []
    monkeypatch.setattr(update_in_backward.log, 'info', lambda fmt, *a: said.append(fmt % a))
    result = _train_with(param_of(NET), plan, 3, 'SGD', hook, {})
    assert not in_backward(result)
    kept = [m for m in said if 'gradients kept whole' in m]
    assert kept == ['Memory plan: parameter gradients kept whole: a solver callback (Reader) '
                    'reads the gradients before the update']
    assert len(seen) == 3 and all(v > 0 for v in seen)
    # Four iterations in all (one in the hook), as stock's four.
    stock = _train_with(param_of(NET), 'stock', 4, 'SGD', None, {})
    assert numpy.array_equal(stock.weights[-1], result.weights[-1])


# -- the memory -----------------------------------------------------------------------
def test_a_gradient_read_after_the_iteration_is_a_clear_error():
    result = train('shared', iters=2)
    net = result.solver.net
    with pytest.raises(CaffeplusError, match=r"blob ip1.0: its diff was released.*applied by "
                                             r"the solver's update in backward \(after layer "
                                             r"ip1\).*CAFFEPLUS_UPDATE_IN_BACKWARD=0"):
        net.params['ip1'][0].diff
    # What no backward writes keeps its memory: the frozen layer's (zeros).
    frozen = net.layers[net._layer_names.index('frozen')]
    assert not numpy.any(frozen.blobs[0].diff)


def test_vgg16_peaks_lower_by_the_fc_gradients(monkeypatch):
    """At the end of backward, where VGG-16 b64's `shared` peaked, fc6-8's
    472 MiB of gradients are gone (the peak moves to conv3_2's backward: 334
    MiB less)."""
    path = os.path.join(SHARED, 'bench', 'vgg16_b64.prototxt')
    if not os.path.exists(path):
        pytest.fail('test data missing')
    net = shapes.build_net(shapes.load_net_param(path))
    placed = budget.estimate_plan(net, 'shared')
    config.set('update_in_backward', '0')
    whole = budget.estimate_plan(net, 'shared')
    assert placed.param_diffs and not whole.param_diffs
    assert whole.peak_bytes - placed.peak_bytes > 300 * 2 ** 20
    assert placed.breakdown['parameter_diffs'] < whole.breakdown['parameter_diffs'] / 10


def test_auto_fits_budgets_that_need_the_fc_gradients_gone(monkeypatch):
    """AlexNet b128: with fc6-8's gradients placed (about 220 MiB that
    `shared` and `offload` no longer hold at the convolutions' peaks), auto
    fits 1.5 GiB; holding them whole, its smallest plan is above that and
    the error names the smallest budget that fits (1.58 GiB; 1.6x before
    InnerProduct's cuBLAS workspace moved into the arena, 1.7x before norm1's
    and norm2's gradients overlaid and the placement's search)."""
    path = os.path.join(SHARED, 'bench', 'alexnet_b128.prototxt')
    if not os.path.exists(path):
        pytest.fail('test data missing')
    net = shapes.build_net(shapes.load_net_param(path))
    limit = budget.parse_bytes('1.5G')
    plan = budget.estimate_plan(net, 'auto', budget=limit)
    assert plan.param_diffs and plan.peak_bytes <= limit
    assert plan.breakdown['parameter_diffs'] < 64 * 2 ** 20
    config.set('update_in_backward', '0')
    with pytest.raises(CaffeplusError, match=r'smallest budget that fits is 1\.[5-9]\dG'):
        budget.estimate_plan(net, 'auto', budget=limit)


# -- the NaN check ---------------------------------------------------------------------
def _poison(layer_name):
    """A solver hook: layer `layer_name`'s backward leaves NaN in its weight gradient."""
    def hook(solver):
        net = solver.net
        i = net._layer_names.index(layer_name)
        layer = net.layers[i]
        backward = layer.backward

        def poisoned(top, propagate_down, bottom):
            backward(top, propagate_down, bottom)
            if solver.iter == 2:
                layer.blobs[0].diff[0] = numpy.nan
        layer.backward = poisoned
    return hook


def test_a_nan_gradient_stops_before_any_weight_turns_nan():
    with pytest.raises(NumericalError) as err:
        _train_with(param_of(NET), 'shared', 4, 'SGD', _poison('ip1'), {})
    assert 'ip1[0]' in str(err.value)


def test_after_a_nan_gradient_no_later_update_runs():
    """ip2 is updated before ip1's gradient is seen (it comes first in
    backward); ip1 and the convolutions keep their weights: all finite."""
    runs = {}

    def hook(solver):
        _poison('ip1')(solver)
        runs['solver'] = solver
    with pytest.raises(NumericalError):
        _train_with(param_of(NET), 'shared', 4, 'SGD', hook, {})
    net = runs['solver'].net
    for layer in net.layers:
        for b in layer.blobs:
            assert numpy.isfinite(b.data).all(), layer.name


def test_warn_mode_keeps_the_gradients_whole(monkeypatch):
    """'warn' looks for the NaN's origin before the update, as without."""
    config.set('nan_check', 'warn')
    assert not in_backward(train('shared', iters=1))


# -- on the GPU ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize('solver_type, plan', [('SGD', 'shared'), ('Adam', 'shared'),
                                               ('SGD', 'auto')])
def test_gpu_training_is_bit_identical_to_arena(solver_type, plan):
    """The fused update kernel over one layer's parameters at a time, the
    gradients zeroed by memset in the arena: the same bits as `arena`
    (deterministic math, the same algorithms)."""
    def run(plan):
        return _train_with(param_of(NET), plan, 6, solver_type, None, {}, gpu=0,
                           math='deterministic')
    arena, shared = run('arena'), run(plan)
    assert in_backward(shared) and not in_backward(arena)
    assert not cpe.differences(arena, shared), cpe.differences(arena, shared)


@pytest.mark.gpu
def test_gpu_a_nan_gradient_stops_every_later_update():
    """The kernel's guard: no update once a gradient sum is not finite."""
    import caffeplus
    runs = {}

    def hook(solver):
        _poison('ip1')(solver)
        runs['solver'] = solver
    try:
        with pytest.raises(NumericalError) as err:
            cpe.train(param_of(NET), 'shared', 4, gpu=0, solver_hook=hook)
        assert 'ip1[0]' in str(err.value)
        net = runs['solver'].net
        for layer in net.layers:
            for b in layer.blobs:
                assert numpy.isfinite(b.data).all(), layer.name
    finally:
        caffeplus.set_mode_cpu()


def _poison_loss(solver):
    """A solver hook: the loss turns NaN at iteration 2 (after its forward)."""
    net = solver.net
    layer = net.layers[net._layer_names.index('loss')]
    forward = layer.forward

    def poisoned(bottom, top):
        out = forward(bottom, top)
        if solver.iter == 2:
            top[0].data[...] = numpy.nan
        return out
    layer.forward = poisoned


@pytest.mark.gpu
@pytest.mark.parametrize('plan', ['arena', 'shared'])
def test_gpu_a_finite_iteration_is_checked_in_one_kernel(plan, monkeypatch):
    """On the GPU the NaN check of a finite iteration is one kernel over the
    loss and every gradient and one read of its guard (the full check, a
    reduction per array, never runs); a NaN in a gradient or in the loss
    still stops training with the full check's message, weights finite."""
    import caffeplus
    from caffeplus.solver import nan_check
    full = []
    real = nan_check.check_net
    monkeypatch.setattr(nan_check, 'check_net', lambda *a, **k: full.append(1) or real(*a, **k))
    try:
        cpe.train(param_of(NET), plan, 3, gpu=0)
        assert full == []
        for hook, says in ((_poison('ip1'), 'ip1[0]'), (_poison_loss, 'the loss is not finite')):
            runs = {}

            def keep(solver, hook=hook):
                hook(solver)
                runs['solver'] = solver
            with pytest.raises(NumericalError) as err:
                cpe.train(param_of(NET), plan, 4, gpu=0, solver_hook=keep)
            assert says in str(err.value)
            for layer in runs['solver'].net.layers:
                for b in layer.blobs:
                    assert numpy.isfinite(b.data).all(), layer.name
        assert full
    finally:
        caffeplus.set_mode_cpu()


def test_emulated_fused_check_sees_a_value_in_any_array(solver_kernels):
    """MultiTensorCheck (the NaN check's one kernel) over arrays of several
    sizes: finite leaves the guard at 0; an Inf or a NaN anywhere, the last
    value of the last array included, sets it; the tables follow an array
    that moved."""
    from caffeplus.solver.gpu_kernels import MultiTensorCheck
    check = MultiTensorCheck(solver_kernels.kernel('caffeplus_gradient_check'))
    rs = numpy.random.RandomState(3)
    arrays = [rs.randn(n).astype(numpy.float32) for n in (1, 700, 33, 4096)]

    def run(arrs):
        guard = numpy.zeros(1, dtype=numpy.float64)
        flag = numpy.zeros(1, dtype=numpy.int32)
        check.run(arrs, guard, flag)
        return numpy.isfinite(guard[0]), int(flag[0])
    assert run(arrays) == (True, 0)
    for k, where in ((0, 0), (1, 350), (3, 4095)):
        bad = [a.copy() for a in arrays]
        bad[k][where] = numpy.nan if k % 2 else numpy.inf
        assert run(bad) == (False, 1), (k, where)
    assert run(arrays) == (True, 0)


def test_emulated_unscale_divides_every_gradient_and_flags_overflow(solver_kernels):
    """MultiTensorUnscale (loss scaling's one kernel): every value of every
    array divided by the scale exactly as NumPy's float32 division; an Inf or
    NaN anywhere, or a division that overflows, sets the guard to +inf (not
    the NaN check's NaN) and, with zero_bad, is stored as 0, the other values
    divided all the same."""
    from caffeplus.solver.gpu_kernels import MultiTensorUnscale
    unscale = MultiTensorUnscale(solver_kernels.kernel('caffeplus_gradient_unscale'))
    rs = numpy.random.RandomState(4)
    arrays = [(1e4 * rs.randn(n)).astype(numpy.float32) for n in (1, 700, 33, 4096)]

    def run(arrs, scale, zero_bad=True):
        out = [a.copy() for a in arrs]
        guard = numpy.zeros(1, dtype=numpy.float64)
        unscale.run(out, scale, guard, zero_bad)
        return out, guard[0]
    out, guard = run(arrays, 1000.0)
    assert guard == 0
    for got, a in zip(out, arrays):
        numpy.testing.assert_array_equal(got, a / numpy.float32(1000.0))
    bad = [a.copy() for a in arrays]
    bad[3][4095] = numpy.inf
    bad[0][0] = numpy.nan
    out, guard = run(bad, 2.0 ** 15)
    assert guard == numpy.inf
    assert out[3][4095] == 0 and out[0][0] == 0
    numpy.testing.assert_array_equal(out[1], arrays[1] / numpy.float32(2.0 ** 15))
    out, guard = run(bad, 2.0 ** 15, zero_bad=False)
    assert guard == numpy.inf and out[3][4095] == numpy.inf and numpy.isnan(out[0][0])
    big = [numpy.full(8, 3e38, dtype=numpy.float32)]
    assert run(big, 0.5)[1] == numpy.inf            # 6e38 is past float32's range


def test_a_filter_call_workspace_never_shares_the_gradient_it_writes():
    """The filter-gradient call's workspace lives half a step before its
    layer's step (liveness.FILTER_FIRST) and that call writes the weight
    gradient: the gradient's life starts there too, so the placement never
    gives the two the same bytes (on the GPU that corrupted GoogLeNet)."""
    from caffeplus.memory.plan import make_plan
    net = shapes.build_net(param_of(NET))
    convs = [i for i, layer in enumerate(net.layers) if layer.layer_param.type == 'Convolution']
    big = 1 << 16
    plan = make_plan(net, 'shared', workspace={i: (big, big, big) for i in convs},
                     param_diffs=True)
    spans = {b.key: b for b in plan.buffers}
    grads = [b for b in plan.buffers if b.kind == 'param_diff']
    calls = [b for b in plan.buffers if b.kind == 'workspace' and b.key[2] == 'backward_filter']
    assert grads and calls
    for g in grads:
        for w in calls:
            if g.start <= w.end and w.start <= g.end:      # live together
                lo = max(plan.offsets[g.key], plan.offsets[w.key])
                hi = min(plan.offsets[g.key] + g.nbytes, plan.offsets[w.key] + w.nbytes)
                assert lo >= hi, (g.key, w.key, spans[g.key], spans[w.key])
    # conv_a's weights (shared with conv_b) are live at conv_b's filter call.
    L = len(net.layers)
    conv_b = net._layer_names.index('conv_b')
    assert any(g.start == 2 * L - 1 - conv_b - 0.5 for g in grads)


def test_only_large_gradients_leave(monkeypatch):
    """Every gradient of at least 12 MiB leaves (AlexNet's fc layers, fc8's
    15.6 MiB too), and the largest others down to 1 MiB up to 8 in all
    (each layer updated in backward costs kernel launches): AlexNet's
    conv2-5 (conv1's 0.13 MiB stays), ResNet-50's 8 largest of its many
    (res5's and fc1000, 4-9 MiB), VGG-16's fc layers and 5 of its 9 MiB
    convolutions."""
    monkeypatch.undo()
    for name, expected in (('alexnet_b128', {'fc6', 'fc7', 'fc8', 'conv2', 'conv3', 'conv4',
                                             'conv5'}),
                           ('resnet50_b64', {'fc1000', 'res5a_branch1', 'res5a_branch2b',
                                             'res5a_branch2c', 'res5b_branch2a', 'res5b_branch2b',
                                             'res5b_branch2c', 'res5c_branch2b'}),
                           ('vgg16_b64', {'fc6', 'fc7', 'fc8-5', 'conv4_2', 'conv4_3', 'conv5_1',
                                          'conv5_2', 'conv5_3'})):
        path = os.path.join(SHARED, 'bench', name + '.prototxt')
        if not os.path.exists(path):
            pytest.fail('test data missing')
        net = shapes.build_net(shapes.load_net_param(path))
        spans = liveness.param_diff_spans(net)
        owners = {net.learnable_param_ids[pid]: net._layer_names[layer_id]
                  for pid, (layer_id, _) in enumerate(net.param_layer_indices)
                  if net.param_owners[pid] == -1}
        assert {owners[k] for k in spans} == expected, name


@pytest.mark.gpu
def test_gpu_a_relayout_frees_the_old_arena():
    """The solver's update tables hold addresses, not the arrays: once the
    plan is placed again (here: the gradients kept whole), the old arena,
    whose views the placed gradients were, is freed."""
    import gc
    import cupy
    import caffeplus
    seen = {}

    def hook(solver):
        solver.step(2)                      # in backward: the tables point into the arena
        applied = solver.net.applied_plan
        assert applied.plan.param_diffs
        pool = cupy.get_default_memory_pool()
        gc.collect()
        before, arena = pool.used_bytes(), applied.arena_base().nbytes
        # As keep_param_diffs, but never in the old arena's bytes: a new one.
        applied.options.setdefault('plan_overrides', {})['param_diffs'] = False
        applied.relayout(replan=True, reuse=False)
        gc.collect()
        seen['grew'] = pool.used_bytes() - before
        seen['arena'] = arena
    try:
        cpe.train(param_of(NET), 'shared', 2, gpu=0, solver_hook=hook)
    finally:
        caffeplus.set_mode_cpu()
    # One arena at a time (the gradients kept whole are the net's own arrays).
    assert seen['grew'] < seen['arena'] // 2, seen


# -- the GPU solver kernels, emulated on the host (dev/kernel_emu.py) ---------------------
@pytest.fixture(scope='module')
def solver_kernels():
    from conftest import build_emulator
    from caffeplus.solver import gpu_kernels
    return build_emulator(gpu_kernels._SOURCE + gpu_kernels._CHECK_SOURCE +
                          gpu_kernels._UNSCALE_SOURCE)


def _tables(arrays):
    return numpy.array([a.ctypes.data for a in arrays], dtype=numpy.uint64)


def _emulated_update(emu, solver, indices, rate, guard, flag=None):
    """What MultiTensorUpdate.check and .run launch, over host arrays."""
    from caffeplus.solver import gpu_kernels
    net = solver.net
    n = len(net.learnable_params)
    params = [net.learnable_params[i] for i in indices]
    w = [p.data.reshape(-1) for p in params]
    g = [p.diff.reshape(-1) for p in params]
    h = [solver.history[i].data.reshape(-1) for i in indices]
    h2 = [solver.history[n + i].data.reshape(-1) for i in indices] \
        if solver.history_per_param == 2 else h
    sizes = [a.size for a in w]
    offsets = numpy.zeros(len(sizes) + 1, dtype=numpy.int64)
    numpy.cumsum(sizes, out=offsets[1:])
    total = numpy.int64(offsets[-1])
    f = numpy.float32
    if flag is not None:
        emu.kernel('caffeplus_gradient_check')((2,), (32,), (
            _tables(g), offsets, numpy.int32(len(sizes)), total, guard, flag))
    p = solver.param
    emu.kernel('caffeplus_solver_update')((2,), (32,), (
        _tables(w), _tables(g), _tables(h), _tables(h2), offsets,
        numpy.asarray([net.params_lr[i] for i in indices], dtype=numpy.float32),
        numpy.asarray([net.params_weight_decay[i] for i in indices], dtype=numpy.float32),
        numpy.int32(len(sizes)), total, numpy.int32(gpu_kernels.KINDS[solver.type]),
        f(rate), f(1), f(p.weight_decay), numpy.int32(p.regularization_type == 'L1'),
        *[f(x) for x in (tuple(solver.fused_scalars()) + (0, 0, 0, 0))[:4]], guard))


def _cpu_solver(solver_type):
    """A solver of NET on the CPU after one forward and backward (its gradients set)."""
    from caffeplus.solver import get_solver
    with shapes.quiet():
        solver = get_solver(_adapt(cpe.solver_param(param_of(NET), 'stock', 3), solver_type, {}))
    solver.step(1)                  # history not zero
    solver.net.clear_param_diffs()
    solver.net.forward_prefilled()
    solver.net.backward_all()
    return solver


def _state(solver):
    return [a.copy() for p in solver.net.learnable_params for a in (p.data, p.diff)] + \
        [b.data.copy() for b in solver.history]


@pytest.mark.parametrize('solver_type', ['SGD', 'Nesterov', 'AdaGrad', 'RMSProp', 'AdaDelta',
                                         'Adam'])
def test_emulated_update_kernel_matches_the_cpu_rules_by_layer(solver_kernels, solver_type):
    """The update kernel over one layer's parameters at a time (as the
    update in backward launches it) gives the CPU path's bits."""
    solver = _cpu_solver(solver_type)
    rate = solver.peek_learning_rate()
    groups = [[0, 1], [2, 3], [4, 5, 6, 7]]
    saved = _state(solver)
    for ids in groups:
        solver.update_params(ids, rate)
    expected = _state(solver)
    for p, (d, g) in zip(solver.net.learnable_params, zip(saved[0::2], saved[1::2])):
        p.data[...] = d
        p.diff[...] = g
    for b, s in zip(solver.history, saved[2 * len(solver.net.learnable_params):]):
        b.data[...] = s
    guard = numpy.zeros(1, dtype=numpy.float64)
    for ids in groups:
        _emulated_update(solver_kernels, solver, ids, rate, guard)
    for got, want in zip(_state(solver), expected):
        assert numpy.array_equal(got, want)


def test_emulated_check_kernel_stops_this_and_every_later_update(solver_kernels):
    solver = _cpu_solver('SGD')
    rate = solver.peek_learning_rate()
    params = solver.net.learnable_params
    # Backward order: ip2 (6, 7), ip1 (4, 5), conv_a/conv_b (2, 3); ip1's is bad.
    params[4].diff.reshape(-1)[7] = numpy.inf
    guard = numpy.zeros(1, dtype=numpy.float64)
    flags = numpy.zeros(3, dtype=numpy.int32)
    before = [p.data.copy() for p in params]
    for g, ids in enumerate([[6, 7], [4, 5], [2, 3]]):
        _emulated_update(solver_kernels, solver, ids, rate, guard, flags[g:g + 1])
    assert numpy.isnan(guard[0]) and flags.tolist() == [0, 1, 0]
    changed = [not numpy.array_equal(a, p.data) for a, p in zip(before, params)]
    assert changed[2:] == [False, False, False, False, True, True]


def test_a_solver_with_its_own_apply_update_keeps_the_gradients_whole():
    """A subclass with its own compute_update_value updates in backward
    (update_params calls it); one with its own apply_update does not."""
    from caffeplus.solver.sgd import SGDSolver

    class OwnRule(SGDSolver):
        use_fused_kernels = False

        def compute_update_value(self, i, g, local_rate):
            g *= local_rate

    class OwnUpdate(SGDSolver):
        def apply_update(self):
            super().apply_update()
    assert update_in_backward.blockers(_bare(OwnRule)) == []
    assert update_in_backward.blockers(_bare(OwnUpdate)) == ['the solver has its own apply_update']


def _bare(cls):
    """An instance with only what blockers() reads."""
    from caffeplus.proto import caffe_pb2
    solver = cls.__new__(cls)
    solver.param = caffe_pb2.SolverParameter()
    solver.callbacks = []
    return solver


def test_update_tables_key_on_addresses_not_on_arrays():
    """MultiTensorUpdate rebuilds its pointer tables when an array moves and
    holds none of them (a held view of a placed gradient kept an old arena
    allocated after a re-layout)."""
    import types
    from caffeplus.solver.gpu_kernels import MultiTensorUpdate

    def array(ptr, size=4):
        return types.SimpleNamespace(data=types.SimpleNamespace(ptr=ptr), size=size)

    def blob(data, diff):
        return types.SimpleNamespace(data_storage=types.SimpleNamespace(array=data),
                                     diff_storage=types.SimpleNamespace(array=diff))
    p = blob(array(100), array(200))
    h = types.SimpleNamespace(data_storage=types.SimpleNamespace(array=array(300)))
    key = MultiTensorUpdate._key([p], [h], None, [1.0], [1.0])
    assert key == MultiTensorUpdate._key([blob(array(100), array(200))], [h], None, [1.0],
                                         [1.0])
    moved = MultiTensorUpdate._key([blob(array(100), array(232))], [h], None, [1.0], [1.0])
    grown = MultiTensorUpdate._key([blob(array(100), array(200, 8))], [h], None, [1.0], [1.0])
    unset = MultiTensorUpdate._key([blob(array(100), None)], [h], None, [1.0], [1.0])
    assert len({key, moved, grown, unset}) == 4
    assert not hasattr(MultiTensorUpdate(), 'alive')
