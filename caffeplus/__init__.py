"""caffeplus: a Caffe-compatible training framework that spends far less GPU memory.

`import caffeplus as caffe` gives pycaffe's API.
"""
import importlib

from caffeplus.backend import set_mode_cpu, set_mode_gpu, set_device  # noqa: F401
from caffeplus.errors import CaffeplusError  # noqa: F401
from caffeplus.layer import layer_types
from caffeplus.net import Net, TRAIN, TEST  # noqa: F401
from caffeplus.pycaffe import (Layer, install_caffe_alias,  # noqa: F401
                               python_layers_allowed, set_python_layers_allowed)
from caffeplus.rng import set_random_seed  # noqa: F401

__version__ = '0.1.0'


def layer_type_list():
    return layer_types()


# pycaffe's other names, loaded on first use (PEP 562) so `import caffeplus`
# stays light and does not import the solvers, layers, Pillow or pydot.
_SOLVER_NAMES = ('get_solver', 'SGDSolver', 'NesterovSolver', 'AdaGradSolver',
                 'RMSPropSolver', 'AdaDeltaSolver', 'AdamSolver')
_LAZY = {
    'NetSpec': ('caffeplus.net_spec', 'NetSpec'),
    'to_proto': ('caffeplus.net_spec', 'to_proto'),
    'params': ('caffeplus.net_spec', 'params'),
    'Classifier': ('caffeplus.classifier', 'Classifier'),
    'Detector': ('caffeplus.detector', 'Detector'),
}
# pycaffe's process-wide functions (caffeplus.pycaffe_runtime).
for _name in ('init_log', 'Timer', 'NCCL', 'has_nccl', 'solver_count', 'set_solver_count',
              'solver_rank', 'set_solver_rank', 'set_multiprocess'):
    _LAZY[_name] = ('caffeplus.pycaffe_runtime', _name)
del _name
_SUBMODULES = ('io', 'layers', 'draw', 'net_spec', 'classifier', 'detector', 'proto',
               'solver', 'pycaffe', 'coord_map')


def _solver_attr(name):
    """pycaffe's solvers: the 'stock' memory plan unless the solver file
    names one (caffeplus.pycaffe.pycaffe_solver_class)."""
    solver = importlib.import_module('caffeplus.solver')
    from caffeplus import pycaffe
    pycaffe.attach_solver_helpers(solver.Solver)
    if name == 'get_solver':
        return pycaffe.get_solver
    return pycaffe.pycaffe_solver_class(getattr(solver, name))


def __getattr__(name):
    if name in _SOLVER_NAMES:
        value = _solver_attr(name)
    elif name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
    elif name in _SUBMODULES:
        value = importlib.import_module('caffeplus.' + name)
    else:
        raise AttributeError("module 'caffeplus' has no attribute '%s'" % name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_SOLVER_NAMES) | set(_LAZY) | set(_SUBMODULES))
