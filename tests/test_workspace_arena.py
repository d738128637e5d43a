"""The cuDNN workspace: algorithm choice, the arena, stock sizing, OOM
messages, math modes, engine selection.

The choice logic and stock arithmetic run anywhere (fake candidate lists);
the `gpu` tests build real nets on the device.
"""
import numpy
import pytest

import caffeplus
from caffeplus import backend
from caffeplus.errors import CaffeplusError
from caffeplus.memory import workspace
from caffeplus.memory.workspace import (CUDNN_STREAMS_PER_GROUP, STOCK_WORKSPACE_LIMIT, Site,
                                        choose, choose_stock, plan_sites, stock_bytes)

MB = 1024 * 1024


class Cand:
    """A stand-in for caffeplus.cudnn.api.AlgoChoice."""

    def __init__(self, algo, memory, time=1.0, deterministic=True):
        self.algo, self.memory, self.time, self.deterministic = algo, memory, time, deterministic
        self.name = 'A%d' % algo

    def __repr__(self):
        return '<A%d %d>' % (self.algo, self.memory)


# -- choice logic (CPU) ---------------------------------------------------------
def test_choose_takes_first_that_fits():
    cands = [Cand(7, 900 * MB), Cand(1, 40 * MB), Cand(0, 0)]
    assert choose(cands, 10 ** 12).algo == 7
    assert choose(cands, 100 * MB).algo == 1
    assert choose(cands, 40 * MB).algo == 1          # <= budget fits
    assert choose(cands, 40 * MB - 1).algo == 0
    assert choose(cands, 0).algo == 0


def test_choose_deterministic_filter():
    cands = [Cand(5, 10, deterministic=False), Cand(2, 20), Cand(0, 0, deterministic=False)]
    assert choose(cands, 100).algo == 5
    assert choose(cands, 100, deterministic=True).algo == 2
    with pytest.raises(CaffeplusError, match='budget'):
        choose(cands, -1)                               # nothing fits, any algorithm
    with pytest.raises(CaffeplusError, match='deterministic'):
        choose([Cand(5, 0, deterministic=False)], 100, deterministic=True)


def test_deterministic_math_outranks_the_limit(caplog_caffeplus):
    """No deterministic algorithm within the limit: the deterministic one
    needing least, under the arena's rule and stock's alike, said once."""
    cands = [Cand(5, 0, deterministic=False), Cand(1, 30 * MB), Cand(3, 13 * MB),
             Cand(4, 13 * MB)]
    for _ in range(2):
        assert choose(cands, 8 * MB, True, 'layer conv2 bwd_filter').algo == 3
        assert choose_stock(cands, deterministic=True, what='layer conv2 bwd_filter').algo == 3
    said = [m for m in caplog_caffeplus if 'no deterministic' in m]
    assert len(said) == 1 and 'conv2 bwd_filter' in said[0] and str(13 * MB) in said[0]
    # Without deterministic math stock keeps Caffe's rule (the zero-workspace one).
    assert choose_stock(cands, deterministic=False).algo == 5
    # A deterministic choice within the limit is unaffected.
    assert choose_stock(cands, limit=13 * MB, deterministic=True).algo == 3
    # No deterministic algorithm at all: stock errors as the arena does.
    with pytest.raises(CaffeplusError, match='conv2 fwd.*no deterministic'):
        choose_stock([Cand(5, 0, deterministic=False)], deterministic=True,
                     what='layer conv2 fwd')


def test_choose_nothing_fits_names_site_and_bytes():
    with pytest.raises(CaffeplusError, match=r'conv1 fwd.*budget of 10 bytes.*needs 64'):
        choose([Cand(3, 128), Cand(4, 64)], 10, what='layer conv1 fwd')


def test_plan_sites_buffer_is_largest_choice():
    sites = [Site('fwd', [Cand(6, 300), Cand(0, 0)]),
             Site('bwd_data', [Cand(1, 500), Cand(0, 50)]),
             Site('bwd_filter', [Cand(3, 200), Cand(1, 100)])]
    assert plan_sites(sites, 10 ** 9) == 500
    assert [s.choice.algo for s in sites] == [6, 1, 3]
    assert plan_sites(sites, 250) == 200
    assert [s.choice.algo for s in sites] == [0, 0, 3]
    for s in sites:
        assert s.choice.memory <= 250


def _knee_sites():
    # Two convolutions: conv_a's Winograd-like 900 MB buys 5% on a 10 ms
    # call over a 90 MB chunked variant; conv_b needs 200 MB to be 2x faster.
    return [Site('fwd', [Cand(7, 900 * MB, 10.0), Cand(7, 90 * MB, 10.5), Cand(1, 0, 20.0)]),
            Site('bwd_data', [Cand(5, 200 * MB, 4.0), Cand(0, 0, 8.0)])]


def brute_force_knee(sites, budget, tolerance):
    """Try every budget level; the least whose summed time is within tolerance."""
    def total(limit):
        return sum(min(c.time for c in s.candidates if c.memory <= limit) for s in sites)
    levels = sorted({c.memory for s in sites for c in s.candidates if c.memory <= budget})
    return min(b for b in levels if total(b) <= total(budget) * (1 + tolerance))


@pytest.mark.parametrize('tolerance', [0.0, 0.03, 0.05, 0.2, 0.5, 1.0])
def test_knee_budget_is_the_least_within_tolerance(tolerance):
    sites = _knee_sites()
    got = workspace.knee_budget(sites, 10 ** 12, tolerance=tolerance)
    assert got == brute_force_knee(sites, 10 ** 12, tolerance)
    # 14 ms fastest; 900 MB -> 90 MB costs 0.5 ms (3.6%); 200 MB -> 0 costs 4 ms.
    assert got == {0.0: 900 * MB, 0.03: 900 * MB, 0.05: 200 * MB, 0.2: 200 * MB,
                   0.5: 90 * MB, 1.0: 0}[tolerance]


def test_knee_keeps_a_tighter_budget_and_the_arena_shrinks_to_it():
    sites = _knee_sites()
    assert workspace.knee_budget(sites, 150 * MB, tolerance=0.5) == 90 * MB
    budget = workspace.knee_budget(sites, 10 ** 12, tolerance=0.05)
    assert plan_sites(sites, budget) == 200 * MB
    assert [s.choice.memory for s in sites] == [90 * MB, 200 * MB]


def test_knee_needs_times_and_can_be_turned_off(monkeypatch):
    untimed = [Site('fwd', [Cand(7, 900 * MB, -1.0), Cand(1, 0, -1.0)])]   # heuristics
    assert workspace.knee_budget(untimed, 10 ** 12, tolerance=0.5) == 10 ** 12
    sites = _knee_sites()
    assert workspace.knee_budget(sites, 10 ** 12, tolerance=-1) == 10 ** 12
    assert workspace.knee_budget(sites, 10 ** 12) < 10 ** 12
    monkeypatch.setattr(workspace, 'KNEE_TOLERANCE', -1)
    assert workspace.knee_budget(sites, 10 ** 12) == 10 ** 12


def test_knee_with_deterministic_math_weighs_deterministic_candidates_only():
    sites = [Site('fwd', [Cand(7, 900 * MB, 10.0, deterministic=False),
                          Cand(6, 500 * MB, 12.0), Cand(1, 0, 30.0)])]
    assert workspace.knee_budget(sites, 10 ** 12, deterministic=True, tolerance=0.03) \
        == 500 * MB


class _FakeCupy:
    """CuPy as the timed search uses it: buffers, a pool whose cached blocks
    go back to the device, and the device's memory in use."""

    def __init__(self):
        self.live = 0               # bytes held by buffers
        self.cached = 0             # freed, kept by the pool
        self.most = 0
        self.frees = 0
        outer = self

        class Array:
            def __init__(self, n):
                self.nbytes = n
                outer.live += n
                outer.most = max(outer.most, outer.live + outer.cached)
                self.data = type('D', (), {'ptr': 4096})()

            def __del__(self):
                outer.live -= self.nbytes
                outer.cached += self.nbytes

        class Pool:
            def free_all_blocks(self):
                outer.cached = 0
                outer.frees += 1
        self.uint8 = 'uint8'
        self._pool = Pool()
        self.empty = lambda n, dtype=None: Array(n)
        self.scratch = lambda n: Array(n)

    def get_default_memory_pool(self):
        return self._pool


def _timed_site(fake, kind, memories, scratch, seen):
    """A site whose timer takes `scratch` bytes beside the workspace it is
    given and times the candidates that fit it (the fastest needs most)."""
    def timer(ptr, nbytes):
        held = fake.scratch(scratch)
        seen.append((kind, nbytes, fake.live))
        del held
        return [Cand(i, m, time=1.0 / (1 + m)) for i, m in enumerate(memories) if m <= nbytes]
    timer.scratch_bytes = scratch
    return Site(kind, [Cand(i, m) for i, m in enumerate(memories)], timer=timer)


def test_timed_search_holds_one_site_at_a_time_within_the_maps_room(monkeypatch):
    """Each site is timed with a buffer of its own largest candidate, its
    scratch given back before the next site; under a placed plan, scratch
    and workspace together stay within the room the maps will take (VGG-16
    b64 held 7.7 GB at the search for a 4.6 GB iteration)."""
    fake = _FakeCupy()
    monkeypatch.setattr(workspace, '_cupy', lambda: fake)

    class Layer:
        layer_param = type('P', (), {'name': 'conv'})()
    layer = Layer()

    def search(manager, room=None):
        seen = []
        big = _timed_site(fake, 'fwd', [0, 300 * MB, 3000 * MB], 1600 * MB, seen)
        small = _timed_site(fake, 'bwd_data', [0, 200 * MB], 50 * MB, seen)
        manager.search_room = room
        fake.most = 0
        manager._time_sites([(layer, small), (layer, big)], budget=10 ** 12)
        return seen, big, small

    arena = workspace.WorkspaceArena()

    # The arena: no room bound; still one site's buffer at a time.
    seen, big, small = search(arena)
    assert [(k, n) for k, n, _ in seen] == [('bwd_data', 200 * MB), ('fwd', 3000 * MB)]
    # One site at a time: not the 3000 MB buffer beside another site's
    # scratch, nor beside the last site's buffer left cached in the pool.
    assert fake.most == 4600 * MB
    assert max(c.memory for c in big.candidates) == 3000 * MB
    assert big.timer is None and small.timer is None    # timed once
    arena.release()                         # its buffer (the last site's) goes
    fake.get_default_memory_pool().free_all_blocks()
    assert fake.live == 0
    # Placed, with 4 GB of maps: the 3 GB candidate is not timed (it would
    # take 4.6 GB to time), the 300 MB one is, in all the room the scratch
    # leaves (a sliced variant may need less than 3 GB but more than 300 MB);
    # the small site is untouched.
    placed = workspace.PlacedWorkspace()
    monkeypatch.setattr(placed, '_timing_wanted', lambda pairs: True)
    seen, big, small = search(placed, room=4000 * MB)
    assert [(k, n) for k, n, _ in seen] == [('bwd_data', 200 * MB), ('fwd', 2400 * MB)]
    assert fake.most <= 4000 * MB
    assert sorted(c.memory for c in big.candidates) == [0, 300 * MB]
    assert fake.live == 0 and fake.cached == 0          # all given back after the search
    assert placed.nbytes == 0
    # Where the scratch leaves less than half the room (2 GB, and 1 GB:
    # less than the scratch), the site takes half the room beside it ...
    for room in (2000 * MB, 1000 * MB):
        seen, big, _ = search(workspace.PlacedWorkspace(), room=room)
        assert seen[1][:2] == ('fwd', room // 2)
        assert fake.most <= 1600 * MB + room // 2
        assert sorted(c.memory for c in big.candidates) == [0, 300 * MB]
    # ... but not under plan auto's budget: there, within the room or nothing.
    bounded = workspace.PlacedWorkspace()
    bounded.search_floor = 0.0
    seen, big, _ = search(bounded, room=2000 * MB)
    assert seen[1][:2] == ('fwd', 400 * MB) and fake.most <= 2000 * MB
    seen, big, _ = search(bounded, room=1000 * MB)
    assert seen[1][:2] == ('fwd', 0) and [c.memory for c in big.candidates] == [0]


def test_stock_choice_is_first_within_8mb():
    cands = [Cand(6, STOCK_WORKSPACE_LIMIT + 1), Cand(1, STOCK_WORKSPACE_LIMIT), Cand(0, 0)]
    assert choose_stock(cands).algo == 1
    assert choose_stock([Cand(6, 9 * MB), Cand(2, 20 * MB)]).algo == 6   # least, none fits
    assert choose_stock([]) is None


def test_stock_sizing_arithmetic():
    fwd, bd, bf = Cand(1, 3 * MB), Cand(0, 0), Cand(3, 5 * MB)
    assert CUDNN_STREAMS_PER_GROUP == 3
    assert stock_bytes([fwd, bd, bf], 1) == 5 * MB * 3
    assert stock_bytes([fwd, bd, bf], 2) == 5 * MB * 2 * 3
    assert stock_bytes([None, bd], 4) == 0


def test_out_of_memory_message_names_layer_plan_bytes():
    class OutOfMemoryError(MemoryError):
        pass
    exc = OutOfMemoryError('Out of memory allocating 1,073,741,824 bytes (allocated so far: 0 bytes).')
    assert workspace.is_out_of_memory(exc)
    assert workspace.requested_bytes(exc) == 1073741824
    lp = caffeplus.proto.caffe_pb2.LayerParameter(name='conv5', type='Convolution')

    class L:
        layer_param = lp
        memory_plan = 'stock'
    err = workspace.out_of_memory_error(L(), 'forward', exc)
    assert isinstance(err, CaffeplusError)
    msg = str(err)
    assert 'conv5' in msg and 'forward' in msg and "'stock'" in msg and '1,073,741,824' in msg


def test_math_mode_parse_and_state():
    from caffeplus.backend import mathmode
    assert mathmode.parse('strict') == (False, False)
    assert mathmode.parse('tf32') == (True, False)
    assert mathmode.parse('tf32+deterministic') == (True, True)
    with pytest.raises(CaffeplusError, match='math mode'):
        mathmode.parse('fast')
    try:
        mathmode.set_math_mode('tf32')
        assert mathmode.tf32() and mathmode.math_mode() == 'tf32'
        import os
        assert os.environ['CUPY_TF32'] == '1'
    finally:
        mathmode.set_math_mode('strict')
    import os
    assert os.environ['CUPY_TF32'] == '0' and mathmode.math_mode() == 'strict'


def test_engine_selection():
    from caffeplus.layer import GPU_ENGINES, create_layer, layer_class
    from caffeplus.proto import caffe_pb2
    lp = caffe_pb2.LayerParameter(name='c', type='Convolution')
    lp.convolution_param.num_output = 2
    lp.convolution_param.kernel_size.append(3)
    layer_class('Convolution')      # loads the families
    assert create_layer(lp).__class__.__name__ == 'CuDNNConvolutionLayer'
    lp.convolution_param.engine = caffe_pb2.ConvolutionParameter.CAFFE
    assert create_layer(lp).__class__ is layer_class('Convolution')
    lp.convolution_param.engine = caffe_pb2.ConvolutionParameter.CUDNN
    assert create_layer(lp).__class__ is GPU_ENGINES['Convolution']
    for t in ('Convolution', 'Deconvolution', 'Pooling', 'LRN', 'Softmax', 'ReLU', 'Sigmoid',
              'TanH', 'ELU'):
        assert issubclass(GPU_ENGINES[t], layer_class(t)), t


def test_cudnn_layers_match_generic_on_cpu():
    """On NumPy arrays the cuDNN classes are the generic code."""
    from caffeplus.blob import Blob
    from caffeplus.layer import create_layer
    from caffeplus.proto import caffe_pb2
    rng = numpy.random.default_rng(3)
    x = rng.standard_normal((2, 4, 7, 7)).astype(numpy.float32)
    outs = []
    for engine in (caffe_pb2.ConvolutionParameter.CUDNN, caffe_pb2.ConvolutionParameter.CAFFE):
        caffeplus.set_random_seed(5)
        lp = caffe_pb2.LayerParameter(name='c', type='Convolution')
        p = lp.convolution_param
        p.num_output, p.group, p.engine = 4, 2, engine
        p.kernel_size.append(3)
        p.weight_filler.type = 'gaussian'
        bottom, top = [Blob(x.shape)], [Blob()]
        bottom[0].data = x
        layer = create_layer(lp)
        layer.setup(bottom, top)
        layer.forward(bottom, top)
        outs.append(numpy.array(top[0].data))
    numpy.testing.assert_array_equal(outs[0], outs[1])


# -- on the device ----------------------------------------------------------------
CONV_NET = '''
name: "arena"
force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 8 dim: 16 dim: 28 dim: 28 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 32 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 }
                      bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param { num_output: 32 kernel_size: 5 pad: 2 group: 2 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "conv3" type: "Convolution" bottom: "conv2" top: "conv3"
  convolution_param { num_output: 8 kernel_size: 3 stride: 2 weight_filler { type: "gaussian" std: 0.1 } } }
'''


def _net(tmp_path, text=CONV_NET, name='net.prototxt'):
    path = tmp_path / name
    path.write_text(text)
    return caffeplus.Net(str(path), caffeplus.TRAIN)


def _run(net, x, dy, bias=False):
    net.blobs['data'].data[...] = x
    net.forward()
    net.blobs['conv3'].diff[...] = dy
    for layer in net.layers:
        for b in layer.blobs:
            b.diff[...] = 0
    net.backward()
    out = {'conv3': backend.to_numpy(net._blob_dict['conv3'].data).copy(),
           'ddata': backend.to_numpy(net._blob_dict['data'].diff).copy()}
    for name in ('conv1', 'conv2', 'conv3'):
        out[name + '_dw'] = backend.to_numpy(net.layer_dict[name].blobs[0].diff).copy()
        if bias:        # every convolution here has a bias term (Caffe's default)
            out[name + '_db'] = backend.to_numpy(net.layer_dict[name].blobs[1].diff).copy()
    return out


def _weights(net):
    return {n: [backend.to_numpy(b.data).copy() for b in l.blobs]
            for n, l in net.layer_dict.items()}


def _set_weights(net, w):
    for n, blobs in w.items():
        for b, v in zip(net.layer_dict[n].blobs, blobs):
            b.data = v


def _cpu_reference(tmp_path, x, dy, w, bias=False, text=CONV_NET):
    caffeplus.set_mode_cpu()
    net = _net(tmp_path, text=text, name='cpu.prototxt')
    _set_weights(net, w)
    return _run(net, x, dy, bias)


def _close(a, b, tol=2e-4):
    for k in b:
        scale = max(float(numpy.abs(b[k]).max()), 1.0)
        numpy.testing.assert_allclose(a[k], b[k], rtol=tol, atol=tol * scale, err_msg=k)


def _inputs(batch=8):
    rng = numpy.random.default_rng(11)
    x = rng.standard_normal((batch, 16, 28, 28)).astype(numpy.float32)
    dy = rng.standard_normal((batch, 8, 13, 13)).astype(numpy.float32)
    return x, dy


@pytest.mark.gpu
def test_arena_picks_within_budget_and_buffer_is_largest_choice(tmp_path):
    x, dy = _inputs()
    caffeplus.set_mode_gpu()
    net = _net(tmp_path)
    arena = net.workspace
    assert isinstance(arena, workspace.WorkspaceArena)
    w = _weights(net)
    got = _run(net, x, dy)
    choices = [s.choice for _, s in arena.sites()]
    assert len(choices) == 9                    # 3 convolutions x 3 call sites
    assert all(c.memory <= arena.budget for c in choices)
    assert arena.nbytes == max(c.memory for c in choices)
    assert max(l.workspace_bytes() for l in net.layers) == arena.nbytes
    ref = _cpu_reference(tmp_path, x, dy, w)
    _close(got, ref)

    # A tight limit: every choice fits it, the buffer shrinks, results hold.
    caffeplus.set_mode_gpu()
    net2 = _net(tmp_path, name='net2.prototxt')
    _set_weights(net2, w)
    limit = 1024
    arena2 = workspace.apply_workspace_plan(net2, 'arena', limit)
    got2 = _run(net2, x, dy)
    choices2 = [s.choice for _, s in arena2.sites()]
    assert arena2.budget == limit
    assert all(c.memory <= limit for c in choices2)
    assert arena2.nbytes == max(c.memory for c in choices2) <= limit
    _close(got2, ref)


@pytest.mark.gpu
def test_arena_replans_on_reshape(tmp_path):
    caffeplus.set_mode_gpu()
    net = _net(tmp_path)
    x, dy = _inputs()
    _run(net, x, dy)
    before = net.workspace.replans
    net.blobs['data'].reshape(4, 16, 20, 20)
    net.reshape()
    net.forward()
    assert net.workspace.replans == before + 1
    assert net.workspace.nbytes == max(s.choice.memory for _, s in net.workspace.sites())


@pytest.mark.gpu
def test_stock_sizing_rule_on_device(tmp_path):
    x, dy = _inputs()
    caffeplus.set_mode_gpu()
    net = _net(tmp_path)
    w = _weights(net)
    assert workspace.apply_workspace_plan(net, 'stock') is None
    got = _run(net, x, dy)
    for name in ('conv1', 'conv2', 'conv3'):
        layer = net.layer_dict[name]
        mgr = layer._ws
        assert isinstance(mgr, workspace.StockWorkspace)
        choices = [s.choice for s in layer._sites.values()]
        assert all(c.memory <= STOCK_WORKSPACE_LIMIT or c.memory == min(
            a.memory for a in s.candidates) for c, s in zip(choices, layer._sites.values()))
        expect = max(c.memory for c in choices) * layer.group * CUDNN_STREAMS_PER_GROUP
        assert mgr.nbytes == expect == layer.stock_workspace_bytes()
        assert len(mgr.handles) == 3 * layer.group and len(mgr.streams) == 3 * layer.group
        assert layer._cd.loops == layer.group      # groups run one call each, as Caffe
    _close(got, _cpu_reference(tmp_path, x, dy, w))


@pytest.mark.gpu
def test_timed_search_and_deterministic_mode(tmp_path):
    from caffeplus.backend import mathmode
    x, dy = _inputs()
    previous = workspace.set_search('timed')
    try:
        caffeplus.set_mode_gpu()
        net = _net(tmp_path)
        w = _weights(net)
        got = _run(net, x, dy)
        assert all(s.choice is not None for _, s in net.workspace.sites())
        print('timed choices:', [(l.layer_param.name, s.kind, s.choice.name, s.choice.memory)
                                 for l, s in net.workspace.sites()])
    finally:
        workspace.set_search(previous)
    ref = _cpu_reference(tmp_path, x, dy, w)
    # The fastest algorithms (FFT, Winograd) round differently from a direct
    # sum: ~1e-3 of the largest value, as with PyTorch's cudnn.benchmark.
    _close(got, ref, tol=5e-3)
    mathmode.set_math_mode('deterministic')
    try:
        caffeplus.set_mode_gpu()
        runs = []
        for i in range(2):
            net = _net(tmp_path, name='det%d.prototxt' % i)
            _set_weights(net, w)
            runs.append(_run(net, x, dy))
        assert all(s.choice.deterministic for _, s in net.workspace.sites())
        for k in runs[0]:
            numpy.testing.assert_array_equal(runs[0][k], runs[1][k], err_msg=k)
        _close(runs[0], ref)
    finally:
        mathmode.set_math_mode('strict')


@pytest.mark.gpu
def test_tf32_mode_runs_and_strict_is_fp32(tmp_path):
    from caffeplus.backend import mathmode
    x, dy = _inputs()
    caffeplus.set_mode_gpu()
    net = _net(tmp_path)
    w = _weights(net)
    strict = _run(net, x, dy)
    ref = _cpu_reference(tmp_path, x, dy, w)
    _close(strict, ref, tol=2e-4)
    mathmode.set_math_mode('tf32')
    try:
        caffeplus.set_mode_gpu()
        net = _net(tmp_path, name='tf32.prototxt')
        _set_weights(net, w)
        got = _run(net, x, dy)
        _close(got, ref, tol=2e-2)
    finally:
        mathmode.set_math_mode('strict')


@pytest.mark.gpu
def test_out_of_memory_names_layer_plan_and_bytes(tmp_path):
    caffeplus.set_mode_gpu()
    text = '''
name: "huge"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1000 dim: 1000 dim: 1000 dim: 15 } } }
layer { name: "big_relu1" type: "ReLU" bottom: "data" top: "a" }
layer { name: "big_relu2" type: "ReLU" bottom: "a" top: "b" }
layer { name: "big_relu3" type: "ReLU" bottom: "b" top: "c" }
'''
    path = tmp_path / 'huge.prototxt'
    path.write_text(text)
    net = caffeplus.Net(str(path), caffeplus.TEST)
    with pytest.raises(CaffeplusError) as info:
        net.forward()
    msg = str(info.value)
    assert 'big_relu' in msg and 'forward' in msg and 'arena' in msg
    assert '60,000,000,000' in msg     # one 1.5e10-float blob


@pytest.mark.gpu
def test_pycaffe_host_views_stay_in_sync(tmp_path):
    x, dy = _inputs()
    caffeplus.set_mode_gpu()
    net = _net(tmp_path)
    data = net.blobs['data'].data
    assert isinstance(data, numpy.ndarray)
    data[...] = x
    net.forward()
    out1 = net.blobs['conv3'].data.copy()
    assert isinstance(net._blob_dict['conv3'].data, type(net._blob_dict['data'].data))
    # writing a weight through net.params reaches the device
    net.params['conv3'][0].data[...] *= 2
    net.forward()
    out2 = net.blobs['conv3'].data
    assert isinstance(out2, numpy.ndarray)
    numpy.testing.assert_allclose(out2, 2 * out1, rtol=1e-5, atol=1e-5)
    # the same host buffer sees the device's new values after the next forward
    held = net.blobs['conv3'].data
    net.params['conv3'][0].data[...] /= 2
    net.forward()
    numpy.testing.assert_allclose(net.blobs['conv3'].data, out1, rtol=1e-5, atol=1e-5)
    assert numpy.shares_memory(held, net.blobs['conv3'].data)


@pytest.mark.parametrize('beta', [0.0, 1.0])
def test_a_filter_gradient_over_batch_slices_is_written_once_then_added_to(monkeypatch, beta):
    """_conv_params_calls: over batch slices (one filter gradient, w_off 0)
    the first slice's call takes the beta asked for (0: a 16-bit layer's
    scratch, written) and the others add (beta 1); per-group calls each
    write their own part of the gradient with the beta asked for."""
    import types
    from caffeplus.layers import cudnn_conv
    calls = []
    monkeypatch.setattr(cudnn_conv.api, 'conv_backward_filter',
                        lambda *args, beta: calls.append((args[9], beta)))
    sliced = types.SimpleNamespace(loops=4, x=0, y=0, w=0, x_off=100, y_off=10, w_off=0)
    cudnn_conv._conv_params_calls(sliced, None, 0, False, 1000, 2000, 3000, 0, None, 0, beta)
    assert calls == [(3000, beta), (3000, 1.0), (3000, 1.0), (3000, 1.0)]
    del calls[:]
    groups = types.SimpleNamespace(loops=2, x=0, y=0, w=0, x_off=100, y_off=10, w_off=50)
    cudnn_conv._conv_params_calls(groups, None, 0, False, 1000, 2000, 3000, 0, None, 0, beta)
    assert calls == [(3000, beta), (3050, beta)]


@pytest.mark.gpu
@pytest.mark.parametrize('sixteen', [None, 'fp16'])
@pytest.mark.parametrize('variant', [3, 4, 5])
def test_batch_sliced_calls_match_the_cpu(tmp_path, variant, sixteen):
    """Timed search adds each call run over halves (variant 3), quarters
    (4) and eighths (5, from batch 16 on) of the batch; forced onto those
    candidates (the smallest workspace of each), every convolution's
    output, bottom gradient and accumulated filter and bias gradients match
    the CPU. In FLOAT16 too, where the filter gradient is written into a
    scratch (beta 0) by the first slice and added to by the others."""
    from caffeplus import precision
    from caffeplus.cudnn import algo_search as L
    batch = 16 if variant == 5 else 8
    text = CONV_NET.replace('dim: 8 dim: 16 dim: 28', 'dim: %d dim: 16 dim: 28' % batch)
    x, dy = _inputs(batch)
    previous = workspace.set_search('timed')
    try:
        caffeplus.set_mode_gpu()
        with precision.setting(sixteen):
            net = _net(tmp_path, text=text)
        w = _weights(net)
        _run(net, x, dy)                # search
        forced = 0
        for layer, s in net.workspace.sites():
            sliced = [c for c in s.candidates if c.variant == variant]
            if layer._cd.loops == 1:
                assert sliced, (layer.layer_param.name, s.kind)
                s.choice = min(sliced, key=lambda c: (c.memory, c.time))
                forced += 1
        # Every call site took its sliced candidate: 9 in FP32, 6 in FLOAT16
        # (conv3's top, the net's output, stays float32: the generic code).
        assert forced == len(list(net.workspace.sites())) >= 6
        assert all(layer._descs_for(s.choice).loops == L.CHUNK_VARIANTS[variant]
                   for layer, s in net.workspace.sites())
        arena = net.workspace       # the buffer must hold the largest forced choice
        need = max(s.choice.memory for _, s in arena.sites())
        arena._buffer.resize(max(need, arena._buffer.nbytes), net.layers[1], arena.plan_name)
        _set_weights(net, w)
        got = _run(net, x, dy, bias=True)
    finally:
        workspace.set_search(previous)
    ref = _cpu_reference(tmp_path, x, dy, w, bias=True, text=text)
    assert sorted(got) == sorted(ref) and 'conv2_db' in ref
    if sixteen is None:
        _close(got, ref, tol=5e-3)
        return
    # FLOAT16: where conv1's map rounds across 0, relu1 passes another
    # gradient (0.06% of the data's gradient on the H200); the parameter
    # gradients sum over them.
    ddata, want = got.pop('ddata'), ref.pop('ddata')
    off = numpy.abs(ddata - want) > 3e-2 * max(float(numpy.abs(want).max()), 1.0)
    assert off.mean() < 5e-3
    _close(got, ref, tol=3e-2)


# -- blobs over cuDNN's 32-bit element count: calls over slices of the batch ---------------
def test_batch_slices_are_the_fewest_equal_slices_that_fit(monkeypatch):
    from caffeplus.layers import cudnn_common as L
    monkeypatch.setattr(L, 'MAX_CUDNN_COUNT', 1000)
    assert L.batch_slices(8, (10, 10)) == 1              # 800 values
    assert L.batch_slices(8, (10, 10), (5, 30)) == 2     # 8 x 150 > 1000, 4 x 150 fits
    assert L.batch_slices(12, (300,)) == 4               # 3 x 300 fits, 6 x 300 does not
    assert L.batch_slices(7, (300,)) == 7                # prime: one image a call
    assert L.batch_slices(8, (1001,)) is None            # one image alone is too large
    monkeypatch.setattr(L, 'MAX_CUDNN_COUNT', 2 ** 31 - 1)
    # VGG-16's conv1_2 at batch 672: 64 x 224 x 224 values an image, 2.16e9 in all.
    assert L.batch_slices(672, (64, 224, 224)) == 2
    assert L.batch_slices(576, (64, 224, 224)) == 1


@pytest.mark.gpu
@pytest.mark.parametrize('search', ['heuristic', 'timed'])
def test_convolutions_over_batch_slices_match_the_cpu(tmp_path, monkeypatch, search):
    """With cuDNN's count lowered so that every blob of the net is too large
    for one call, each convolution runs its calls over quarters of the
    batch; outputs, bottom gradients and the accumulated filter and bias
    gradients match the CPU."""
    from caffeplus.layers import cudnn_common as L
    x, dy = _inputs()
    # conv1's top, 32 x 28 x 28 an image: a quarter of the batch (2 images) fits.
    monkeypatch.setattr(L, 'MAX_CUDNN_COUNT', 2 * 32 * 28 * 28)
    previous = workspace.set_search(search)
    try:
        caffeplus.set_mode_gpu()
        net = _net(tmp_path)
        w = _weights(net)
        got = _run(net, x, dy, bias=True)
        convs = [l for l in net.layers if hasattr(l, '_cd')]
        assert [l._cd.loops for l in convs] == [4, 4, 4]
        assert all(l._cd.batch_chunks == 4 for l in convs)
    finally:
        workspace.set_search(previous)
    ref = _cpu_reference(tmp_path, x, dy, w, bias=True)
    assert sorted(got) == sorted(ref) and 'conv2_db' in ref
    _close(got, ref, tol=5e-3 if search == 'timed' else 2e-4)


POOL_NET = '''
name: "pools"
force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 6 dim: 4 dim: 12 dim: 12 } } }
layer { name: "pmax" type: "Pooling" bottom: "data" top: "pmax"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "pave" type: "Pooling" bottom: "pmax" top: "pave"
  pooling_param { pool: AVE kernel_size: 3 stride: 1 pad: 1 } }
'''


@pytest.mark.gpu
def test_pooling_over_batch_slices_matches_the_cpu(tmp_path, monkeypatch):
    from caffeplus.layers import cudnn_common as L
    rng = numpy.random.default_rng(5)
    x = rng.standard_normal((6, 4, 12, 12)).astype(numpy.float32)
    dy = rng.standard_normal((6, 4, 6, 6)).astype(numpy.float32)
    # pmax's bottom, 4 x 12 x 12 an image: thirds of the batch (2 images) fit.
    monkeypatch.setattr(L, 'MAX_CUDNN_COUNT', 2 * 4 * 12 * 12)

    def run():
        net = _net(tmp_path, POOL_NET, 'pools.prototxt')
        net.blobs['data'].data[...] = x
        net.forward()
        net.blobs['pave'].diff[...] = dy
        net.backward()
        return net, {'pave': backend.to_numpy(net.blobs['pave'].data).copy(),
                     'dx': backend.to_numpy(net.blobs['data'].diff).copy()}

    caffeplus.set_mode_gpu()
    net, got = run()
    pools = [l for l in net.layers if hasattr(l, '_pool_loops')]
    assert [l._pool_loops[0] for l in pools] == [3, 1]     # pave's blobs fit whole
    caffeplus.set_mode_cpu()
    _, ref = run()
    _close(got, ref, tol=1e-6)


DECONV_NET = '''
name: "deconv"
force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 8 dim: 6 dim: 9 dim: 9 } } }
layer { name: "up" type: "Deconvolution" bottom: "data" top: "up"
  convolution_param { num_output: 4 kernel_size: 4 stride: 2 pad: 1 group: 2
                      weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" value: 0.2 } } }
layer { name: "down" type: "Convolution" bottom: "up" top: "down"
  convolution_param { num_output: 6 kernel_size: 3 stride: 2 weight_filler { type: "gaussian" std: 0.1 } } }
'''


@pytest.mark.gpu
def test_deconvolution_over_batch_slices_matches_the_cpu(tmp_path, monkeypatch):
    """A Deconvolution (forward = cuDNN's backward data, grouped) and a
    strided convolution over quarters of the batch, as the convolution test
    above: top, bottom gradient, filter and bias gradients match the CPU."""
    from caffeplus.layers import cudnn_common as L
    rng = numpy.random.default_rng(7)
    x = rng.standard_normal((8, 6, 9, 9)).astype(numpy.float32)
    # up's top, 4 x 18 x 18 an image: quarters of the batch (2 images) fit.
    monkeypatch.setattr(L, 'MAX_CUDNN_COUNT', 2 * 4 * 18 * 18)

    def run():
        net = _net(tmp_path, DECONV_NET, 'deconv.prototxt')
        for layer in net.layers:
            for b in layer.blobs:
                b.data = rng_w.standard_normal(b.shape).astype(numpy.float32) * 0.1
        net.blobs['data'].data[...] = x
        net.forward()
        top = net.blobs['down']
        top.diff[...] = dy
        for layer in net.layers:
            for b in layer.blobs:
                b.diff[...] = 0
        net.backward()
        out = {'down': backend.to_numpy(top.data).copy(),
               'ddata': backend.to_numpy(net.blobs['data'].diff).copy()}
        for name in ('up', 'down'):
            for k, b in enumerate(net.layer_dict[name].blobs):
                out['%s_%d' % (name, k)] = backend.to_numpy(b.diff).copy()
        return net, out

    dy = rng.standard_normal((8, 6, 8, 8)).astype(numpy.float32)
    caffeplus.set_mode_gpu()
    rng_w = numpy.random.default_rng(9)
    net, got = run()
    up = net.layer_dict['up']
    assert up._cd is not None and up._cd.batch_chunks == 4 and up._cd.loops == 4
    caffeplus.set_mode_cpu()
    rng_w = numpy.random.default_rng(9)
    _, ref = run()
    _close(got, ref, tol=2e-4)


@pytest.mark.gpu
def test_making_a_plan_to_apply_chooses_no_algorithms(tmp_path):
    """make_plan for a net about to get the plan reads the workspace the
    layers chose so far and chooses nothing: choosing would time every
    candidate with the net's default arena (what the whole GPU spares:
    VGG-16 b256 asked for 20.6 GB on a card emulated at 12 GiB, before plan
    auto's own capped manager took over)."""
    from caffeplus.memory.apply import apply_named_plan
    from caffeplus.memory.plan import make_plan
    caffeplus.set_mode_gpu()
    net = _net(tmp_path)
    for name in ('arena', 'shared', 'offload'):
        make_plan(net, name)
    sites = [s for layer in net.layers for s in getattr(layer, '_sites', {}).values()]
    assert sites and all(s.choice is None for s in sites)
    apply_named_plan(net, 'shared', training=True)
    x, dy = _inputs()
    _run(net, x, dy)
    assert all(s.choice is not None for s in sites)


@pytest.mark.gpu
def test_a_new_workspace_plan_keeps_the_descriptors_only_for_the_same_calls(tmp_path):
    """set_workspace_manager reuses a convolution's descriptors only when
    they describe the calls the new plan makes: arena -> arena keeps them;
    stock runs a grouped convolution one call per group (Caffe 1.0), so
    arena -> stock -> arena builds them anew each time; results match the
    CPU throughout."""
    x, dy = _inputs()
    caffeplus.set_mode_gpu()
    net = _net(tmp_path)
    w = _weights(net)
    _run(net, x, dy)
    conv2 = net.layers[net._layer_names.index('conv2')]
    assert conv2.group == 2
    cd = conv2._cd
    workspace.apply_workspace_plan(net, 'arena', 0)
    assert conv2._cd is cd
    ref = _cpu_reference(tmp_path, x, dy, w)
    caffeplus.set_mode_gpu()
    workspace.apply_workspace_plan(net, 'stock', 0)
    assert conv2._split_groups() and conv2._cd is not cd
    stock_cd = conv2._cd
    _close(_run(net, x, dy), ref)
    workspace.apply_workspace_plan(net, 'arena', 0)
    assert not conv2._split_groups() and conv2._cd is not stock_cd
    _close(_run(net, x, dy), ref)
