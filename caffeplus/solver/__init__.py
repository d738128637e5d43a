"""caffeplus.solver: Caffe's solvers, learning-rate policies and snapshots.

    from caffeplus.solver import get_solver
    solver = get_solver('lenet_solver.prototxt')   # or a SolverParameter
    solver.solve()                                  # or solver.step(n)

Classes: SGDSolver, NesterovSolver, AdaGradSolver, RMSPropSolver,
AdaDeltaSolver, AdamSolver (pycaffe's names); `type` in the solver file picks
one (or the old `solver_type` enum).
"""
import os

from caffeplus.errors import CaffeplusError
from caffeplus.proto import caffe_pb2
from caffeplus.solver.solver import (ACTIONS, NONE, SNAPSHOT, STOP, Solver,  # noqa: F401
                                     read_solver_file, upgrade_snapshot_prefix)
from caffeplus.solver.types import solver_type_name  # noqa: F401
from caffeplus.solver.sgd import (SOLVERS, AdaDeltaSolver, AdaGradSolver,  # noqa: F401
                                  AdamSolver, NesterovSolver, RMSPropSolver, SGDSolver)

__all__ = ['get_solver', 'create_solver', 'solver_class', 'solver_type_name', 'read_solver_file',
           'upgrade_snapshot_prefix', 'Solver', 'SGDSolver', 'NesterovSolver', 'AdaGradSolver',
           'RMSPropSolver', 'AdaDeltaSolver', 'AdamSolver', 'SOLVERS', 'ACTIONS', 'NONE', 'STOP',
           'SNAPSHOT']

def solver_class(type_name):
    try:
        return SOLVERS[type_name]
    except KeyError:
        raise CaffeplusError('Unknown solver type: %s (known types: %s)'
                             % (type_name, ', '.join(sorted(SOLVERS))))


def get_solver(path_or_param, pycaffe=False, **kwargs):
    """The solver a SolverParameter (or solver prototxt path) describes.
    Its nets get caffeplus_param.memory_plan, by default 'shared';
    `pycaffe`: pycaffe's class of the solver (caffeplus.get_solver), whose
    default is 'stock' (caffeplus.pycaffe.pycaffe_solver_class)."""
    if isinstance(path_or_param, caffe_pb2.SolverParameter):
        param = path_or_param
    else:
        param = read_solver_file(os.fspath(path_or_param))
    type_name = solver_type_name(param)
    cls = solver_class(type_name)
    if pycaffe:
        from caffeplus.pycaffe_solvers import pycaffe_solver_class
        cls = pycaffe_solver_class(cls)
    if param.type != type_name:
        copy = caffe_pb2.SolverParameter()
        copy.CopyFrom(param)
        copy.ClearField('solver_type')
        copy.type = type_name
        param = copy
    if not isinstance(path_or_param, caffe_pb2.SolverParameter):
        kwargs.setdefault('solver_path', os.fspath(path_or_param))
    return cls(param, **kwargs)


create_solver = get_solver
