"""pycaffe's process-wide functions beside the net and the solvers:
caffe.init_log, caffe.Timer, the data-parallel globals (solver_count,
solver_rank, multiprocess) and caffe.NCCL, as BVLC's python/train.py uses
them.

Caffe keeps the solver count and rank in its process singleton: a solver
built while the count is above 1 knows its rank (only rank 0 tests and
snapshots), and its TRAIN Data and HDF5Data layers read every count-th
record from the rank-th (Caffe's DataLayer::Skip). caffeplus's pycaffe
solvers take them from here (caffeplus.pycaffe_solvers).
"""
import time

from caffeplus import backend, log
from caffeplus.errors import CaffeplusError

_globals = {'solver_count': 1, 'solver_rank': 0, 'multiprocess': False}


def init_log(level=None, stderr=None):
    """pycaffe's caffe.init_log([level[, stderr]]): glog's minimum level (0
    INFO .. 3 FATAL). caffeplus always logs to stderr, as Caffe does with
    GLOG_logtostderr, so `stderr` changes nothing."""
    if level is not None:
        log.set_level(int(level))


def solver_count():
    return _globals['solver_count']


def set_solver_count(count):
    count = int(count)
    if count < 1:
        raise CaffeplusError('set_solver_count: the count must be at least 1 (got %d)' % count)
    _globals['solver_count'] = count


def solver_rank():
    return _globals['solver_rank']


def set_solver_rank(rank):
    rank = int(rank)
    if rank < 0:
        raise CaffeplusError('set_solver_rank: the rank must be 0 or more (got %d)' % rank)
    _globals['solver_rank'] = rank


def multiprocess():
    return _globals['multiprocess']


def set_multiprocess(value):
    _globals['multiprocess'] = bool(value)


def solver_ranks():
    """(rank, count) for a solver built now, checked against each other."""
    rank, count = _globals['solver_rank'], _globals['solver_count']
    if rank >= count:
        raise CaffeplusError('solver rank %d is not below the solver count %d '
                             '(caffe.set_solver_rank, caffe.set_solver_count)' % (rank, count))
    return rank, count


class Timer:
    """pycaffe's caffe.Timer: start(), stop(), ms. In GPU mode it times the
    device's work between start and stop (CUDA events on the current
    stream, as Caffe's Timer does); on the CPU, the host's time."""

    def __init__(self):
        self._gpu = backend.mode() == backend.GPU
        self._running = False
        self._ran = False
        self._ms = 0.0
        self._begin = self._end = None

    def _now(self):
        if self._gpu:
            import cupy
            event = cupy.cuda.Event()
            event.record()
            return event
        return time.perf_counter()

    def start(self):
        if not self._running:
            self._begin = self._now()
            self._running = True
            self._ran = True

    def stop(self):
        if self._running:
            self._end = self._now()
            self._running = False
            self._ms = None             # measured when read

    @property
    def ms(self):
        """Milliseconds from the last start to its stop (a running timer is
        stopped first; one never started reads 0, with a warning)."""
        if not self._ran:
            log.warning('Timer has never been run before reading time.')
            return 0.0
        if self._running:
            self.stop()
        if self._ms is None:
            if self._gpu:
                import cupy
                self._end.synchronize()
                self._ms = float(cupy.cuda.get_elapsed_time(self._begin, self._end))
            else:
                self._ms = (self._end - self._begin) * 1000.0
        return self._ms


def has_nccl():
    """Whether caffe.NCCL can run here (CuPy with NCCL)."""
    from caffeplus.parallel.comm import import_nccl
    try:
        import_nccl()
    except CaffeplusError:
        return False
    return True


class NCCL:
    """pycaffe's caffe.NCCL(solver, uid): the solver's gradients averaged
    over the solver_count processes that made one with the same uid
    (NCCL.new_uid(), made once and handed to each), by NCCL on each
    process's GPU. bcast() gives every rank rank 0's weights. As a solver
    callback (solver.add_callback(nccl)) it averages all gradients when they
    are ready; as a net callback (solver.net.after_backward(nccl), with the
    solver's layer_wise_reduce) it averages each layer's as its backward
    ends, and the solver callback then has nothing left to do. With one
    solver there is nothing to exchange."""

    def __init__(self, solver, uid):
        self.solver = solver
        rank, count = solver_ranks()
        self.rank, self.count = rank, count
        self._comm = None
        if count > 1:
            if backend.mode() != backend.GPU:
                raise CaffeplusError('caffe.NCCL needs the GPU: call caffe.set_mode_gpu() and '
                                     'caffe.set_device() before making the solver')
            from caffeplus.parallel.comm import NCCLComm
            self._comm = NCCLComm.from_uid(uid, rank, count, backend.device())

    @staticmethod
    def new_uid():
        """An NCCL session id for the processes of one training: bytes, as
        pycaffe gives it under Python 3 (a CuPy that gives a tuple of
        signed chars has it packed)."""
        from caffeplus.parallel.comm import import_nccl
        uid = import_nccl().get_unique_id()
        return uid if isinstance(uid, bytes) else bytes(v & 0xFF for v in uid)

    def _layer_wise(self):
        return bool(self.solver.param.layer_wise_reduce)

    def _average(self, blobs):
        for blob in blobs:
            diff = blob.diff
            self._comm.allreduce_(diff)
            diff *= 1.0 / self.count

    def bcast(self):
        """Every rank takes rank 0's weights."""
        if self._comm is not None:
            for blob in self.solver.net.learnable_params:
                self._comm.broadcast_(blob.data, root=0)

    # As a solver callback.
    def on_start(self):
        pass

    def on_gradients_ready(self):
        if self._comm is not None and not self._layer_wise():
            self._average(self.solver.net.learnable_params)

    # As a net callback: run(layer) after that layer's backward.
    def __call__(self, layer):
        if self._comm is not None:
            if not self._layer_wise():
                raise CaffeplusError('caffe.NCCL as a net callback needs the solver\'s '
                                     'layer_wise_reduce')
            self._average(self.solver.net.layers[layer].blobs)
