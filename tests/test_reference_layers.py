"""Every stock-Caffe layer case in ../shared/reference/layers/ must match."""
import os

import pytest

from conftest import REFERENCE
from reference_cases import case_names, run_case

LAYERS = os.path.join(REFERENCE, 'layers')
CASES = case_names(LAYERS)


@pytest.mark.parametrize('case', CASES)
def test_reference_case(case):
    run_case(LAYERS, case)


def test_reference_cases_present():
    if not os.path.isdir(LAYERS):
        pytest.fail('test data missing at %s' % LAYERS)
    assert len(CASES) >= 120


@pytest.mark.parametrize('case', ['swl_two_tops_default_loss_weight',
                                  'swl_two_tops_explicit_loss_weight'])
def test_caffe_refuses_softmaxwithloss_two_tops(case):
    """Stock Caffe aborts building these nets (README quirk 1); so do we."""
    import caffeplus
    path = os.path.join(LAYERS, case + '.prototxt')
    if not os.path.exists(path):
        pytest.fail('test data missing')
    with pytest.raises(caffeplus.CaffeplusError, match='loss_weight'):
        caffeplus.Net(path, caffeplus.TRAIN)
