"""One cuBLAS workspace buffer instead of two (caffeplus.memory.cublas_pool)."""
import os
import subprocess
import sys
import types

import numpy
import pytest

from caffeplus.memory import cublas_pool, shapes, thread_stack, workspace_model as wm
from conftest import ROOT, SHARED

ALEXNET = os.path.join(SHARED, 'bench', 'alexnet_b128.prototxt')
PROBE = os.path.join(ROOT, 'tools', 'cublas_workspace_probe.py')


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
        pytest.skip('needs ../shared/bench')
    net = shapes.build_net(shapes.load_net_param(ALEXNET))
    assert cublas_pool.saved_bytes('stock') == 0
    assert cublas_pool.saved_bytes('shared') == 32 * 2 ** 20
    # the same thread stack for arena and shared: the difference is the
    # layers' internals alone, and stock's other has no cuBLAS saving in it
    assert wm.other_bytes(net, 'arena') == wm.RUNTIME_BYTES - \
        (1024 - thread_stack.THREAD_STACK_BYTES) * 132 * 2048 - 32 * 2 ** 20 + wm.internals(net)


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
