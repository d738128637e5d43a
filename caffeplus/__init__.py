"""caffeplus: a Caffe-compatible training framework that spends far less GPU memory.

`import caffeplus as caffe` gives pycaffe's API.
"""
from caffeplus.backend import set_mode_cpu, set_mode_gpu, set_device  # noqa: F401
from caffeplus.errors import CaffeplusError  # noqa: F401
from caffeplus.layer import layer_types
from caffeplus.net import Net, TRAIN, TEST  # noqa: F401
from caffeplus.rng import set_random_seed  # noqa: F401

__version__ = '0.1.0'


def layer_type_list():
    return layer_types()
