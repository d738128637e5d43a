"""The bundled examples: LeNet on scikit-learn's digits reaches >= 95%; the
CIFAR10-full net beside it is BVLC's but for its data."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_digits_lenet_reaches_95_percent(tmp_path):
    pytest.importorskip('sklearn')
    work = tmp_path / 'repo'
    (work / 'examples').mkdir(parents=True)
    shutil.copytree(os.path.join(ROOT, 'examples', 'digits'), work / 'examples' / 'digits',
                    ignore=shutil.ignore_patterns('*_lmdb', 'lenet_iter_*'))
    subprocess.check_call([sys.executable, 'examples/digits/make_digits_lmdb.py'], cwd=work)
    solver = (work / 'examples/digits/lenet_solver.prototxt').read_text()
    # 500 iterations are enough for 95%; keep CI quick.
    solver = solver.replace('max_iter: 1000', 'max_iter: 500')
    (work / 'examples/digits/short_solver.prototxt').write_text(solver)
    proc = subprocess.run([sys.executable, '-m', 'caffeplus', 'train', '--solver',
                           'examples/digits/short_solver.prototxt'], cwd=work,
                          capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    accuracies = [float(a) for a in re.findall(r'Test net output #0: accuracy = ([0-9.eE+-]+)', log)]
    assert accuracies and accuracies[-1] >= 0.95, accuracies
    assert 'Optimization Done.' in log
    assert (work / 'examples/digits/lenet_iter_500.caffemodel').exists()
    assert (work / 'examples/digits/lenet_iter_500.solverstate').exists()


def test_cifar10_full_on_the_digits_is_bvlcs_net_but_for_its_data():
    """examples/digits/cifar10_full_train_test.prototxt: every layer BVLC's
    CIFAR10-full file has, as it has it, but the two data layers' source,
    mean (a value for the file) and the test batch."""
    from google.protobuf import text_format
    from caffeplus.proto import caffe_pb2

    def read(path):
        return text_format.Parse(open(path).read(), caffe_pb2.NetParameter())
    ours = read(os.path.join(ROOT, 'examples', 'digits', 'cifar10_full_train_test.prototxt'))
    bvlc = read(os.path.join(ROOT, 'tests', 'data', 'zoo', 'bvlc_caffe', 'examples', 'cifar10',
                             'cifar10_full_train_test.prototxt'))
    assert [lp.name for lp in ours.layer] == [lp.name for lp in bvlc.layer]
    for mine, theirs in zip(ours.layer, bvlc.layer):
        if theirs.type != 'Data':
            assert mine == theirs, mine.name
            continue
        assert list(mine.transform_param.mean_value) == [57]
        assert not mine.transform_param.HasField('mean_file')
        assert mine.data_param.source.startswith('examples/digits/digits_')
        assert mine.data_param.batch_size == (100 if mine.include[0].phase == caffe_pb2.TRAIN
                                              else 99)
        for m in (mine, theirs):
            m.ClearField('transform_param')
            m.data_param.ClearField('source')
            m.data_param.ClearField('batch_size')
        assert mine == theirs
    solver = os.path.join(ROOT, 'examples', 'digits', 'cifar10_full_solver.prototxt')
    from caffeplus.solver import read_solver_file
    p = read_solver_file(solver)
    assert p.net == 'examples/digits/cifar10_full_train_test.prototxt'
    assert (p.base_lr, p.momentum, p.weight_decay, p.lr_policy) == \
        (pytest.approx(0.001), pytest.approx(0.9), pytest.approx(0.004), 'fixed')
    assert p.test_iter[0] * 99 == 297
