"""The bundled example: LeNet on scikit-learn's digits reaches >= 95%."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip('sklearn')


@pytest.mark.slow
def test_digits_lenet_reaches_95_percent(tmp_path):
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
