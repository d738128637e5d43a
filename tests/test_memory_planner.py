"""The memory planner: liveness, placement, plans — checked without a GPU."""
import numpy
import pytest

import caffeplus
from caffeplus.errors import CaffeplusError
from caffeplus.io.prototxt import parse_text
from caffeplus.memory import liveness, placement
from caffeplus.memory.plan import make_plan
from caffeplus.proto import caffe_pb2

MLP = '''
name: "mlp"
layer { name: "data" type: "Input" top: "x" top: "label"
        input_param { shape { dim: 8 dim: 32 } shape { dim: 8 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "h1" inner_product_param { num_output: 64 } }
layer { name: "sm1" type: "Softmax" bottom: "h1" top: "s1" }
layer { name: "ip2" type: "InnerProduct" bottom: "s1" top: "h2" inner_product_param { num_output: 64 } }
layer { name: "sm2" type: "Softmax" bottom: "h2" top: "s2" }
layer { name: "ip3" type: "InnerProduct" bottom: "s2" top: "h3" inner_product_param { num_output: 10 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "h3" bottom: "label" top: "loss" }
'''


def build(text=MLP):
    return caffeplus.Net(parse_text(text, caffe_pb2.NetParameter()), caffeplus.TRAIN)


def test_liveness_follows_declared_backward_reads():
    net = build()
    bufs = {b.blobs: b for b in liveness.buffers(net) if b.kind == 'data'}
    L = len(net.layers)
    # h1 is read by Softmax's forward only (Softmax's backward reads its top):
    h1 = bufs[('h1',)]
    assert h1.kind == 'data' and h1.end == net.layer_index('sm1')
    # s1 is read by ip2's backward (InnerProduct needs its bottom data) and,
    # later, by sm1's backward (Softmax needs its top):
    s1 = bufs[('s1',)]
    assert s1.end == 2 * L - 1 - net.layer_index('sm1')
    # label is an input: kept for the whole iteration.
    assert bufs[('label',)].end == 2 * L


def test_placement_never_overlaps_live_buffers():
    net = build()
    bufs = liveness.buffers(net)
    offsets, arena = placement.place(bufs)
    placement.validate(bufs, offsets)
    total = sum(placement._align(b.nbytes) for b in bufs)
    assert arena < total  # something was reused


def test_random_intervals_place_without_overlap():
    rng = numpy.random.default_rng(0)
    bufs = []
    for i in range(200):
        s = int(rng.integers(0, 50))
        bufs.append(liveness.Buffer(('b', i), 'data', ('b%d' % i,), int(rng.integers(1, 10000)),
                                    s, s + int(rng.integers(0, 20))))
    offsets, arena = placement.place(bufs)
    placement.validate(bufs, offsets)
    peak = max(liveness.live_bytes_by_step(bufs, 80))
    assert arena >= peak


def test_shared_plan_smaller_than_stock_and_breakdown_sums():
    net = build()
    stock = make_plan(net, 'stock')
    shared = make_plan(net, 'shared')
    assert shared.peak_bytes < stock.peak_bytes
    for plan in (stock, shared):
        assert plan.peak_bytes == sum(plan.breakdown.values())
    params = sum(p.count for p in net.learnable_params) * 4
    assert stock.breakdown['parameters'] == params
    assert stock.breakdown['solver_history'] == params
    assert make_plan(net, 'stock', solver_type='Adam').breakdown['solver_history'] == 2 * params


def test_unknown_plan_is_a_clear_error():
    with pytest.raises(CaffeplusError, match="unknown memory plan 'tiny'"):
        make_plan(build(), 'tiny')


def test_offload_keeps_backward_inputs_and_shrinks_the_peak():
    net = build()
    shared = make_plan(net, 'shared')
    off = make_plan(net, 'offload', offload_policy='all')
    assert off.offloaded, 'some feature map should be offloadable'
    assert off.peak_bytes <= shared.peak_bytes
    placement.validate(off.buffers, off.offsets)


def test_offload_unknown_blob_name():
    with pytest.raises(CaffeplusError, match="no blob named 'nope'"):
        make_plan(build(), 'offload', offload_policy=['nope'])
