"""pycaffe's faces of the solver classes (caffeplus.SGDSolver, ...)."""


_PYCAFFE_SOLVERS = {}


def pycaffe_solver_class(base):
    """pycaffe's face of solver class `base` (caffeplus.SGDSolver, ...): the
    same solver, except that without caffeplus_param.memory_plan in the
    solver file its nets use the 'stock' memory plan, so that a script can
    read every solver.net.blobs[...] after solver.step() as with Caffe
    (`caffeplus train` and caffeplus.solver.get_solver default to 'shared',
    which releases intermediate blobs after their last use)."""
    cls = _PYCAFFE_SOLVERS.get(base)
    if cls is None:
        cls = type(base.__name__, (base,), {
            'default_memory_plan': 'stock', 'pycaffe_base': base, '__module__': 'caffeplus',
            '__qualname__': base.__name__, '__doc__': base.__doc__})
        _PYCAFFE_SOLVERS[base] = cls
    return cls
