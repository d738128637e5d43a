"""`caffeplus memory`: estimates without a GPU, Caffe's own figures, charts,
`auto` under a budget, bad input; GPU measurements are gpu-marked."""
import contextlib
import json
import os
import re
import subprocess
import sys

import numpy
import pytest
from google.protobuf import text_format

import caffeplus
from caffeplus import config, precision
from caffeplus import cli
from caffeplus.blob import Blob
from caffeplus.errors import CaffeplusError
from caffeplus.memory import budget, cublas_pool, liveness, measure, shapes, workspace_model as wm
from caffeplus.memory.plan import CATEGORIES, PLANS, make_plan
from caffeplus.proto import caffe_pb2

from conftest import ROOT, SHARED

BENCH = os.path.join(SHARED, 'bench')
LENET = os.path.join(ROOT, 'examples', 'mnist', 'lenet_train_test.prototxt')


def bench(name):
    path = os.path.join(BENCH, name + '.prototxt')
    if not os.path.exists(path):
        pytest.fail('test data missing: %s' % path)
    return path


def memory(capsys, *argv):
    """Run `caffeplus memory ARGV` in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = cli.main(['memory'] + list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def memory_json(capsys, *argv):
    code, out, err = memory(capsys, '--estimate', '--json', *argv)
    assert code == 0, err
    return json.loads(out)


def caffe_figures():
    """{bench file stem: (Memory required for data, parameter bytes)} from
    the README's table of stock Caffe's log lines."""
    path = os.path.join(BENCH, 'README.md')
    if not os.path.exists(path):
        pytest.fail('test data missing')
    out = {}
    for line in open(path):
        m = re.match(r'^\|\s*([A-Za-z0-9-]+) (b\d+)\s*\|\s*([\d,]+)\s*\|\s*([\d,]+)\s*\|', line)
        if m:
            stem = (m.group(1).lower().replace('-', '') + '_' + m.group(2))
            out[stem] = (int(m.group(3).replace(',', '')), int(m.group(4).replace(',', '')))
    return out


def check_document(doc, plans=PLANS):
    assert set(doc['plans']) == set(plans)
    for name, entry in doc['plans'].items():
        assert set(entry['breakdown']) == set(CATEGORIES), name
        assert entry['peak_bytes'] == sum(entry['breakdown'].values()), name
        assert all(isinstance(v, int) and v >= 0 for v in entry['breakdown'].values())
        assert entry['iter_ms'] is None and entry['estimated'] is True
        assert entry['est_iter_ms'] > 0


# -- estimates on the CPU ----------------------------------------------------------------
def test_lenet_estimate_json_has_every_plan_and_category(capsys):
    doc = memory_json(capsys, '-model', LENET)
    check_document(doc)
    plans = doc['plans']
    assert doc['net'] == 'LeNet' and doc['batch'] == 64
    assert plans['shared']['peak_bytes'] < plans['stock']['peak_bytes']
    assert plans['offload']['offloaded']
    assert plans['offload']['peak_bytes'] <= plans['shared']['peak_bytes']
    # LeNet's parameters: 431,080 floats.
    assert plans['stock']['breakdown']['parameters'] == 431080 * 4
    # The placing plans name each convolution call's workspace; stock and
    # arena hold theirs outside any plan.
    assert plans['stock']['workspace_calls'] == plans['arena']['workspace_calls'] == {}
    calls = plans['shared']['workspace_calls']
    gemm = {'%s/%s' % (c, part) for c in ('ip1', 'ip2') for part in ('forward', 'backward')}
    assert set(calls) - gemm <= {'%s/%s' % (c, part) for c in ('conv1', 'conv2')
                                 for part in ('forward', 'backward', 'backward_filter')}
    assert all(isinstance(v, int) and v > 0 for v in calls.values())
    # and each InnerProduct call cuBLAS's (caffeplus.memory.cublas_pool)
    assert {k: calls[k] for k in gemm} == dict.fromkeys(gemm, 32 * 2 ** 20)
    # conv1's input needs no gradient: no backward-data call.
    assert 'conv1/backward' not in calls and 'conv2/backward' in calls


def test_text_table_names_every_plan_with_units(capsys):
    code, out, err = memory(capsys, '-model', LENET, '--estimate')
    assert code == 0, err
    lines = out.splitlines()
    assert 'estimated without a GPU' in lines[0]
    assert lines[1].split()[:2] == ['plan', 'peak']
    for name in PLANS:
        assert any(line.startswith(name + ' ') for line in lines), name
    assert 'MiB' in out


@pytest.mark.parametrize('net', ['alexnet_b128', 'googlenet_b64', 'resnet50_b32'])
def test_bench_nets_against_stock_caffe_figures(capsys, net):
    """Stock activations = Caffe's "Memory required for data" minus the tops
    Caffe counts again though they own no memory.

    Caffe's Net::Init adds every top's count as the layer is set up, so a
    top that aliases an earlier blob's data is counted twice: in-place tops
    (top == bottom: ReLU, Dropout, BatchNorm, Scale) and the tops of Split
    layers (which share their bottom's data, in Caffe and in caffeplus).
    The stock plan counts each data buffer once, so
        activations = figure - sum(bytes of in-place tops and Split tops).
    """
    figure, param_bytes = caffe_figures()[net]
    doc = memory_json(capsys, '-model', bench(net))
    check_document(doc)
    plans = doc['plans']
    stock = plans['stock']['breakdown']
    assert stock['parameters'] == param_bytes
    assert stock['parameter_diffs'] == param_bytes
    assert stock['solver_history'] == param_bytes         # SGD: one history blob each
    built = shapes.build_net(shapes.load_net_param(bench(net)))
    assert built.memory_used_bytes == figure              # caffeplus logs Caffe's figure
    aliased = 0
    for i, layer in enumerate(built.layers):
        for blob_id in built.top_id_vecs[i]:
            if blob_id in built.bottom_id_vecs[i] or layer.layer_param.type == 'Split':
                aliased += built._blobs[blob_id].count * 4
    assert aliased > 0
    assert stock['activations'] == figure - aliased
    # Diffs: at most one per distinct blob that is not an in-place alias.
    assert 0 < stock['activation_diffs'] <= figure - aliased + sum(
        built._blobs[b].count * 4 for i, l in enumerate(built.layers)
        if l.layer_param.type == 'Split' for b in built.top_id_vecs[i])
    assert plans['shared']['peak_bytes'] < plans['stock']['peak_bytes']
    assert plans['offload']['breakdown']['activations'] < \
        plans['shared']['breakdown']['activations']
    assert plans['offload']['peak_bytes'] <= plans['shared']['peak_bytes']
    assert plans['offload']['offloaded']
    # `auto` without a budget: the fastest plan, no slower than any other.
    auto_ms = plans['auto']['est_iter_ms']
    assert all(auto_ms <= p['est_iter_ms'] + 1e-6 for p in plans.values())
    # (Its workspace is the fastest's, not the knee's of the other plans.)
    assert plans['auto']['peak_bytes'] < plans['stock']['peak_bytes']


def test_batch_override_scales_activations_proportionally(capsys, monkeypatch):
    # (Every chain and sum made again: which ones keeping costs no peak
    # depends on the batch, recompute.prune.)
    _every_remake(monkeypatch)
    b32 = memory_json(capsys, '-model', bench('resnet50_b32'), '--plans', 'stock,shared')
    b64 = memory_json(capsys, '-model', bench('resnet50_b32'), '--plans', 'stock,shared',
                      '--batch', '64')
    assert b64['batch'] == 64
    s32, s64 = b32['plans']['stock']['breakdown'], b64['plans']['stock']['breakdown']
    for c in ('parameters', 'parameter_diffs', 'solver_history'):
        assert s64[c] == s32[c]
    for c in ('activations', 'activation_diffs'):
        # Every blob but the scalar loss scales with the batch.
        assert abs(s64[c] - 2 * s32[c]) <= 8, c
    shared32, shared64 = (d['plans']['shared']['breakdown'] for d in (b32, b64))
    # (The arena's shares at its peak: at b32 that is fc1000's forward step,
    # where cuBLAS's workspace lies beside the maps.)
    # The two peaks may fall at different steps, so within twice the fixed
    # bytes of cuBLAS's workspace that either may hold.
    total32, total64 = (s['activations'] + s['activation_diffs'] + s['workspace']
                        for s in (shared32, shared64))
    assert abs(total64 - 2 * total32) <= 2 * cublas_pool.modelled_arena_bytes('shared')
    # The override gives what the b64 file itself gives, and Caffe's b64 figure.
    file64 = memory_json(capsys, '-model', bench('resnet50_b64'), '--plans', 'stock,shared')
    assert file64['plans'] == b64['plans']
    figure64 = caffe_figures()['resnet50_b64'][0]
    built = shapes.build_net(shapes.load_net_param(bench('resnet50_b32'), batch=64))
    assert built.memory_used_bytes == figure64


def test_vgg16_b256_estimate_builds_in_little_memory():
    """The shape-only build: VGG-16 at batch 256 (14 GiB of activations)
    estimates in well under 1 GB of resident memory."""
    path = bench('vgg16_b256')
    # VmHWM is this process's own peak; ru_maxrss would carry the forking
    # pytest process's peak across exec on Linux.
    code = ('import json, re, sys\n'
            'from caffeplus import cli\n'
            'rc = cli.main(["memory", "-model", %r, "--estimate", "--json", '
            '"--plans", "stock,shared,offload"])\n'
            'hwm = re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)\n'
            'print("RSS", hwm, file=sys.stderr)\n'
            'sys.exit(rc)'
            % path)
    proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rss_kib = int(re.search(r'RSS (\d+)', proc.stderr).group(1))
    assert rss_kib < 1024 * 1024, 'peak RSS %d KiB' % rss_kib
    doc = json.loads(proc.stdout)
    stock = doc['plans']['stock']['breakdown']
    figure, params = caffe_figures()['vgg16_b256']
    assert stock['parameters'] == params
    assert stock['activations'] > 14 * 2 ** 30


def test_shape_only_build_is_virtual_and_switches_back():
    net = shapes.build_net(shapes.load_net_param(bench('alexnet_b128')))
    data = net.blobs['data'].data
    assert data.shape == (128, 3, 227, 227) and not any(data.strides)
    assert not any(net.params['fc6'][0].data.strides)
    # Outside the block storage is real again.
    blob = Blob((3, 4))
    assert blob.data.strides == (16, 4)
    blob.data = numpy.ones((3, 4))
    assert blob.data.sum() == 12


# -- charts --------------------------------------------------------------------------------
def test_plot_writes_bar_and_timeline_pngs(capsys, tmp_path):
    target = tmp_path / 'mem.png'
    code, out, err = memory(capsys, '-model', LENET, '--estimate', '--plot', str(target))
    assert code == 0, err
    for path in (target, tmp_path / 'mem_timeline.png'):
        with open(path, 'rb') as f:
            assert f.read(8) == b'\x89PNG\r\n\x1a\n'
        assert os.path.getsize(path) > 5000


def test_bar_of_a_settling_plan_is_its_steady_peak(tmp_path):
    """offload 'free' runs its first iterations as shared: its bar is the
    steady peak (the table's and the estimate's), "other" less the bytes
    only the first iterations held; a plan without a lower steady peak keeps
    its breakdown, and the chart is drawn from these."""
    from caffeplus.memory import report
    MiB = 2 ** 20
    breakdown = {c: 100 * MiB for c in CATEGORIES}
    free = {'peak_bytes': 700 * MiB, 'steady_peak_bytes': 640 * MiB, 'breakdown': breakdown}
    values, steady = report.bar_bytes(free)
    assert steady and sum(values.values()) == 640 * MiB and values['other'] == 40 * MiB
    shared = {'peak_bytes': 700 * MiB, 'steady_peak_bytes': 700 * MiB, 'breakdown': breakdown}
    assert report.bar_bytes(shared) == (breakdown, False)
    assert report.bar_bytes({'peak_bytes': 700 * MiB, 'breakdown': breakdown}) == \
        (breakdown, False)
    paths = report.plot(str(tmp_path / 'm.png'), {'shared': shared, 'offload': free})
    assert all(os.path.getsize(p) > 5000 for p in paths)


# -- auto and budgets --------------------------------------------------------------------
def test_parse_bytes_units():
    assert budget.parse_bytes('12G') == 12 * 2 ** 30
    assert budget.parse_bytes('800M') == 800 * 2 ** 20
    assert budget.parse_bytes('1.5GiB') == int(1.5 * 2 ** 30)
    assert budget.parse_bytes('512MB') == 512 * 2 ** 20
    assert budget.parse_bytes('1073741824') == 2 ** 30
    assert budget.parse_bytes(' 2 t ') == 2 * 2 ** 40
    for bad in ('lots', '', '-1G', '0', '1.5X', 'GiB', '1 2G'):
        with pytest.raises(CaffeplusError):
            budget.parse_bytes(bad)


def test_auto_fits_the_budget_and_trades_time_for_memory():
    net = shapes.build_net(shapes.load_net_param(bench('resnet50_b32')))
    options = budget.search(net)
    low, high = min(o.peak for o in options), max(o.peak for o in options)
    previous = None
    for fraction in (0.1, 0.5, 1.0):
        limit = int(low + fraction * (high - low))
        plan = budget.plan_for_budget(net, limit)
        assert plan.name == 'auto' and plan.peak_bytes <= limit
        if previous is not None:
            assert plan.est_iter_ms <= previous.est_iter_ms + 1e-9
        previous = plan
    # Option peaks are lower bounds (placement adds alignment and gaps); the
    # error names the smallest budget that fits once placed.
    with pytest.raises(CaffeplusError) as info:
        budget.plan_for_budget(net, low - 1)
    smallest = budget.parse_bytes(re.search(r'smallest budget that fits is (\S+)',
                                            str(info.value)).group(1))
    assert low <= smallest <= low * 1.05
    tight = budget.plan_for_budget(net, smallest)
    assert tight.offloaded and tight.peak_bytes <= smallest


def test_auto_under_a_budget_moves_no_more_than_it_needs(monkeypatch):
    """VGG-16 b256 under 12 GiB (planned within 98% of it), no convolution
    run again: the search's fastest set that fits moves maps; refined,
    fewer stay away, the placed plan still fits, and each refinement is
    faster than the plan before it."""
    monkeypatch.setattr(budget.recompute, 'CONV_TYPES', ())
    config.set('masks', '0')     # the search below sees the layers unmasked
    net = shapes.build_net(shapes.load_net_param(bench('vgg16_b256')))
    asked = budget.parse_bytes('12G')
    limit = int(asked * (1 - budget.BUDGET_MARGIN))
    space = budget.search_space(net, budget=limit)
    fits = sorted((o for o in budget.search(net, space=space) if o.peak <= limit),
                  key=lambda o: o.seconds)

    def place(option):
        return budget._auto_plan(net, option, 'SGD', (), True, budget=limit)
    first = next(o for o in fits if place(o).peak_bytes <= limit)
    steps = budget.refine(space, place(first), first, limit, place)
    assert steps
    times = [place(first).est_iter_ms] + [p.est_iter_ms for p in steps]
    assert all(b < a for a, b in zip(times, times[1:]))
    assert all(p.peak_bytes <= limit for p in steps)
    plan = budget.plan_for_budget(net, asked)
    assert plan.peak_bytes <= limit and plan.est_iter_ms <= times[-1] + 1e-6
    assert 0 < len(plan.offloaded) < len(first.offloaded)
    # Placed under a budget, each call gets the hole left at its step: the
    # runtime keeps every call within the bytes the plan placed for it.
    convs = [net._layer_names[i] for i, _ in budget.wm.conv_layers(net)]
    assert {name for name, _ in plan.call_workspace} == set(convs)
    views = {b.key[1:]: b.nbytes for b in plan.buffers if b.kind == 'workspace'}
    assert all(views.get(key, 0) == n for key, n in plan.call_workspace.items())


def test_impossible_budget_names_the_smallest_that_fits(capsys):
    code, out, err = memory(capsys, '-model', bench('alexnet_b128'), '--estimate',
                            '--plans', 'auto', '--budget', '100M')
    assert code == 1 and out == ''
    assert 'Traceback' not in err
    m = re.search(r'the smallest budget that fits is (\S+)', err)
    assert m, err
    # That budget works.
    doc = memory_json(capsys, '-model', bench('alexnet_b128'), '--plans', 'auto',
                      '--budget', m.group(1))
    assert doc['plans']['auto']['peak_bytes'] <= budget.parse_bytes(m.group(1))
    assert doc['plans']['auto']['fits_budget'] is True


# -- bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize('argv, message', [
    (['--plans', 'stock,tiny'], "unknown memory plan 'tiny'"),
    (['--keep', 'conv1,nope'], "no blob named 'nope'"),
    (['--budget', 'lots'], "cannot read 'lots' as a memory size"),
    (['--batch', '0'], '--batch must be positive'),
    (['--solver_type', 'Magic'], "unknown solver type 'Magic'"),
    (['--gpu', '0,1'], 'measured on one device'),
    (['--offload', 'conv1,nope', '--plans', 'offload'], "no blob named 'nope'"),
])
def test_bad_input_is_one_clear_line(capsys, argv, message):
    code, out, err = memory(capsys, '-model', LENET, '--estimate', *argv)
    assert code == 1
    assert message in err and 'Traceback' not in err
    assert err.startswith('caffeplus memory: error:')


HDF5_NET = """
name: "logreg"
layer { name: "data" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param { source: "nowhere/train.txt" batch_size: 10 } }
layer { name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1"
        inner_product_param { num_output: 2 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc1" bottom: "label" top: "loss" }
"""


def test_shape_flag_for_data_layers_without_a_known_shape(capsys, tmp_path):
    path = tmp_path / 'logreg.prototxt'
    path.write_text(HDF5_NET)
    code, out, err = memory(capsys, '-model', str(path), '--estimate')
    assert code == 1 and '--shape TOP=N,C,H,W' in err and 'pass shapes=' not in err
    doc = memory_json(capsys, '-model', str(path), '--shape', 'data=10,4',
                      '--shape', 'label=10', '--plans', 'stock')
    # data 10x4, label 10, fc1 10x2, loss 1: 40 + 10 + 20 + 1 floats.
    assert doc['plans']['stock']['breakdown']['activations'] == 71 * 4
    assert doc['plans']['stock']['breakdown']['parameters'] == (2 * 4 + 2) * 4
    code, out, err = memory(capsys, '-model', str(path), '--estimate', '--shape', 'data=10,x')
    assert code == 1 and "--shape must be TOP=N,C,H,W" in err


def test_missing_model_and_no_model(capsys, tmp_path):
    code, out, err = memory(capsys, '-model', str(tmp_path / 'none.prototxt'), '--estimate')
    assert code == 1 and 'not found' in err
    code, out, err = memory(capsys, '--estimate')
    assert code == 1 and '--model' in err


def test_cli_subprocess_error_has_no_traceback():
    proc = subprocess.run([sys.executable, '-m', 'caffeplus', 'memory', '-model', LENET,
                           '-estimate', '-plans', 'stock,bogus'], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "unknown memory plan 'bogus'" in proc.stderr and 'Traceback' not in proc.stderr


# -- the models ------------------------------------------------------------------------------
def test_stock_workspace_follows_caffes_8mb_rule():
    net = shapes.build_net(shapes.load_net_param(bench('alexnet_b128')))
    conv = dict((l.name, l) for _, l in wm.conv_layers(net))
    # conv2: 5x5, group 2, 48 input channels per group, 27x27 out, batch 128:
    # the column buffer of one group (48*25*27*27*128*4 bytes) exceeds 8 MB,
    # so each kind gets 8 MB; x group 2 x 3 streams.
    assert wm.stock_layer_workspace(conv['conv2']) == 8 * 2 ** 20 * 2 * 3
    assert wm.stock_handles(net) == 3 * (1 + 2 + 1 + 2 + 2)
    small = shapes.build_net(shapes.load_net_param(LENET, batch=1))
    conv1 = [l for _, l in wm.conv_layers(small)][0]
    # LeNet conv1 at batch 1: 1*25*24*24*4 = 57,600 bytes, under the limit.
    assert wm.stock_layer_workspace(conv1) == 57600 * 3


def test_arena_workspace_is_the_largest_fastest_need():
    net = shapes.build_net(shapes.load_net_param(bench('alexnet_b128')))
    needs = {l.name: wm.fastest(l).bytes for _, l in wm.conv_layers(net)}
    assert wm.arena_workspace(net) == max(needs.values())
    # conv1 is strided: cuDNN's implicit GEMM (no workspace) is its fastest
    # (measured on the H100), the explicit im2col GEMM a candidate behind it.
    assert needs['conv1'] == 0
    explicit = [c for c in wm.candidates(net.layers[[l.name for l in net.layers].index('conv1')])
                if c.name == 'explicit']
    assert explicit and explicit[0].bytes == 4 * 3 * 11 * 11 * 55 * 55 * 128
    # conv2 (5x5, stride 1): the transform, 2.25 x its input and output maps.
    assert needs['conv2'] == int(wm.TRANSFORM_FACTOR * 4 * 128 * (96 * 27 * 27 + 256 * 27 * 27))
    assert wm.arena_workspace(net, cap=0) == 0


def test_measuring_solver_applies_no_plan_of_its_own():
    # The plan measured is applied by measure itself; a solver's own 'shared'
    # arena built first would sit beside it (and alone exceed the GPU at
    # VGG-16 batch 1536).
    from caffeplus.solver import get_solver
    param = shapes.load_net_param(LENET, batch=2)
    solver = measure._solver(param, 'SGD', 1)
    assert solver.net.applied_plan is None
    sp = solver.param
    assert get_solver(sp).net.applied_plan is not None       # the default: 'shared'


def test_knee_cap_is_the_least_cap_within_tolerance_of_the_model():
    net = shapes.build_net(shapes.load_net_param(bench('vgg16_b64')))
    convs = [l for _, l in wm.conv_layers(net)]
    sites = [(wm.ConvShape(l).flops, wm.candidates(l, k)) for l in convs for k in wm.KINDS]

    def total(cap):
        return sum(f * min(c.time_factor for c in cands if c.bytes <= cap) for f, cands in sites)

    best = total(float('inf'))
    cap = wm.knee_cap(net, tolerance=0.03)
    assert total(cap) <= best * 1.03
    smaller = [c.bytes for _, cands in sites for c in cands if c.bytes < cap]
    assert all(total(b) > best * 1.03 for b in smaller
               if all(any(c.bytes <= b for c in cands) for _, cands in sites))
    # VGG-16's whole-batch transforms (conv1_2: 3.5 GB) against the same
    # over slices of the batch, a little slower in the model: a slicing wins.
    conv1_2 = dict((l.name, l) for l in convs)['conv1_2']
    assert wm.arena_workspace(net, cap) == wm.fastest(conv1_2, cap).bytes
    assert wm.fastest(conv1_2, cap).name.startswith('transform/')
    assert wm.arena_workspace(net, cap) < wm.arena_workspace(net) / 3
    assert wm.knee_cap(net, tolerance=-1) is None


def test_plan_applier_fallback_and_offload_refusal():
    net = shapes.build_net(shapes.load_net_param(LENET, batch=2))
    assert measure.apply_plan(net, make_plan(net, 'stock'))['applier'] in (
        'static', 'caffeplus.memory.apply')
    offload_plan = make_plan(net, 'offload', offload_policy='all')
    assert offload_plan.offloaded
    with pytest.raises(CaffeplusError, match="needs the GPU runtime's plan applier"):
        measure.apply_static(net, offload_plan, xp=numpy)


@pytest.mark.parametrize('model, batch', [(LENET, 8), ('googlenet_b64', 1)])
@pytest.mark.parametrize('applier', ['static', 'runtime'])
def test_shared_plan_in_a_real_arena_trains_identically(model, batch, applier, monkeypatch):
    """Every buffer of the shared plan placed at its offset in one NumPy
    arena: two training iterations give bit-identical losses and weights,
    so no buffer is overwritten while still needed. The static applier
    (measure.apply_static) has no hooks to make maps again in backward
    (caffeplus.memory.recompute): its plan has none; the runtime's does
    (GoogLeNet's norm1 and norm2, read again by the 3x3 convolutions)."""
    path = model if os.path.isabs(model) else bench(model)
    # `shared` makes nothing again by default; 1 asks it to (the runtime).
    config.set('recompute', '0' if applier == 'static' else '1')

    def train(plan_name):
        caffeplus.set_random_seed(5)
        param = shapes.load_net_param(path, batch=batch)
        with shapes.quiet():
            solver = measure._solver(param, 'SGD', 2)
        net = solver.net
        if plan_name:
            plan = make_plan(net, plan_name)
            if applier == 'static':
                assert not plan.recomputed
                info = measure.apply_static(net, plan, xp=numpy)
                assert info['arena'].nbytes >= plan.arena_bytes
            else:
                from caffeplus.memory import apply
                assert bool(plan.recomputed) == (model != LENET)
                apply.apply_plan(net, plan)
                assert net.applied_plan.arena_bytes > 0
        losses = []
        for _ in range(2):
            measure.run_iteration(net, solver)
            losses.append([float(net.blobs[n].data.sum()) for n in net.outputs])
        return losses, [p.data.copy() for p in net.learnable_params]

    plain_losses, plain_weights = train(None)
    shared_losses, shared_weights = train('shared')
    assert plain_losses == shared_losses
    for a, b in zip(plain_weights, shared_weights):
        assert numpy.array_equal(a, b)


# -- on the GPU ------------------------------------------------------------------------------
@pytest.mark.gpu
def test_peak_tracker_ignores_blocks_taken_before_it():
    # An array of earlier work freed while tracking (a garbage collection in
    # the measured run) once drove the pool's live count below zero.
    import cupy
    before = cupy.zeros(8 << 20, dtype='float32')
    with measure.PeakTracker() as tracker:
        del before
        now = cupy.zeros(1 << 20, dtype='float32')
        assert tracker.live == now.data.mem.size
        assert tracker.pool_peak == now.data.mem.size
        del now
        assert tracker.live == 0


@pytest.mark.gpu
def test_measure_plan_on_the_gpu():
    param = shapes.load_net_param(LENET)
    net = shapes.build_net(param)
    results = {}
    for name in ('stock', 'shared'):
        plan = budget.estimate_plan(net, name)
        r = measure.measure_plan(param, plan, 0)
        assert r['estimated'] is False and r['iter_ms'] > 0
        assert set(r['breakdown']) == set(CATEGORIES)
        assert r['peak_bytes'] >= r['pool_peak_bytes'] > 0
        params = sum(p.count for p in net.learnable_params) * 4
        assert r['breakdown']['parameters'] >= params
        # The per-step curve is the device's memory in use (the context
        # included: more than the pool's live bytes), below the peak, which
        # also counts the pool's cache.
        curve = r['live_curve']
        assert len(curve) == 2 * len(net.layers) + 1
        assert r['pool_peak_bytes'] < max(curve) <= r['peak_bytes']
        results[name] = r
    # (shared's pool holds cuBLAS's workspace for InnerProduct where stock's
    # cuBLAS holds its own outside the pool: caffeplus.memory.cublas_pool.)
    import cupy
    from caffeplus.memory import cublas_pool
    gemm = cublas_pool.arena_bytes('shared', cupy.cuda.Device().compute_capability)
    assert results['shared']['pool_peak_bytes'] <= results['stock']['pool_peak_bytes'] + gemm
    assert results['shared']['peak_bytes'] <= results['stock']['peak_bytes']


@pytest.mark.gpu
def test_measured_curve_keeps_the_fused_chains():
    """The stepped iteration that records the curve runs the GPU's fused
    BatchNorm-Scale-ReLU chains as a run without hooks does: a chain's
    members allocate nothing of their own, so the curve stays within the
    peak (unfused, ResNet-50's rose 2.5 GiB over `shared`'s peak)."""
    param = shapes.load_net_param(bench('resnet50_b32'), batch=8, phase=caffe_pb2.TRAIN)
    net = shapes.build_net(param)
    r = measure.measure_plan(param, budget.estimate_plan(net, 'shared'), 0)
    assert max(r['live_curve']) <= r['peak_bytes']


@pytest.mark.gpu
def test_memory_command_measures_with_the_estimate_beside(capsys):
    code, out, err = memory(capsys, '-model', LENET, '-gpu', '0', '--json',
                            '--plans', 'stock,shared')
    assert code == 0, err
    doc = json.loads(out)
    for entry in doc['plans'].values():
        assert entry['estimated'] is False and entry['iter_ms'] > 0
        assert entry['estimate']['peak_bytes'] > 0
    assert doc['plans']['stock']['workspace_calls'] == {}
    # The run's placed calls: the convolutions' (LeNet's timed algorithms may
    # need none) and, on Hopper, cuBLAS's for each InnerProduct call.
    import cupy
    from caffeplus.memory import cublas_pool
    calls = doc['plans']['shared']['workspace_calls']
    assert calls and all(v > 0 for v in calls.values())
    assert {k.split('/')[0] for k in calls} <= {'conv1', 'conv2', 'ip1', 'ip2'}
    gemm = cublas_pool.arena_bytes('shared', cupy.cuda.Device().compute_capability)
    if gemm:
        assert all(calls['%s/%s' % (n, p)] == gemm for n in ('ip1', 'ip2')
                   for p in ('forward', 'backward'))
    else:
        assert 'conv2/backward_filter' in calls


# The newest recorded GPU run of every plan on the four bench nets (H200,
# `caffeplus memory -gpu 0 --plans stock,arena,shared,offload --offload free
# --iterations 10 --json`, each plan in a process of its own): (folder,
# commit the run measured, plans). A plan's first listed run counts.
_MEMORY = os.path.join(ROOT, 'benchmarks', 'memory')
_RUNS = [('2026-12-04', '9d55be5', 'shared_offload'),
         ('2026-11-29-s22', '68f08d9', 'stock_arena_shared_offload')]
MEASURED = {net: [path for path in (os.path.join(_MEMORY, folder, '%s_memory_%s_%s.json'
                                                 % (commit, net, plans))
                                    for folder, commit, plans in _RUNS)
                  if os.path.exists(path)]
            for net in ('alexnet_b128', 'resnet50_b64', 'vgg16_b64', 'googlenet_b64')}
# Known misses, (net, plan): error; a miss listed here must stay no worse.
MISSED = {}
# Nets whose recorded runs predate the reusing plans' remade BatchNorm
# chains and residual sums (caffeplus.memory.recompute): their estimates
# are checked as those runs planned, with the remakes off.
BEFORE_REMAKES = {'resnet50_b64', 'resnet50_b256'}


def _as_recorded(net):
    return ('--recompute', 'off') if net in BEFORE_REMAKES else ()


def _every_remake(monkeypatch):
    """`shared` as if it made every chain and sum again (no
    recompute.prune), whatever keeping them would cost its peak."""
    from caffeplus.memory import recompute
    monkeypatch.setattr(recompute, 'prunes', lambda: False)


def _recorded(net):
    """{plan: its entry in the newest recorded run that measured it}."""
    plans = {}
    for path in MEASURED[net]:
        for name, entry in json.load(open(path))['plans'].items():
            plans.setdefault(name, entry)
    return plans


@pytest.mark.parametrize('net', sorted(MEASURED))
def test_estimates_within_five_percent_of_the_recorded_measurements(capsys, net):
    """The model against the H100's measured peaks committed with it
    (MEASURED): every plan within 5% (offload 'free': of its steady peak)."""
    measured = _recorded(net)
    doc = memory_json(capsys, '-model', bench(net), '--plans', 'stock,arena,shared,offload',
                      '--offload', 'free', *_as_recorded(net))
    for name, entry in doc['plans'].items():
        real = measured[name].get('steady_peak_bytes') or measured[name]['peak_bytes']
        error = (entry['peak_bytes'] - real) / float(real)
        if (net, name) in MISSED:     # still missed, and by no more than recorded
            assert 0.05 < abs(error) <= abs(MISSED[(net, name)]) + 1e-4, (name, error)
            continue
        assert abs(error) <= 0.05, (name, round(100 * error, 2))


def test_vgg16_b256_shared_estimate_within_five_percent_of_the_recorded_run(capsys):
    """At batch 256 (the budget benchmark's batch) too: VGG-16's `shared`
    against its H100 run (a model that priced transforms sliced over 128
    images above the whole batch's would be 6.8% over)."""
    path = os.path.join(_MEMORY, '2026-12-06-h100',
                        'bb6a753_memory_vgg16_b256_shared_auto_12G.json')
    real = json.load(open(path))['plans']['shared']['steady_peak_bytes']
    doc = memory_json(capsys, '-model', bench('vgg16_b64'), '--batch', '256',
                      '--plans', 'shared')
    error = (doc['plans']['shared']['peak_bytes'] - real) / float(real)
    assert abs(error) <= 0.05, round(100 * error, 2)


# The recorded FLOAT16 runs of `shared` (`caffeplus memory -gpu 0 --precision
# fp16 --plans shared --json`, H200; AlexNet's and GoogLeNet's with their
# 16-bit image convolution and ceil-rule max pooling channels-last): net ->
# (folder/file, the masks setting the run had).
FP16_RUNS = {
    'vgg16_b64': ('2026-12-03/1c5df3c_memory_fp16_vgg16_b64.json', 'plan'),
    'alexnet_b128': ('2026-12-05/811ffcc_memory_fp16_alexnet_b128.json', 'plan'),
    'resnet50_b64': ('2026-12-04/9d55be5_memory_fp16_resnet50_b64.json', 'plan'),
    'googlenet_b64': ('2026-12-05/811ffcc_memory_fp16_googlenet_b64.json', 'plan'),
    'alexnettv_b128': ('2026-12-06-h100/60c7045_memory_fp16_alexnettv_b128.json', 'plan'),
}


def _recorded_error(capsys, net, kind, name, *flags):
    """(estimate - recorded peak) / recorded peak of `shared` in `kind`
    against the run recorded in `name` (its steady peak where it has one)."""
    real = json.load(open(os.path.join(_MEMORY, name)))['plans']['shared']
    real = real.get('steady_peak_bytes') or real['peak_bytes']
    doc = memory_json(capsys, '-model', _bench_model(net)[0], '--plans', 'shared',
                      '--precision', kind, *flags)
    return (doc['plans']['shared']['peak_bytes'] - real) / float(real)


@pytest.mark.parametrize('net', sorted(FP16_RUNS))
def test_fp16_estimates_within_five_percent_of_the_recorded_measurements(capsys, net):
    """FLOAT16 `shared` against its recorded peak. The convolutions'
    workspace is modelled on their 16-bit maps (a model that priced them
    as FP32's transforms was 8.9% over on VGG-16 and 8.7% on AlexNet); the
    top AlexNet's and GoogLeNet's conv1 write channels-last and store in
    Caffe's order (71 MiB at AlexNet b128) from the modelled layout."""
    name, masks = FP16_RUNS[net]
    error = _recorded_error(capsys, net, 'fp16', name, '--masks', masks, *_as_recorded(net))
    assert abs(error) <= 0.05, round(100 * error, 2)


# `caffeplus memory -gpu 0 --precision bf16 --plans shared` on one H100
# (gpu_release_check.sh STEPS=memory MEMORY_PRECISION=bf16 MEMORY_PLANS=shared).
BF16_RUNS = {net: '2026-12-06-h100/a99c2e6_memory_bf16_%s.json' % net
             for net in ('alexnet_b128', 'alexnettv_b128', 'googlenet_b64', 'resnet50_b64',
                         'vgg16_b64')}


@pytest.mark.parametrize('net', sorted(BF16_RUNS))
def test_bf16_estimates_within_five_percent_of_the_recorded_measurements(capsys, net):
    """BFLOAT16 `shared` against its recorded peak, maps made again where
    that lowers it. The estimate masks as the GPU does (caffeplus.memory.masks):
    not VGG-16's pool5, a pooling between orders there (a plan masking it
    did not fit the GPU's net), and torchvision's AlexNet's overlapping
    pool1 and pool2, which the GPU runs on its argmax kernels. Timed search
    takes space-to-depth for the AlexNets' conv1 forward and filter gradient
    in BFLOAT16, which read the image as it is: the estimate counts no
    channels-last copy of it."""
    error = _recorded_error(capsys, net, 'bf16', BF16_RUNS[net])
    assert abs(error) <= 0.05, round(100 * error, 2)


@pytest.mark.parametrize('batch', ['64', '256'])
def test_fp16_resnet50_estimate_with_maps_made_again(capsys, batch):
    """ResNet-50 at b64 and b256 in FLOAT16 under `shared`, BatchNorm chains
    and residual sums made again where that lowers the peak, against its run
    on one H100 (`caffeplus memory -gpu 0 --precision fp16 --plans shared
    [--batch 256]`, channels-last maps): the estimate counts cuBLAS's buffer
    for the 1 x 1 convolutions, and its prune weighs BatchNorm's kept copies
    as the runtime's does (a runtime that left them out made 23 maps again
    where the estimate made 46, and peaked 1.9 GiB higher at b256)."""
    name = '321eb4c_memory_fp16_resnet50_b%s.json' % batch
    real = json.load(open(os.path.join(_MEMORY, '2026-12-06-h100', name)))['plans']['shared']
    real = real.get('steady_peak_bytes') or real['peak_bytes']
    doc = memory_json(capsys, '-model', bench('resnet50_b64'), '--batch', batch,
                      '--plans', 'shared', '--precision', 'fp16')
    assert doc['plans']['shared']['recomputed']
    error = (doc['plans']['shared']['peak_bytes'] - real) / float(real)
    assert abs(error) <= 0.05, round(100 * error, 2)


# bench_gpu's 16-bit run under `shared` behind the README's 16-bit table
# (whole-process peak, nvidia-smi's used memory; one H100), and its nets.
SIXTEEN_BIT_RUN = os.path.join(ROOT, 'benchmarks', 'gpu_16bit_prune_321eb4c_h100.json')
SIXTEEN_BIT_NETS = ('alexnet_b128', 'alexnettv_b128', 'googlenet_b64', 'resnet50_b256',
                    'resnet50_b64', 'vgg16_b64')


def _bench_model(net):
    """(prototxt, --batch) of a bench_gpu net name, by bench_gpu.net_source's
    rule: its own file, else its architecture's at another batch."""
    from benchmarks import bench_gpu
    path = bench_gpu._kept_prototxt(BENCH, net)
    if path is not None:
        return path, None
    arch, batch = bench_gpu.parse_net(net)
    return bench(arch + '_b64'), str(batch)


@pytest.mark.parametrize('kind', ['fp16', 'bf16'])
@pytest.mark.parametrize('net', SIXTEEN_BIT_NETS)
def test_sixteen_bit_estimates_within_five_percent_of_the_bench_runs(capsys, net, kind):
    """`--precision fp16|bf16`, plan `shared` (channels-last, maps made
    again), against bench_gpu's run of the same net, batch and type. That
    run updates after backward with no loss scaling (no solver), so every
    parameter gradient lives to the update: the estimate is made so too
    (update_in_backward off)."""
    real = next(r for r in json.load(open(SIXTEEN_BIT_RUN))
                if r['net'] == net and r['framework'] == 'caffeplus' and
                r['plan'] == 'shared:timed/' + kind)
    model, batch = _bench_model(net)
    with config.using(update_in_backward=False):
        doc = memory_json(capsys, '-model', model, '--plans', 'shared', '--precision', kind,
                          *(('--batch', batch) if batch else ()))
    measured = real['peak_used_mib'] * 2 ** 20
    error = (doc['plans']['shared']['peak_bytes'] - measured) / measured
    assert abs(error) <= 0.05, round(100 * error, 2)


def test_16_bit_convolutions_price_their_transforms_in_16_bit_bytes():
    """The model's workspace for a convolution over 16-bit maps: the
    transform in HALF_TRANSFORM_FACTOR times its 16-bit maps, the strided
    column buffer at two bytes a value; FP32's stay as they were."""
    def conv_layer(precision_name, stride):
        text = ('name: "n" layer { name: "d" type: "Input" top: "x" input_param { '
                'shape { dim: 8 dim: 16 dim: 28 dim: 28 } } } '
                'layer { name: "c" type: "Convolution" bottom: "x" top: "y" '
                'convolution_param { num_output: 32 kernel_size: 3 stride: %d } }' % stride)
        param = text_format.Parse(text, caffe_pb2.NetParameter())
        if precision_name:
            precision.override(param, precision_name)
        return shapes.build_net(param).layers[1]
    for stride in (1, 2):
        half, full = conv_layer('fp16', stride), conv_layer(None, stride)
        s16, s32 = wm.ConvShape(half), wm.ConvShape(full)
        assert (s16.itemsize, s32.itemsize) == (2, 4)
        assert s16.column_bytes * 2 == s32.column_bytes
        big16 = max(c.bytes for c in wm.candidates(half))
        big32 = max(c.bytes for c in wm.candidates(full))
        if stride == 1:
            maps = s16.in_count + s16.out_count
            assert big16 == int(wm.HALF_TRANSFORM_FACTOR * 2 * maps)
            assert big32 == int(wm.TRANSFORM_FACTOR * 4 * maps)
        else:
            assert (big16, big32) == (s16.column_bytes, s32.column_bytes)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize('net', ['alexnet_b128', 'resnet50_b32'])
def test_estimate_within_five_percent_of_the_measurement(capsys, net):
    """Each plan is measured in a process of its own, as the whole device's
    used memory: what this test process holds (its CUDA context, and what
    the GPU tests before it left cached: about 5 GB in a full run) is
    counted too, so it is freed as far as it can be, and what remains is
    taken off the measurement: the least this process held before and
    after the runs (what it let go meanwhile, its collector freeing a
    cycle, was not there at the children's peaks: in a full run of the GPU
    tests on the H200 AlexNet's `shared` came out 1,666 MiB against 1,701
    in a process of its own)."""
    import gc
    import cupy

    def held_by_this_process():
        gc.collect()
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
        cupy.cuda.Device(0).synchronize()
        free, total = cupy.cuda.runtime.memGetInfo()
        return total - free

    before = held_by_this_process()
    code, out, err = memory(capsys, '-model', bench(net), '-gpu', '0', '--json',
                            '--plans', 'stock,arena,shared')
    assert code == 0, err
    held_here = min(before, held_by_this_process())
    for name, entry in json.loads(out)['plans'].items():
        real = (entry.get('steady_peak_bytes') or entry['peak_bytes']) - held_here
        error = (entry['estimate']['peak_bytes'] - real) / float(real)
        assert abs(error) <= 0.05, (name, round(100 * error, 2), before, held_here)


# -- each measured plan in its own process ----------------------------------------------
def test_in_own_process_returns_the_result_and_the_error():
    from caffeplus.commands import memory as memory_command
    assert memory_command.in_own_process(memory_command.check_keep_names, 'a, b,') == ['a', 'b']
    with pytest.raises(CaffeplusError, match='-gpu must be one device ID'):
        memory_command.in_own_process(memory_command.parse_gpu, 'x')


def test_auto_offloads_no_more_than_the_host_budget(monkeypatch):
    # Without maps made again or masks: either fits 14 GiB unaided.
    config.set('recompute', '0')
    config.set('masks', '0')
    net = shapes.build_net(shapes.load_net_param(bench('vgg16_b64'), batch=256))
    free = budget.plan_for_budget(net, budget.parse_bytes('14G'))
    host = budget.offload.host_bytes(liveness.buffers(net), free.offloaded)
    assert host > 2 ** 30                                  # it offloads to fit 14 GiB
    capped = budget.plan_for_budget(net, budget.parse_bytes('40G'), host_budget=2 ** 30)
    assert budget.offload.host_bytes(liveness.buffers(net), capped.offloaded) <= 2 ** 30
    with pytest.raises(CaffeplusError, match=r'at most 1.00 GiB offloaded to host memory'):
        budget.plan_for_budget(net, budget.parse_bytes('14G'), host_budget=2 ** 30)
    assert budget.default_host_budget() is None or budget.default_host_budget() > 0


def test_table_shows_the_steady_peak_and_errs_against_it():
    """A measured plan whose run peak exceeds its settled peak (offload
    'free' measures as shared first) shows both; the estimate's error is
    against the settled one, as the JSON's estimate_error_pct."""
    from caffeplus.memory.report import format_table
    MiB = 2 ** 20
    breakdown = {'parameters': 100 * MiB}
    results = {'offload': {'peak_bytes': 1000 * MiB, 'steady_peak_bytes': 800 * MiB,
                           'breakdown': breakdown, 'iter_ms': 10.0, 'estimated': False,
                           'estimate': {'peak_bytes': 840 * MiB, 'breakdown': breakdown,
                                        'iter_ms': 9.0}},
               'shared': {'peak_bytes': 900 * MiB, 'steady_peak_bytes': 900 * MiB,
                          'breakdown': breakdown, 'iter_ms': 9.5, 'estimated': False}}
    text = format_table(results)
    assert '800.0 MiB  steady peak' in text and text.count('steady peak') == 1
    assert 'estimate (+5.0%)' in text


def test_free_offload_estimate_moves_only_what_hides(capsys):
    """`--offload free` estimates from the modelled step times: on ResNet-50
    some maps move, no time is added, and the peak is below `shared`'s but
    above what offloading every convolution input reaches."""
    path = bench('resnet50_b32')
    # (With its chains and sums made again nothing is left that moving
    # would lower the peak for: the offload plan then moves nothing.)
    free = memory_json(capsys, '-model', path, '--plans', 'shared,offload', '--offload',
                       'free', '--recompute', 'off')['plans']
    conv = memory_json(capsys, '-model', path, '--plans', 'offload', '--offload',
                       'all', '--recompute', 'off')['plans']['offload']
    remade = memory_json(capsys, '-model', path, '--plans', 'offload', '--offload',
                         'free')['plans']['offload']
    assert not remade['offloaded'] and remade['recomputed']
    shared, off = free['shared'], free['offload']
    assert off['offloaded'] and len(off['offloaded']) < len(conv['offloaded'])
    # (A map offloaded is not made again: no more time than shared's.)
    assert off['est_iter_ms'] <= shared['est_iter_ms'] + 1e-6
    assert conv['est_iter_ms'] > shared['est_iter_ms']
    assert conv['peak_bytes'] < off['peak_bytes'] < shared['peak_bytes']


def test_estimate_with_the_runs_workspace_reproduces_its_own_sizes(capsys, tmp_path):
    """dev/estimate_with_run_workspace.py puts a run's workspace sizes into
    the estimate: given the estimate's own sizes it gives the estimate back;
    given larger ones, a larger peak."""
    sys.path.insert(0, ROOT)
    from dev import estimate_with_run_workspace as tool
    doc = memory_json(capsys, '-model', LENET, '--plans', 'shared,offload')
    for entry in doc['plans'].values():
        entry['steady_peak_bytes'] = entry['peak_bytes']
    same = tmp_path / 'same.json'
    same.write_text(json.dumps(doc))
    assert tool.main([str(same), LENET, '--plans', 'shared', '--offload', 'conv']) == 0
    out = capsys.readouterr().out
    numbers = re.search(r'estimate +(\d+) \(([-+.\d]+)%\) +with the run\'s workspace +(\d+) '
                        r'\(([-+.\d]+)%\)', out)
    assert numbers and numbers.group(1) == numbers.group(3), out
    assert float(numbers.group(2)) == 0.0
    bigger = dict(doc)
    calls = doc['plans']['shared']['workspace_calls']
    bigger['plans']['shared']['workspace_calls'] = {k: v + 64 * 2 ** 20 for k, v in calls.items()}
    big = tmp_path / 'big.json'
    big.write_text(json.dumps(bigger))
    tool.main([str(big), LENET, '--plans', 'shared', '--offload', 'conv'])
    grown = re.search(r"with the run's workspace +(\d+)", capsys.readouterr().out)
    # (LeNet's peak was cuBLAS's 32 MiB at an InnerProduct step, which the
    # tool leaves as the estimate places it: a convolution's call now tops it.)
    assert int(grown.group(1)) >= int(numbers.group(3)) + 32


def test_time_plans_interleaves_the_plans_and_reports_ratios(capsys, monkeypatch):
    """benchmarks/time_plans.py: every plan timed once per round, the ratio to
    the first plan printed (the GPU benchmark for `shared` against `arena`)."""
    sys.path.insert(0, ROOT)
    from benchmarks import time_plans
    from caffeplus import config
    monkeypatch.setenv('CAFFEPLUS_CUDNN_SEARCH', 'auto')     # (the tool's default)
    monkeypatch.delenv('CAFFEPLUS_UPDATE_IN_BACKWARD', raising=False)
    built = []
    real = time_plans.plan_settings

    @contextlib.contextmanager
    def watch(settings):
        with real(settings):
            built.append(config.get('update_in_backward'))
            yield
    monkeypatch.setattr(time_plans, 'plan_settings', watch)
    with config.command_defaults():
        times = time_plans.main(['--net', LENET, '--plans',
                                 'arena,shared@update_in_backward=0', '--rounds', '3',
                                 '--iters', '1', '--warmup', '1'])
    # The setting holds while its solver is built, and not after.
    assert built == [True, False] and config.get('update_in_backward') is True
    assert time_plans.parse_plan('shared@A=1@B=x') == ('shared', {'A': '1', 'B': 'x'})
    with pytest.raises(SystemExit, match='not SETTING=VALUE'):
        time_plans.parse_plan('shared@oops')
    times['shared'] = times.pop('shared@update_in_backward=0')
    assert set(times) == {'arena', 'shared'}
    assert all(len(ms) == 3 and all(t > 0 for t in ms) for ms in times.values())
    out = capsys.readouterr().out
    ratio = re.search(r'shared@\S+ +[\d.]+ ms/iter .* x([\d.]+) of arena', out)
    assert ratio and float(ratio.group(1)) > 0, out


# -- the layer-time model against measured steps ----------------------------------------
# The step times offload 'free' measured on the H100 (dev/free_offload_probe.py
# --json): each layer's forward and backward seconds.
STEPS = os.path.join(_MEMORY, '2026-11-28-s13', 'steps_%s.json')


def _modelled_steps(net_name):
    param = shapes.load_net_param(bench(net_name), phase=caffe_pb2.TRAIN)
    net = shapes.build_net(param)
    cap = wm.knee_cap(net)
    steps = wm.step_seconds(net, {i: wm.fastest(l, cap) for i, l in wm.conv_layers(net)})
    return net, steps


@pytest.mark.parametrize('net_name', sorted(MEASURED))
def test_modelled_steps_sum_near_the_measured_ones(net_name):
    """Forward and backward, the modelled steps sum to within 15% of the
    measured ones (the old per-call overhead put ResNet-50's and GoogLeNet's
    iterations 24% over), and so do the convolutions' and the other layers'
    shares of each pass."""
    recorded = json.load(open(STEPS % net_name))
    net, steps = _modelled_steps(net_name)
    L = len(net.layers)
    assert recorded['names'] == [l.name for l in net.layers]
    modelled = {'forward': steps[:L], 'backward': steps[L:][::-1]}
    for pass_ in ('forward', 'backward'):
        real = recorded[pass_ + '_s']
        assert sum(modelled[pass_]) == pytest.approx(sum(real), rel=0.15), pass_
        convs = [wm.is_conv(l) for l in net.layers]
        for part in (True, False):
            mine = sum(t for t, c in zip(modelled[pass_], convs) if c == part)
            theirs = sum(t for t, c in zip(real, convs) if c == part)
            assert mine == pytest.approx(theirs, rel=0.3), (pass_, 'conv' if part else 'other')


def test_own_layer_times_follow_the_runtime():
    """Fused chains cost at their head, Split's forward shares its bottom,
    overlapping max pooling's backward scatters slower than VGG-16's 2 x 2."""
    net, steps = _modelled_steps('resnet50_b64')
    L = len(net.layers)
    by_name = {l.name: i for i, l in enumerate(net.layers)}
    bn, scale, relu = by_name['bn2a_branch2a'], by_name['scale2a_branch2a'], \
        by_name['res2a_branch2a_relu']
    for member in (scale, relu):
        assert steps[member] < 0.05 * steps[bn]
        assert steps[2 * L - 1 - member] < 0.05 * steps[2 * L - 1 - bn]
    split = next(i for i, l in enumerate(net.layers) if l.layer_param.type == 'Split')
    assert steps[split] < 1e-5 < steps[2 * L - 1 - split]
    pool = by_name['pool1']
    moved = wm._moved_bytes(net, pool) / wm.MEASURED_BANDWIDTH
    assert steps[2 * L - 1 - pool] > 4 * moved
    vgg, vsteps = _modelled_steps('vgg16_b64')
    vpool = [l.name for l in vgg.layers].index('pool1')
    vmoved = wm._moved_bytes(vgg, vpool) / wm.MEASURED_BANDWIDTH
    assert vsteps[2 * len(vgg.layers) - 1 - vpool] < 2.5 * vmoved


@pytest.mark.parametrize('plan_name', ['stock', 'shared', 'offload'])
def test_estimated_curve_peaks_at_the_estimated_peak(plan_name):
    """The timeline chart's estimated curve tops out at the plan's peak: a
    convolution's filter call (half a step early) and its data call share
    their workspace's bytes and count once (AlexNet's conv5 backward put the
    curve 211 MiB over the peak when both counted). A placed arena may
    exceed the most bytes live at once by what its placement cannot pack
    (AlexNet's estimated `free`, four maps moved: 1.1%)."""
    from caffeplus.commands.memory import estimate_curve
    net = shapes.build_net(shapes.load_net_param(bench('alexnet_b128'), phase=caffe_pb2.TRAIN))
    plan = budget.estimate_plan(net, plan_name, offload_policy='free')
    curve = estimate_curve(plan)
    assert plan.peak_bytes * 0.98 <= max(curve) <= plan.peak_bytes


def test_measuring_auto_plans_the_gradients_as_its_estimate(monkeypatch):
    """The measuring process plans `auto` again on the GPU: with the large
    gradients placed, as its estimate and a training solver have them (it
    planned without them, and refused AlexNet's 1.6 GiB that the estimate fits)."""
    from caffeplus.commands import memory as command
    monkeypatch.setattr(liveness, 'MIN_APPLIED_GRADIENT_BYTES', 0)
    param = shapes.load_net_param(LENET)
    seen = {}

    def fake_measure(net_param, plan, gpu, solver_type='SGD', iterations=1, apply=None):
        net = shapes.build_net(net_param)
        apply(net)
        seen['estimate'] = plan.param_diffs
        seen['applied'] = net.applied_plan.plan.param_diffs
        return {}
    monkeypatch.setattr(measure, 'measure_plan', fake_measure)
    opts = {'level': 0, 'stages': None, 'solver_type': 'SGD', 'keep': [], 'offload': 'conv',
            'budget': None, 'host_budget': None, 'iterations': 1}
    command._measure_child(param.SerializeToString(), 'auto', 0, opts)
    assert seen == {'estimate': True, 'applied': True}
    config.set('update_in_backward', '0')
    command._measure_child(param.SerializeToString(), 'auto', 0, opts)
    assert seen == {'estimate': False, 'applied': False}


# -- the estimate's table at a glance -----------------------------------------------------
ALEXNET_DEPLOY = os.path.join(SHARED, 'zoo', 'bvlc_caffe', 'models', 'bvlc_alexnet',
                              'deploy.prototxt')


def zoo(path):
    if not os.path.exists(path):
        pytest.fail('test data missing: %s' % path)
    return path


def table_cells(out):
    """The size cells of the estimate table's rows (plan name first)."""
    rows = [line for line in out.splitlines() if line.split()[:1] and
            line.split()[0] in PLANS and line.split()[-1] == 'estimate']
    return [re.findall(r'(-|\d+(?:\.\d+)? (?:B|KiB|MiB|GiB))(?=\s|$)', row) for row in rows]


def test_estimate_table_names_the_gpu_its_times_model(capsys):
    code, out, _ = memory(capsys, '-model', bench('alexnet_b128'), '--estimate')
    assert code == 0
    assert 'iter ms: modelled for an %s' % wm.MODEL_GPU in out
    assert 'H100' in wm.MODEL_GPU
    doc = memory_json(capsys, '-model', bench('alexnet_b128'), '--plans', 'shared')
    assert doc['model_gpu'] == wm.MODEL_GPU and doc['device_name'] is None


def test_estimate_says_what_other_holds(capsys):
    """ResNet-50 b64 `stock`'s 11.8 GiB of "other": the runtime (the
    measured fixed cost), Caffe's cuDNN handles (5 MiB each: 3 per
    convolution, 53 convolutions, and one per ReLU, pooling, softmax...),
    and Caffe's own layer buffers; the parts add up to the column."""
    doc = memory_json(capsys, '-model', bench('resnet50_b64'), '--plans', 'stock,shared')
    stock, shared = doc['plans']['stock'], doc['plans']['shared']
    for entry in (stock, shared):
        assert sum(entry['other_parts'].values()) == entry['breakdown']['other']
    assert stock['other_parts']['runtime'] == 660 * 2 ** 20
    handles = stock['other_parts']['cudnn_handles']
    assert handles % wm.HANDLE_BYTES == 0 and handles // wm.HANDLE_BYTES >= 3 * 53 + 49
    assert shared['other_parts']['cudnn_handles'] == 0
    assert stock['other_parts']['layer_buffers'] > 5 * 2 ** 30       # BatchNorm's, mostly
    code, out, _ = memory(capsys, '-model', bench('resnet50_b64'), '--estimate',
                          '--plans', 'stock,shared')
    assert 'other = runtime (CUDA context' in out
    assert re.search(r'^  stock\s+11\.8\d GiB = runtime 660\.0 MiB \+ cuDNN handles '
                     r'[\d.]+ (MiB|GiB) \+ layer buffers [\d.]+ GiB$', out, re.M), out
    assert re.search(r'^  shared\s+[\d.]+ GiB = runtime [\d.]+ MiB \+ layer buffers', out, re.M)


@pytest.mark.parametrize('model', ['deploy', 'googlenet_b64', 'vgg16_b64'])
def test_no_table_cell_shows_a_few_bytes(capsys, model):
    """A category with nothing shows '-', never the byte or two the shares'
    rounding leaves (AlexNet's deploy net showed '1 B' act diffs)."""
    path = zoo(ALEXNET_DEPLOY) if model == 'deploy' else bench(model)
    code, out, _ = memory(capsys, '-model', path, '--estimate')
    assert code == 0
    rows = table_cells(out)
    assert len(rows) == len(PLANS)
    for cells in rows:
        assert len(cells) == 1 + len(CATEGORIES), cells
        for cell in cells:
            assert cell == '-' or not cell.endswith(' B') and not cell.endswith('KiB') \
                or float(cell.split()[0]) >= 1, cells
    doc = memory_json(capsys, '-model', path)
    for entry in doc['plans'].values():
        b = entry['breakdown']
        assert all(v == 0 or v >= 1024 for v in b.values()), b
        assert sum(b.values()) == entry['peak_bytes']


def test_deploy_net_is_shown_without_gradients_or_solver_history(capsys):
    """A net without a loss (a deploy net: nothing to train, no solver) is
    planned forward only: its parameters, maps and workspace; a training
    net of the same layers keeps its history."""
    doc = memory_json(capsys, '-model', zoo(ALEXNET_DEPLOY))
    assert doc['training'] is False and doc['solver_type'] is None
    params = 60965224 * 4           # BVLC AlexNet's parameters
    for name, entry in doc['plans'].items():
        b = entry['breakdown']
        assert b['parameters'] == params, name
        assert b['parameter_diffs'] == b['solver_history'] == b['activation_diffs'] == 0, name
    code, out, _ = memory(capsys, '-model', zoo(ALEXNET_DEPLOY), '--estimate')
    assert 'forward only: no loss, so no gradients or solver history' in out
    assert all(cells[2] == cells[3] == '-' for cells in table_cells(out))
    train = memory_json(capsys, '-model', bench('alexnet_b128'), '--plans', 'shared')
    assert train['training'] is True
    assert train['plans']['shared']['breakdown']['solver_history'] == \
        train['plans']['shared']['breakdown']['parameters']


def test_measured_table_shows_the_whole_process_peak_beside_the_iterations():
    from caffeplus.memory import report
    GiB = 2 ** 30
    breakdown = dict.fromkeys(CATEGORIES, GiB)
    results = {'auto': {'peak_bytes': 7 * GiB, 'breakdown': breakdown, 'iter_ms': 80.0,
                        'estimated': False, 'startup_peak_bytes': 9 * GiB,
                        'process_peak_bytes': 9 * GiB, 'device_name': 'NVIDIA H200',
                        'estimate': {'peak_bytes': 7 * GiB, 'breakdown': breakdown,
                                     'iter_ms': 75.0,
                                     'other_parts': {'runtime': GiB}}}}
    table = report.format_table(results, 'title')
    assert re.search(r'^\s+9\.00 GiB\s+whole process, start-up included \(start-up 9\.00 GiB; '
                     r'training iterations 7\.00 GiB\)$', table, re.M), table
    notes = report.format_notes(results, measured_on='NVIDIA H200')
    assert 'iter ms: measured on NVIDIA H200; estimate rows model an %s' % wm.MODEL_GPU in notes
    assert re.search(r'^  auto\s+1\.00 GiB = runtime 1\.00 GiB$', notes, re.M), notes
