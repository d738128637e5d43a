"""cuBLAS's workspace under the memory plans (caffeplus.memory.cublas_pool):
one buffer instead of two, and for the placing plans InnerProduct's GEMMs
on caffeplus's own handle with workspace placed in the arena."""
import json
import os
import subprocess
import sys
import types

import numpy
import pytest

from caffeplus.memory import cublas_pool, shapes, thread_stack, workspace_model as wm
from conftest import ROOT, SHARED

ALEXNET = os.path.join(SHARED, 'bench', 'alexnet_b128.prototxt')
PROBE = os.path.join(ROOT, 'dev', 'cublas_workspace_probe.py')


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(cublas_pool.ENV, raising=False)


def test_plans_but_stock_ask_for_one_buffer_on_hopper_only(monkeypatch):
    for plan in ('arena', 'shared', 'offload', 'auto'):
        assert cublas_pool.wanted(plan, '90') == ':32768:1'
    assert cublas_pool.wanted('stock', '90') is None
    for other in ('80', '86', '100', '', None):
        assert cublas_pool.wanted('shared', other) is None
    monkeypatch.setenv(cublas_pool.ENV, ':4096:8')          # the user's own
    assert cublas_pool.wanted('shared', '90') is None


def test_apply_sets_the_variable_for_the_current_gpu(monkeypatch):
    fake = types.ModuleType('cupy')
    fake.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(
        compute_capability='90'))
    monkeypatch.setitem(sys.modules, 'cupy', fake)
    assert cublas_pool.apply('stock') is None
    assert cublas_pool.ENV not in os.environ
    assert cublas_pool.apply('shared') == ':32768:1'
    assert os.environ[cublas_pool.ENV] == ':32768:1'
    monkeypatch.setenv(cublas_pool.ENV, ':4096:1')
    assert cublas_pool.apply('offload') is None
    assert os.environ[cublas_pool.ENV] == ':4096:1'
    fake.cuda.Device = lambda: types.SimpleNamespace(compute_capability='80')
    monkeypatch.delenv(cublas_pool.ENV)
    assert cublas_pool.apply('shared') is None and cublas_pool.ENV not in os.environ


def test_the_estimate_counts_the_buffer_saved():
    if not os.path.exists(ALEXNET):
        pytest.fail('test data missing')
    net = shapes.build_net(shapes.load_net_param(ALEXNET))
    assert cublas_pool.saved_bytes('stock') == 0
    assert cublas_pool.saved_bytes('arena') == 32 * 2 ** 20
    for plan in ('shared', 'offload', 'auto'):      # the other buffer is in the arena
        assert cublas_pool.saved_bytes(plan) == 64 * 2 ** 20
    # the same thread stack for arena and shared: the difference is the
    # layers' internals alone, and stock's other has no cuBLAS saving in it
    assert wm.other_bytes(net, 'arena') == wm.RUNTIME_BYTES - \
        (1024 - thread_stack.THREAD_STACK_BYTES) * 132 * 2048 - 32 * 2 ** 20 + wm.internals(net)


def test_placing_plans_put_the_gemms_workspace_in_the_arena_on_hopper_only(monkeypatch):
    MiB = 2 ** 20
    for plan in ('shared', 'offload', 'auto'):
        assert cublas_pool.arena_bytes(plan, '90') == 32 * MiB
        assert cublas_pool.modelled_arena_bytes(plan) == 32 * MiB
    for plan in ('stock', 'arena'):
        assert cublas_pool.arena_bytes(plan, '90') == 0
        assert cublas_pool.modelled_arena_bytes(plan) == 0
    for other in ('80', '100', '', None):
        assert cublas_pool.arena_bytes('shared', other) == 0
    monkeypatch.setenv(cublas_pool.ENV, cublas_pool.POOL)     # as apply() sets it
    assert cublas_pool.arena_bytes('shared', '90') == 32 * MiB
    monkeypatch.setenv(cublas_pool.ENV, ':4096:8')            # the user's own cuBLAS
    assert cublas_pool.arena_bytes('shared', '90') == 0
    monkeypatch.delenv(cublas_pool.ENV)
    monkeypatch.setattr(cublas_pool, 'IN_ARENA', False)
    assert cublas_pool.arena_bytes('shared', '90') == 0


def test_the_estimate_places_the_gemms_workspace_at_the_inner_product_steps():
    """fc6-8's calls get 32 MiB each at their forward and backward steps,
    where AlexNet's maps are small: the arena's peak does not move, and
    other is 32 MiB less than under arena's one buffer."""
    if not os.path.exists(ALEXNET):
        pytest.fail('test data missing')
    from caffeplus.memory import budget, liveness, placement
    net = shapes.build_net(shapes.load_net_param(ALEXNET))
    plan = budget.estimate_plan(net, 'shared')
    L = len(net.layers)
    gemm = {b.key: b for b in plan.buffers if b.kind == 'workspace' and
            net.layers[net._layer_names.index(b.key[1])].layer_param.type == 'InnerProduct'}
    names = [n for n, l in zip(net._layer_names, net.layers)
             if l.layer_param.type == 'InnerProduct']
    assert names == ['fc6', 'fc7', 'fc8']
    assert sorted(gemm) == sorted(('workspace', n, p) for n in names
                                  for p in ('forward', 'backward'))
    for (_, name, part), b in gemm.items():
        i = net._layer_names.index(name)
        assert b.nbytes == 32 * 2 ** 20
        assert b.start == b.end == (i if part == 'forward' else 2 * L - 1 - i)
    placement.validate(plan.buffers, plan.offsets)
    without = [b for b in plan.buffers if b.key not in gemm]
    assert placement.place(without)[1] == plan.arena_bytes
    assert liveness.gemm_workspace_buffers(net, 0) == []
    assert all(b.key[2] == 'forward'
               for b in liveness.gemm_workspace_buffers(net, 4096, training=False))


def _probe(tmp_path, name, env):
    out = str(tmp_path / name)
    run = subprocess.run([sys.executable, PROBE, out], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, **env), timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    line = [l for l in run.stdout.splitlines() if 'the handle and the first GEMMs added' in l][0]
    return numpy.load(out), float(line.split('added ')[1].split(' MiB')[0])


@pytest.mark.gpu
def test_gpu_one_buffer_keeps_every_gemm_bit_for_bit_and_holds_less(tmp_path):
    """The bench nets' InnerProduct GEMMs forward and backward and a 1x1
    convolution's strided-batched GEMM, with cuBLAS's default pool and with
    one 32 MiB buffer, each in a fresh process."""
    import cupy
    if cupy.cuda.Device().compute_capability[:-1] != '9':
        pytest.skip('measured on Hopper')
    default, held_default = _probe(tmp_path, 'default.npz', {})
    one, held_one = _probe(tmp_path, 'one.npz', {cublas_pool.ENV: cublas_pool.POOL})
    assert sorted(default.files) == sorted(one.files) and len(default.files) == 25
    for key in default.files:
        assert numpy.array_equal(default[key], one[key]), key
    assert held_default - held_one >= 30, (held_default, held_one)


@pytest.mark.gpu
def test_gpu_a_plan_applied_first_sets_the_pool_for_the_handle():
    """In a fresh process: apply `shared` to a net, then run its GEMMs; the
    handle cuBLAS makes then holds one buffer (about 34 MiB, not 66)."""
    code = r'''
import caffeplus, cupy
from caffeplus.memory.apply import apply_named_plan
from caffeplus.backend import blas
from test_masks import vgg_like
caffeplus.set_mode_gpu()
net = caffeplus.Net(vgg_like(), caffeplus.TRAIN)
apply_named_plan(net, 'shared')
cupy.cuda.Device().synchronize()
free0 = cupy.cuda.runtime.memGetInfo()[0]
blas._handle()
cupy.cuda.Device().synchronize()
free1 = cupy.cuda.runtime.memGetInfo()[0]
import os
print('config', os.environ.get('CUBLAS_WORKSPACE_CONFIG'), 'handle', (free0 - free1) / 2**20)
'''
    env = {k: v for k, v in os.environ.items() if k != cublas_pool.ENV}
    env['PYTHONPATH'] = os.pathsep.join([ROOT, os.path.join(ROOT, 'tests')] +
                                        env.get('PYTHONPATH', '').split(os.pathsep))
    run = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    line = [l for l in run.stdout.splitlines() if l.startswith('config')][0]
    words = line.split()
    assert words[1] == ':32768:1'
    assert float(words[3]) < 45, line


def test_layers_that_run_gemms_through_cupy_keep_cupys_handle():
    """A net with a layer that may run GEMMs on CuPy's handle (caffeplus's
    handle made first would leave CuPy's without a pool, and change their
    bits) keeps every GEMM there: a convolution or InnerProduct of engine
    CAFFE (Caffe's own im2col and GEMM), the recurrent and Python layers."""
    import caffeplus
    from caffeplus.io.prototxt import parse_text
    from caffeplus.proto import caffe_pb2

    def build(text):
        return caffeplus.Net(parse_text(text, caffe_pb2.NetParameter()), caffeplus.TRAIN)
    assert cublas_pool.cupy_gemm_layers(build(_SMALL_NET)) == []
    caffe_conv = _SMALL_NET.replace('convolution_param {', 'convolution_param { engine: CAFFE')
    assert cublas_pool.cupy_gemm_layers(build(caffe_conv)) == ['conv']
    assert set(cublas_pool.CUPY_GEMM_TYPES) == {'RNN', 'LSTM', 'Python'}


_SMALL_NET = '''
name: "small"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { data_filler { type: "gaussian" std: 1 }
                           shape { dim: 8 dim: 3 dim: 12 dim: 12 }
                           data_filler { type: "uniform" min: 0 max: 4.99 } shape { dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 8 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 64 weight_filler { type: "xavier" }
                              bias_filler { type: "constant" value: 0.1 } } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip" top: "ip2"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
'''

def _result_of_fresh_process(script, *args):
    """The RESULT line `script` prints in a fresh process (cuBLAS reads its
    setting for the process's first handle), without the user's cuBLAS
    settings."""
    env = {k: v for k, v in os.environ.items()
           if k != cublas_pool.ENV}
    env['PYTHONPATH'] = os.pathsep.join([ROOT, os.path.join(ROOT, 'tests')] +
                                        env.get('PYTHONPATH', '').split(os.pathsep))
    run = subprocess.run([sys.executable, '-c', script] + list(args), cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return [l for l in run.stdout.splitlines() if l.startswith('RESULT')][0]


_ORDER_SCRIPT = r'''
import sys, numpy, cupy, caffeplus
from caffeplus.backend import blas, mathmode
from caffeplus.io.prototxt import parse_text
from caffeplus.proto import caffe_pb2
from test_cublas_pool import _SMALL_NET
caffeplus.set_mode_gpu()
mathmode.set_math_mode('deterministic')

def train(plan):
    caffeplus.set_random_seed(5)
    net = caffeplus.Net(parse_text(_SMALL_NET, caffe_pb2.NetParameter()), caffeplus.TRAIN,
                        memory=plan)
    losses = []
    for _ in range(4):
        net.clear_param_diffs()
        losses.append(float(cupy.asnumpy(net.forward_prefilled())))
        net.backward_all()
        for p in net.learnable_params:
            p.data[...] -= numpy.float32(0.05) * p.diff
    ip = net.layers[net._layer_names.index('ip')]
    return losses, [cupy.asnumpy(p.data) for p in net.learnable_params], dict(ip.gemm_views)

import json
first, second = sys.argv[1].split(',')
a = train(first)
made, fallback = blas.own_handle_made(), bool(blas._state['fallback'])
cupy.cuda.Device().synchronize()
free0 = cupy.cuda.runtime.memGetInfo()[0]
blas._handle()
cupy.cuda.Device().synchronize()
cupy_handle_mib = (free0 - cupy.cuda.runtime.memGetInfo()[0]) / 2 ** 20
b = train(second)
same = a[0] == b[0] and all(numpy.array_equal(x, y) for x, y in zip(a[1], b[1]))
print('RESULT ' + json.dumps({'views': [sorted(a[2]), sorted(b[2])], 'own_made': made,
      'fallback_after_first': fallback, 'fallback_after_second': bool(blas._state['fallback']),
      'cupy_handle_mib': cupy_handle_mib, 'same': same}))
'''


@pytest.mark.gpu
@pytest.mark.parametrize('order', ['shared,stock', 'stock,shared'])
def test_gpu_inner_product_gemms_on_the_arena_keep_their_bits(order):
    """In a fresh process (cuBLAS reads its setting for the process's first
    handle): `shared` runs InnerProduct's GEMMs on caffeplus's handle over
    its arena's bytes, with no GEMM on a fallback buffer; CuPy's handle made
    after it has no pool (0 MiB, not 32); `stock` trains to the same bits
    before or after it (after: its GEMMs on caffeplus's handle over the
    fallback buffer)."""
    import cupy
    if cupy.cuda.Device().compute_capability[:-1] != '9':
        pytest.skip('Hopper: the plans place cuBLAS workspace there only')
    line = _result_of_fresh_process(_ORDER_SCRIPT, order)
    print(line)
    got = json.loads(line[len('RESULT '):])
    assert got['same'], line                                # the same bits
    shared, stock = got['views'] if order == 'shared,stock' else got['views'][::-1]
    assert shared == ['backward', 'forward'] and stock == [], line
    if order == 'shared,stock':
        assert got['own_made'] and not got['fallback_after_first'], line
        assert got['cupy_handle_mib'] < 8, line           # no pool: not 34 MiB
        assert got['fallback_after_second'], line         # stock's GEMMs on caffeplus's handle
    else:
        assert not got['own_made'] and not got['fallback_after_first'], line
        assert got['cupy_handle_mib'] < 8, line           # made by stock already
        assert not got['fallback_after_second'], line     # CuPy's handle has its pool


_FIRST_HANDLE_SCRIPT = r'''
import os, json, cupy, caffeplus
from caffeplus.backend import blas
from caffeplus.io.prototxt import parse_text
from caffeplus.memory.apply import apply_named_plan
from caffeplus.proto import caffe_pb2
from test_cublas_pool import _SMALL_NET
os.environ['CAFFEPLUS_CUDNN_SEARCH'] = 'timed'
caffeplus.set_mode_gpu()
# a 1x1 convolution first: timed search weighs it as a GEMM too
text = _SMALL_NET.replace('kernel_size: 3', 'kernel_size: 1')
net = caffeplus.Net(parse_text(text, caffe_pb2.NetParameter()), caffeplus.TRAIN)
apply_named_plan(net, 'shared')
made_at_apply = blas.own_handle_made()
for _ in range(3):
    net.forward_prefilled()
    net.backward_all()
cupy.cuda.Device().synchronize()
conv = net.layers[net._layer_names.index('conv')]
# the calls that run: conv's bottom is the data, so no bwd_data
gemm_chosen = any(conv._sites[k].choice is not None and conv._sites[k].choice.variant == 2
                  for k in ('fwd', 'bwd_filter'))
print('RESULT ' + json.dumps({'made_at_apply': made_at_apply, 'gemm_chosen': gemm_chosen,
      'fallback_held': bool(blas._state['fallback'])}))
'''


@pytest.mark.gpu
def test_gpu_a_placing_plan_makes_caffeplus_handle_before_any_gemm():
    """In a fresh process: applying `shared` makes caffeplus's handle at
    once, so a timed search that weighs a 1x1 convolution as a GEMM does
    not make CuPy's handle first (its 32 MiB pool, and ours 32 MiB more);
    the search's fallback buffer goes back afterwards unless a GEMM was
    chosen for a call that runs (a GEMM chosen for the data's bwd_data,
    which never runs, takes none)."""
    import cupy
    if cupy.cuda.Device().compute_capability[:-1] != '9':
        pytest.skip('Hopper: the plans place cuBLAS workspace there only')
    line = _result_of_fresh_process(_FIRST_HANDLE_SCRIPT)
    got = json.loads(line[len('RESULT '):])
    assert got['made_at_apply'], line
    assert got['fallback_held'] == got['gemm_chosen'], line


def test_claiming_the_first_handle_needs_a_gpu_and_a_net_without_cupy_gemms(monkeypatch):
    """Without CuPy (this machine) nothing is made; a net whose layers GEMM
    through CuPy never makes caffeplus's handle first."""
    import caffeplus
    from caffeplus.io.prototxt import parse_text
    from caffeplus.proto import caffe_pb2
    net = caffeplus.Net(parse_text(_SMALL_NET, caffe_pb2.NetParameter()), caffeplus.TRAIN)
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert cublas_pool.claim_first_handle(net, 'shared') is False
    caffe_conv = _SMALL_NET.replace('convolution_param {', 'convolution_param { engine: CAFFE')
    other = caffeplus.Net(parse_text(caffe_conv, caffe_pb2.NetParameter()), caffeplus.TRAIN)
    assert cublas_pool.claim_first_handle(other, 'shared') is False
    assert cublas_pool.claim_first_handle(net, 'stock') is False


def test_own_handle_sets_stream_and_workspace_only_when_they_change(monkeypatch):
    """caffeplus's handle gets its stream and workspace set only when they
    change; a new stream puts cuBLAS's default workspace back, so the
    workspace is set again after it."""
    from caffeplus.backend import blas
    calls = []

    class Lib:
        def cublasSetStream_v2(self, handle, stream):
            calls.append(('stream', stream))
            return 0

        def cublasSetWorkspace_v2(self, handle, ptr, nbytes):
            calls.append(('workspace', ptr, nbytes))
            return 0

        def cublasGemmEx(self, handle, *args):
            calls.append(('gemm',))
            return 0

    stream = {'ptr': 11}
    monkeypatch.setattr(blas, 'loaded_cublas', lambda: Lib())
    monkeypatch.setattr(blas, 'own_handle', lambda: 7)
    monkeypatch.setattr(blas, '_current_stream', lambda: stream['ptr'])
    monkeypatch.setitem(blas._state, 'bound', {})
    run = lambda ws: blas._on_workspace(ws, 'cublasGemmEx', 1, 2)     # noqa: E731
    run((100, 32))
    run((100, 32))
    assert calls == [('stream', 11), ('workspace', 100, 32), ('gemm',), ('gemm',)]
    del calls[:]
    run((200, 32))
    assert calls == [('workspace', 200, 32), ('gemm',)]
    del calls[:]
    stream['ptr'] = 12
    run((200, 32))
    assert calls == [('stream', 12), ('workspace', 200, 32), ('gemm',)]
    # A failed call leaves nothing assumed: the next one sets its workspace again.
    del calls[:]
    monkeypatch.setattr(Lib, 'cublasSetWorkspace_v2', lambda self, h, p, n: 3)
    with pytest.raises(RuntimeError, match='cublasSetWorkspace'):
        run((300, 32))
    assert blas._state['bound'][7][1] is None
