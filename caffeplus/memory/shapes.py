"""Build a net for planning only: real shapes, no memory for its blobs.

    from caffeplus.memory import shapes
    param = shapes.load_net_param('vgg16_b256.prototxt', batch=128)
    net = shapes.build_net(param)              # shape-only by default

The memory planner needs every blob's shape and the net's structure, never
a value. Building VGG-16 at batch 256 for real would allocate ~15 GB of
activations (DummyData fills its tops at setup, loss layers write their
diffs, fillers fill every parameter), so `shape_only()` switches two things
for the duration of the build:

  * caffeplus.blob's virtual allocation: every CPU Storage becomes a
    zero-strided view of one float (see the comment in caffeplus/blob.py);
    `blob.data = x` skips the copy, `blob.data[...] = x` writes one float.
  * caffeplus.rng's generator: the draws fillers make (normal, uniform,
    random, ...) come back as zero-strided float32 views of the requested
    shape, so Gaussian/Xavier/MSRA fillers and DummyData's Gaussian tops
    cost nothing either.

What still allocates: constant fillers (numpy.full; biases and labels,
small) and bilinear fillers and weights stored in the prototxt itself.
The net built this way has meaningless values and must not be run.

`load_net_param` turns a model file into what the planner builds: data
layers swapped for DummyData of the same shapes (the shape of the first
record when a Data layer's database can be opened, else what
caffeplus.io.dummy infers), and, with `batch`, the batch (first) axis of
every DummyData and Input top set.
"""
import contextlib
import os

import numpy

from caffeplus import blob as blob_module, log, rng
from caffeplus.errors import CaffeplusError
from caffeplus.proto import caffe_pb2


def _zeros(size, dtype=numpy.float32):
    if size is None:
        return dtype(0)
    shape = (int(size),) if numpy.ndim(size) == 0 else tuple(int(d) for d in size)
    return numpy.lib.stride_tricks.as_strided(numpy.zeros(1, dtype=dtype), shape=shape,
                                              strides=(0,) * len(shape))


class _ShapeOnlyGenerator:
    """Stands in for caffeplus.rng's numpy Generator during a shape-only
    build: array-valued draws are zero-strided views (no memory)."""

    def __init__(self, real):
        self._real = real

    def normal(self, loc=0.0, scale=1.0, size=None):
        return _zeros(size)

    def uniform(self, low=0.0, high=1.0, size=None):
        return _zeros(size)

    def random(self, size=None, dtype=numpy.float64, out=None):
        return _zeros(size)

    def standard_normal(self, size=None, dtype=numpy.float64, out=None):
        return _zeros(size)

    def __getattr__(self, name):
        # Scalar draws (seeds for prefetch threads, shuffles) use the real one.
        return getattr(self._real, name)


@contextlib.contextmanager
def shape_only():
    """Within this block, nets built on the CPU allocate no blob memory."""
    previous = blob_module.set_virtual_allocation(True)
    real = rng._gen['rng']
    rng._gen['rng'] = _ShapeOnlyGenerator(real)
    try:
        with numpy.errstate(all='ignore'):
            yield
    finally:
        rng._gen['rng'] = real
        blob_module.set_virtual_allocation(previous)


@contextlib.contextmanager
def quiet():
    """Net construction logs every layer; the memory command keeps stderr short."""
    level = log.logger.level
    log.logger.setLevel(max(level, 30))   # WARNING
    try:
        yield
    finally:
        log.logger.setLevel(level)


def set_batch(param, batch):
    """Set the batch axis (the first) of every DummyData and Input top in
    NetParameter `param` (in place) to `batch`; returns the number of tops
    changed. Layers with a batch of their own beyond these (a Reshape with
    an explicit first dimension) are left as written."""
    batch = int(batch)
    if batch <= 0:
        raise CaffeplusError('--batch must be positive (got %d)' % batch)
    changed = 0
    for lp in param.layer:
        if lp.type == 'DummyData':
            p = lp.dummy_data_param
            for shape in p.shape:
                if len(shape.dim):
                    shape.dim[0] = batch
                    changed += 1
            for i in range(len(p.num)):
                p.num[i] = batch
                changed += 1
        elif lp.type == 'Input':
            for shape in lp.input_param.shape:
                if len(shape.dim):
                    shape.dim[0] = batch
                    changed += 1
    return changed


def batch_of(param):
    """The batch of the first DummyData or Input top of NetParameter `param`
    (None if there is none)."""
    for lp in param.layer:
        if lp.type == 'DummyData':
            p = lp.dummy_data_param
            if len(p.shape) and len(p.shape[0].dim):
                return int(p.shape[0].dim[0])
            if len(p.num):
                return int(p.num[0])
        elif lp.type == 'Input' and len(lp.input_param.shape) and \
                len(lp.input_param.shape[0].dim):
            return int(lp.input_param.shape[0].dim[0])
    return None


def _first_datum_chw(lp):
    """(C, H, W) of the first Datum in a Data layer's database, or None."""
    from caffeplus.io import datum as datum_io, db
    source = lp.data_param.source
    if not source or not os.path.exists(source):
        return None
    try:
        for key, d in db.read_datums(source, lp.data_param.backend):
            if d.encoded:
                shape = datum_io.datum_to_array(d, key).shape
                return tuple(int(v) for v in shape[-3:]) if len(shape) == 3 else \
                    (1,) + tuple(int(v) for v in shape[-2:])
            return datum_io.datum_shape(d, key)
    except Exception:          # unreadable: fall back to inferring the shape
        return None
    return None


def _swap_readable_data_layers(param, batch):
    """Data layers whose database can be opened: DummyData of the shape of
    its first record (crop_size applied), in place."""
    from caffeplus.io import dummy
    for i, lp in enumerate(param.layer):
        if lp.type != 'Data':
            continue
        chw = _first_datum_chw(lp)
        if chw is None:
            continue
        c, h, w = chw
        crop = int(lp.transform_param.crop_size)
        if crop:
            h = w = crop
        n = int(batch) if batch else int(lp.data_param.batch_size)
        if n <= 0:
            continue
        shapes = {lp.name: (n, c, h, w)}
        param.layer[i].CopyFrom(dummy.dummy_layer(lp, dummy.data_top_shapes(lp, shapes, n)))


def load_net_param(model, batch=None, phase=caffe_pb2.TRAIN, shapes=None):
    """A NetParameter ready to plan: data layers as DummyData (of the data
    layer's shapes; `shapes` {top or layer name: shape} as
    caffeplus.io.dummy.swap_data_layers takes it), the batch overridden when
    `batch` is given."""
    from caffeplus.io.dummy import swap_data_layers
    from caffeplus.net import load_net_param as read
    if isinstance(model, (str, os.PathLike)) and not os.path.exists(os.fspath(model)):
        raise CaffeplusError("model file '%s' not found" % os.fspath(model))
    with quiet():
        param = read(model)
        if not shapes:
            _swap_readable_data_layers(param, batch)
    param = swap_data_layers(param, shapes=shapes, batch_size=batch)
    if batch is not None:
        if not set_batch(param, batch):
            raise CaffeplusError('--batch: net %s has no data, DummyData or Input layer whose '
                                 'batch could be set' % (param.name or '(unnamed)'))
    param.state.phase = phase
    return param


def build_net(param, phase=caffe_pb2.TRAIN, virtual=True, level=0, stages=None):
    """caffeplus.Net of `param` (a NetParameter); shape-only when `virtual`.
    A virtual net is built on the CPU for estimates of the GPU: its layers
    declare what their GPU twins' backward reads (cuDNN's pooling, LRN and
    ELU read x and y), so plans made on it keep what the GPU needs."""
    from caffeplus import backend
    from caffeplus.net import Net
    with quiet():
        if not virtual:
            return Net(param, phase, level=level, stages=stages)
        mode = backend.mode()
        backend.set_mode_cpu()           # virtual allocation is for CPU storage
        try:
            with shape_only():
                net = Net(param, phase, level=level, stages=stages)
        finally:
            if mode == backend.GPU:
                backend.set_mode_gpu()
        for layer in net.layers:
            gpu_reads = getattr(layer, 'gpu_backward_reads', None)
            if gpu_reads is not None:
                layer.backward_reads = gpu_reads()
        return net
