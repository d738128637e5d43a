"""pycaffe's faces of the solver classes (caffeplus.SGDSolver, ...)."""


_PYCAFFE_SOLVERS = {}
# The layers Caffe 1.0 shards by solver rank (DataLayer::Skip, HDF5DataLayer::Skip).
SHARDED_BY_RANK = ('Data', 'HDF5Data')


def _init(self, param, rank=None, solver_count=None, **kwargs):
    """The base solver's constructor, its rank and count by default those
    set with caffe.set_solver_rank and caffe.set_solver_count
    (caffeplus.pycaffe_runtime); with several solvers, the train net's Data
    and HDF5Data layers read every count-th record from the rank-th, as
    Caffe's do."""
    from caffeplus import pycaffe_runtime
    if rank is None and solver_count is None:
        rank, solver_count = pycaffe_runtime.solver_ranks()
    rank, solver_count = rank or 0, solver_count or 1
    if solver_count > 1:
        kwargs.update(rank=rank, solver_count=solver_count)
    self.pycaffe_base.__init__(self, param, **kwargs)
    if solver_count > 1:
        for layer in self.net.layers:
            if layer.layer_param.type in SHARDED_BY_RANK:
                layer.set_shard(self.rank, self.solver_count)


def pycaffe_solver_class(base):
    """pycaffe's face of solver class `base` (caffeplus.SGDSolver, ...): the
    same solver, except that without caffeplus_param.memory_plan in the
    solver file its nets use the 'stock' memory plan, so that a script can
    read every solver.net.blobs[...] after solver.step() as with Caffe
    (`caffeplus train` and caffeplus.solver.get_solver default to 'shared',
    which releases intermediate blobs after their last use), and its rank
    comes from pycaffe's globals (_init)."""
    cls = _PYCAFFE_SOLVERS.get(base)
    if cls is None:
        cls = type(base.__name__, (base,), {
            'default_memory_plan': 'stock', 'pycaffe_base': base, '__module__': 'caffeplus',
            '__qualname__': base.__name__, '__doc__': base.__doc__, '__init__': _init})
        _PYCAFFE_SOLVERS[base] = cls
    return cls
