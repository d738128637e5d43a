"""A training iteration's passes as one CUDA graph (caffeplus.pass_graph):
which nets and iterations may be replayed, and on the GPU the same training,
bit for bit, as the eager passes."""
import numpy
import pytest
from google.protobuf import text_format

import caffeplus
from caffeplus import config, pass_graph
from caffeplus.layer import layer_types
from caffeplus.proto import caffe_pb2

# A residual block (BatchNorm -> Scale -> ReLU, Eltwise SUM over a Split),
# pooling and an InnerProduct; DummyData draws a new batch every iteration,
# so a replay must read the data layer's fresh tops.
NET = """
name: "graphed"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 8 dim: 3 dim: 16 dim: 16 } shape { dim: 8 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 bias_term: false
    weight_filler { type: "msra" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "sc1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 bias_term: false
    weight_filler { type: "msra" } } }
layer { name: "bn2" type: "BatchNorm" bottom: "conv2" top: "conv2" }
layer { name: "sc2" type: "Scale" bottom: "conv2" top: "conv2" scale_param { bias_term: true } }
layer { name: "sum" type: "Eltwise" bottom: "conv1" bottom: "conv2" top: "sum" }
layer { name: "relu2" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "pool" type: "Pooling" bottom: "sum" top: "pool"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


DROPOUT = NET.replace('layer { name: "pool"', 'layer { name: "drop" type: "Dropout" '
                      'bottom: "sum" top: "sum" }\nlayer { name: "pool"')
ABSVAL = NET.replace('layer { name: "pool"', 'layer { name: "abs" type: "AbsVal" '
                     'bottom: "sum" top: "sum" }\nlayer { name: "pool"')


def _net_param(text=NET):
    return text_format.Parse(text, caffe_pb2.NetParameter())


def _solver(graphs, precision='', plan='shared', text=NET, in_backward=False, math='',
            **fields):
    p = caffe_pb2.SolverParameter()
    p.net_param.CopyFrom(_net_param(text))
    p.base_lr, p.momentum, p.weight_decay = 0.05, 0.9, 1e-4
    p.lr_policy, p.gamma, p.stepsize = 'step', 0.5, 2
    p.max_iter, p.display, p.random_seed = 100, 0, 7
    p.snapshot_after_train = False
    cp = p.caffeplus_param
    cp.memory_plan, cp.update_in_backward, cp.cuda_graphs = plan, in_backward, graphs
    if precision:
        cp.precision = precision
    if math:
        cp.math = math
    for k, v in fields.items():
        setattr(p, k, v)
    return caffeplus.get_solver(p)


def _train(solver, iters):
    losses = []
    for _ in range(iters):
        solver.step(1)
        losses.append(float(solver.smoothed_loss))
    net = solver.net
    state = [b.data.get().tobytes() if hasattr(b.data, 'get') else b.data.tobytes()
             for layer in net.layers for b in layer.blobs]
    return losses, state


# -- which nets and iterations (no GPU needed) ------------------------------------------
def test_the_capturable_types_are_layer_types():
    assert pass_graph.CAPTURABLE <= set(layer_types())


def test_data_layers_run_eagerly_and_the_rest_is_checked():
    net = caffeplus.Net(_net_param(), caffe_pb2.TRAIN)
    first = pass_graph.first_compute_layer(net)
    assert net._layer_names[first] == 'conv1'
    assert pass_graph.layer_blockers(net, first) == []
    net = caffeplus.Net(_net_param(ABSVAL), caffe_pb2.TRAIN)
    assert pass_graph.layer_blockers(net, 1) == \
        ['layer types not known to be capturable: AbsVal']


def test_a_hook_not_marked_graph_safe_blocks_the_graph():
    net = caffeplus.Net(_net_param(), caffe_pb2.TRAIN)
    assert pass_graph.hook_blockers(net) == []

    def count_layers(i):
        pass
    net.after_layer_forward.append(count_layers)
    why = pass_graph.hook_blockers(net)
    assert len(why) == 1 and 'count_layers' in why[0] and 'after_layer_forward' in why[0]
    count_layers.graph_safe = True
    assert pass_graph.hook_blockers(net) == []


def test_the_cpu_trains_eagerly_whatever_the_setting():
    a = _train(_solver(True), 4)
    b = _train(_solver(False), 4)
    assert a == b
    solver = _solver(True)
    assert solver.start_gradients(graphs=True) is None


def test_the_setting_reads_the_solver_field_and_the_environment(monkeypatch):
    p = caffe_pb2.SolverParameter()
    assert pass_graph.enabled(p) is True
    p.caffeplus_param.cuda_graphs = False
    assert pass_graph.enabled(p) is False
    with config.using(cuda_graphs='0'):
        assert pass_graph.enabled(caffe_pb2.SolverParameter()) is False


# -- on the GPU ---------------------------------------------------------------------------
def _graph_of(solver):
    return solver._graph


@pytest.mark.gpu
@pytest.mark.parametrize('precision', ['', 'fp16', 'bf16'])
@pytest.mark.parametrize('plan', ['stock', 'shared'])
@pytest.mark.parametrize('text', [NET, DROPOUT], ids=['resnet', 'dropout'])
def test_replayed_iterations_train_as_the_eager_ones_bit_for_bit(gpu, precision, plan, text):
    """Eight SGD steps (the learning rate halves every two): the losses, the
    weights and the BatchNorm statistics of the graphed run are the eager
    run's (with Dropout, each replay draws the eager run's new masks); the
    graph was captured once and replayed from then on."""
    if precision == 'bf16':
        pytest.importorskip('ml_dtypes')
    runs = {}
    for graphs in (False, True):
        solver = _solver(graphs, precision, plan, text=text)
        runs[graphs] = _train(solver, 8)
        g = _graph_of(solver)
        if graphs:
            assert g is not None and g.off is None, g and g.off
            assert g.captures >= 1 and g.replays >= 8 - pass_graph.WARMUP - 2 * g.captures
        else:
            assert g is None
    assert runs[True] == runs[False]
    assert all(numpy.isfinite(runs[True][0]))


@pytest.mark.gpu
def test_a_replay_keeps_the_scratch_it_captured_when_another_ask_replaces_it(gpu):
    """After the capture every shared scratch buffer (BatchNorm's partial
    sums among them) is replaced by a larger one, as another net's larger
    ask would, and the old one's memory scribbled over by new allocations:
    the replays still train as the eager run does."""
    import cupy
    from caffeplus import backend
    runs = {}
    for graphs in (False, True):
        solver = _solver(graphs, 'fp16')    # channels-last BatchNorm: partial sums
        first = _train(solver, 4)
        if graphs:
            g = _graph_of(solver)
            assert g.captures == 1 and len(g._scratch) > 0
            for key, buf in list(backend._SCRATCH.items()):
                backend.device_scratch(key[0], 2 * buf.size + 1024, key[2])
            noise = [cupy.full(buf.size, 7, buf.dtype) for buf in g._scratch]
        second = _train(solver, 4)
        runs[graphs] = (first, second)
    assert runs[True] == runs[False]
    assert noise


@pytest.mark.gpu
@pytest.mark.parametrize('precision', ['', 'bf16'])     # (FP16's loss scaler keeps gradients)
@pytest.mark.parametrize('solver_type', ['SGD', 'Adam'])
def test_updates_in_backward_are_replayed_with_their_learning_rate(gpu, precision,
                                                                   solver_type, monkeypatch):
    """Plan `shared` updating each parameter in backward: the updates are
    captured with the pass and a new learning rate (every four steps)
    captures again; Adam's bias correction, new every step, keeps the passes eager.
    Either way the training is the eager one's, bit for bit."""
    if precision == 'bf16':
        pytest.importorskip('ml_dtypes')
    from caffeplus.memory import liveness
    monkeypatch.setattr(liveness, 'MIN_APPLIED_GRADIENT_BYTES', 0)    # this net's too
    runs = {}
    for graphs in (False, True):
        solver = _solver(graphs, precision, in_backward=True, type=solver_type, stepsize=4)
        assert solver.in_backward is not None
        runs[graphs] = _train(solver, 9)
        assert solver.in_backward.ready()
        if graphs:
            g = _graph_of(solver)
            assert g.off is None
            assert (g.captures >= 1 and g.replays >= 1) if solver_type == 'SGD' else \
                g.captures == 0
    assert runs[True] == runs[False]


@pytest.mark.gpu
def test_a_loss_scale_change_captures_again(gpu):
    """An adaptive FP16 scale that moves: each new scale gets its own
    capture, and the training stays the eager one's."""
    runs = {}
    for graphs in (False, True):
        solver = _solver(graphs, 'fp16')
        losses = []
        for it in range(9):
            if it in (4, 7):
                solver.loss_scaler.net_precision.scale /= 2
            solver.step(1)
            losses.append(float(solver.smoothed_loss))
        runs[graphs] = losses, [p.data.get().tobytes() for p in solver.net.learnable_params]
        if graphs:
            assert _graph_of(solver).captures >= 2
    assert runs[True] == runs[False]


@pytest.mark.gpu
def test_a_layer_that_cannot_be_captured_runs_eagerly_with_a_reason(gpu, monkeypatch,
                                                                    caplog_caffeplus):
    """Accuracy reads its count back to the host: let into the capture, it
    fails it; graphs go off for the net, said once, and training goes on as
    eager training does."""
    text = NET + ('layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" '
                  'top: "acc" }\n')
    monkeypatch.setattr(pass_graph, 'CAPTURABLE', pass_graph.CAPTURABLE | {'Accuracy'})
    runs = {}
    for graphs in (False, True):
        solver = _solver(graphs, text=text)
        runs[graphs] = _train(solver, 5)
    g = _graph_of(solver)
    assert g.off and g.off.startswith('capture failed') and g.captures == 0
    said = [m for m in caplog_caffeplus if 'CUDA graphs' in m]
    assert len(said) == 1 and 'runs eagerly: capture failed' in said[0]
    assert runs[True] == runs[False]


@pytest.mark.gpu
def test_a_net_with_an_unknown_layer_says_why_it_runs_eagerly(gpu, caplog_caffeplus):
    solver = _solver(True, text=ABSVAL)
    _train(solver, 3)
    said = [m for m in caplog_caffeplus if 'CUDA graphs' in m]
    assert said == ['CUDA graphs: the train net runs eagerly: layer types not known to be '
                    'capturable: AbsVal']
    assert _graph_of(solver).captures == 0


def _bench_net(name, batch):
    """A bench net (tests/data/bench, benchmarks/nets) at a small batch."""
    import os
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, 'tests', 'data', 'bench', name + '.prototxt')
    if not os.path.exists(path):
        path = os.path.join(root, 'benchmarks', 'nets', name + '.prototxt')
    with open(path) as f:
        return re.sub(r'(shape\s*\{\s*dim:\s*)\d+', r'\g<1>%d' % batch, f.read())


@pytest.mark.gpu
@pytest.mark.parametrize('name,batch', [('resnet50_b32', 4), ('googlenet_b64', 4),
                                        ('alexnet_b128', 8), ('alexnettv_b128', 8)])
def test_the_bench_nets_replay_their_eager_training_bit_for_bit(gpu, name, batch):
    """ResNet-50, GoogLeNet (Concat, three losses, Dropout) and both
    AlexNets (LRN, groups, Dropout) in FLOAT16 under `shared` with updates
    in backward, as `caffeplus train` runs them: six steps, replayed, give
    the eager run's losses, weights and statistics. Deterministic math: the
    AlexNets' and GoogLeNet's fastest weight-gradient algorithms sum with
    atomics, so two eager runs differ in the last bits."""
    runs = {}
    for graphs in (False, True):
        solver = _solver(graphs, 'fp16', text=_bench_net(name, batch), in_backward=True,
                         math='deterministic', stepsize=100, base_lr=0.001)
        runs[graphs] = _train(solver, 6)
        if graphs:
            g = _graph_of(solver)
            assert g.off is None and g.captures >= 1, (g.off, g.captures)
    assert runs[True] == runs[False]
    assert all(numpy.isfinite(runs[True][0]))
