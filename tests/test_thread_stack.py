"""The per-thread stack limit the plans run with (caffeplus.memory.thread_stack)."""
import os
import sys

import pytest

import caffeplus
from caffeplus.errors import CaffeplusError
from caffeplus.memory import shapes, thread_stack, workspace_model as wm
from conftest import ROOT, SHARED
from test_masks import vgg_like

sys.path.insert(0, ROOT)
from dev import check_plans_equal as cpe  # noqa: E402

ALEXNET = os.path.join(SHARED, 'bench', 'alexnet_b128.prototxt')


@pytest.fixture(autouse=True)
def _no_setting(monkeypatch):
    monkeypatch.setattr(thread_stack, 'LIMIT_FOR_PLACING_PLANS', None)
    monkeypatch.setattr(thread_stack, 'SETTLE', True)


def test_stock_keeps_cuda_default_and_the_other_plans_lower_it(monkeypatch):
    assert thread_stack.wanted_bytes('stock') == 1024
    for plan in ('arena', 'shared', 'offload', 'auto'):
        assert thread_stack.wanted_bytes(plan) == thread_stack.THREAD_STACK_BYTES < 1024
    monkeypatch.setattr(thread_stack, 'LIMIT_FOR_PLACING_PLANS', 0)
    assert thread_stack.wanted_bytes('shared') == 0
    assert thread_stack.wanted_bytes('stock') == 1024
    monkeypatch.setattr(thread_stack, 'LIMIT_FOR_PLACING_PLANS', 'default')
    assert thread_stack.wanted_bytes('shared') == 1024
    assert thread_stack.saved_bytes('shared') == 0


@pytest.mark.parametrize('value', [-1, 'lots', 1.5])
def test_a_bad_setting_is_a_clear_error(monkeypatch, value):
    monkeypatch.setattr(thread_stack, 'LIMIT_FOR_PLACING_PLANS', value)
    with pytest.raises(CaffeplusError, match="LIMIT_FOR_PLACING_PLANS must be a number of bytes"):
        thread_stack.wanted_bytes('shared')


def test_the_placing_plans_settle_lower_after_their_search(monkeypatch):
    for plan in ('shared', 'offload', 'auto'):
        assert thread_stack.settles(plan)
        assert thread_stack.modelled_bytes(plan) == thread_stack.SETTLED_MODEL_BYTES < 208
    for plan in ('stock', 'arena'):
        assert not thread_stack.settles(plan)
        assert thread_stack.modelled_bytes(plan) == thread_stack.wanted_bytes(plan)
    # a limit the user set is kept; so is the fixed one when settling is off
    monkeypatch.setattr(thread_stack, 'LIMIT_FOR_PLACING_PLANS', 512)
    assert not thread_stack.settles('shared') and thread_stack.modelled_bytes('shared') == 512
    monkeypatch.setattr(thread_stack, 'LIMIT_FOR_PLACING_PLANS', None)
    monkeypatch.setattr(thread_stack, 'SETTLE', False)
    assert not thread_stack.settles('offload')
    assert thread_stack.modelled_bytes('offload') == thread_stack.THREAD_STACK_BYTES
    assert not thread_stack.settle('offload')       # nothing to do, and no GPU touched


def test_the_estimate_counts_what_the_limit_saves(monkeypatch):
    """(1024 - 208) bytes for each of the H100's 132 x 2048 threads (at 256
    the 198 MiB that dev/context_probe.py measured); the placing plans
    (1024 - 160) once settled."""
    assert thread_stack.saved_bytes('arena') == 816 * 270336
    assert thread_stack.saved_bytes('shared') == 864 * 270336
    assert thread_stack.saved_bytes('stock') == 0
    if not os.path.exists(ALEXNET):
        pytest.fail('test data missing')
    net = shapes.build_net(shapes.load_net_param(ALEXNET))
    lower = wm.other_bytes(net, 'arena')
    monkeypatch.setattr(thread_stack, 'LIMIT_FOR_PLACING_PLANS', 'default')
    assert wm.other_bytes(net, 'arena') - lower == 816 * 270336


def test_a_sixteen_bit_net_is_estimated_at_its_kernels_smaller_stack():
    """Settled, a net whose convolutions run in 16 bits is modelled at
    SETTLED_MODEL_BYTES_16BIT (48 bytes less a thread than FP32's 160), the
    same net in FP32 at 160; the plans that do not settle are unchanged."""
    from caffeplus import precision
    if not os.path.exists(ALEXNET):
        pytest.fail('test data missing')
    assert thread_stack.modelled_bytes('shared', sixteen_bit=True) == 112
    assert thread_stack.modelled_bytes('arena', sixteen_bit=True) == 208
    param = shapes.load_net_param(ALEXNET)
    full = shapes.build_net(param)
    precision.override(param, 'fp16')
    half = shapes.build_net(param)
    assert wm.runtime_bytes('shared', full) - wm.runtime_bytes('shared', half) == 48 * 270336
    assert wm.runtime_bytes('shared', full) == wm.runtime_bytes('shared')
    assert wm.runtime_bytes('arena', full) == wm.runtime_bytes('arena', half)


@pytest.mark.gpu
def test_gpu_plans_set_the_limit_and_the_device_holds_less(monkeypatch):
    import cupy
    from caffeplus.memory.apply import apply_named_plan
    caffeplus.set_mode_gpu()
    try:
        net = caffeplus.Net(vgg_like(), caffeplus.TRAIN)
        props = cupy.cuda.runtime.getDeviceProperties(0)
        threads = props['multiProcessorCount'] * props['maxThreadsPerMultiProcessor']

        def used():
            cupy.cuda.Device().synchronize()
            free, total = cupy.cuda.runtime.memGetInfo()
            return total - free
        apply_named_plan(net, 'stock')
        assert thread_stack.current_bytes() == 1024
        at_stock = used()
        apply_named_plan(net, 'arena')
        assert thread_stack.current_bytes() == thread_stack.THREAD_STACK_BYTES
        # What stock's arrays free (put back in CuPy's pool, not the
        # device's) does not count here: the pool keeps them.
        assert at_stock - used() >= 0.9 * (1024 - thread_stack.THREAD_STACK_BYTES) * threads
    finally:
        caffeplus.set_mode_cpu()


@pytest.mark.gpu
def test_gpu_training_is_the_same_at_any_limit(monkeypatch):
    """A kernel that needs more stack than the limit gets it from the
    driver: training from stack 0 is bit-identical to CUDA's default."""
    param = vgg_like()
    monkeypatch.setattr(thread_stack, 'LIMIT_FOR_PLACING_PLANS', 'default')
    default = cpe.train(param, 'shared', 5, 0, gpu=0, math='deterministic')
    monkeypatch.setattr(thread_stack, 'LIMIT_FOR_PLACING_PLANS', 0)
    lowest = cpe.train(param, 'shared', 5, 0, gpu=0, math='deterministic')
    assert not cpe.differences(default, lowest), cpe.differences(default, lowest)


@pytest.mark.gpu
def test_gpu_a_timed_search_settles_the_limit_and_drops_the_graphs(monkeypatch):
    """After the placing plans' timed search the limit goes to 0 and every
    captured cuDNN graph is dropped; the next iterations raise the limit
    only as far as the chosen kernels need and capture their graphs again,
    and training goes on (the bits at any limit:
    test_gpu_training_is_the_same_at_any_limit)."""
    import math
    from caffeplus.cudnn import api
    monkeypatch.setenv('CAFFEPLUS_CUDNN_SEARCH', 'timed')
    calls = []
    real = api.clear_replays

    def clear():
        calls.append(api.graph_stats()['captured'])
        real()
    monkeypatch.setattr(api, 'clear_replays', clear)
    result = cpe.train(vgg_like(), 'offload', 8, 0, gpu=0)
    assert calls, 'the search did not settle the limit'
    assert thread_stack.current_bytes() < thread_stack.THREAD_STACK_BYTES
    assert api.graph_stats()['captured'] > calls[-1], 'no graph captured after settling'
    assert len(result.losses) == 8 and all(math.isfinite(v) for v in result.losses)
