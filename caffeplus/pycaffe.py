"""pycaffe's API on caffeplus: `import caffeplus as caffe` runs pycaffe scripts.

This module holds what pycaffe adds on top of Caffe's C++ classes:

  * Net helpers pycaffe writes in Python (forward_all, forward_backward_all,
    _batch, set_input_arrays, _inputs/_outputs, _top_ids/_bottom_ids),
    attached to caffeplus.Net;
  * `Layer`, the base class of Python layers (pycaffe's caffe.Layer), with
    the switch that refuses Python layers for untrusted files;
  * `import caffe` giving caffeplus: Python layer modules (py-faster-rcnn's,
    model zoos') get it by themselves when a net loads them
    (caffe_alias_for_python_layer), other scripts by `install_caffe_alias()`.

The Python layer type itself ('Python') lives in layers/python.py.
"""
import contextlib
import itertools
import sys

import numpy

from caffeplus import backend
from caffeplus.blob import Blob
from caffeplus.errors import CaffeplusError
from caffeplus.net import Net, unique_names
from caffeplus.proto import caffe_pb2
from caffeplus.pycaffe_solvers import pycaffe_solver_class  # noqa: F401

# -- Python layers: the trust switch -------------------------------------------
_python_layers = {'allowed': True}


def set_python_layers_allowed(allowed=True):
    """Allow or refuse `type: "Python"` layers in nets built from now on.

    A Python layer imports and runs arbitrary code named by the net file, so
    refuse them (or give the no_python_layers setting: --no_python_layers,
    CAFFEPLUS_NO_PYTHON_LAYERS=1; caffeplus.config) before building nets
    from files you do not trust. The setting, when on, refuses them
    whatever this switch says.
    """
    _python_layers['allowed'] = bool(allowed)


def python_layers_allowed():
    return python_layers_refusal() is None


def python_layers_refusal():
    """Why Python layers are refused now (a phrase), or None if allowed."""
    from caffeplus import config
    refused, where = config.lookup('no_python_layers')
    if refused:
        return 'no_python_layers is set (%s)' % where
    if not _python_layers['allowed']:
        return 'caffeplus.set_python_layers_allowed(False) is in effect'
    return None


# -- Python layers: the base class ---------------------------------------------
class BlobVec(list):
    """A layer's parameter blobs: a list with pycaffe's add_blob(*shape)."""

    def __init__(self, blobs=(), owner=''):
        super().__init__(blobs)
        self._owner = owner

    def add_blob(self, *shape):
        if len(shape) == 1 and not isinstance(shape[0], (int, numpy.integer)):
            shape = tuple(shape[0])
        blob = Blob(tuple(int(d) for d in shape), name='%s.%d' % (self._owner, len(self)))
        self.append(blob)
        return blob


def host_blob(blob):
    """What Python code sees of a blob: the Blob in CPU mode; in GPU mode a
    view whose data/diff are NumPy arrays kept in sync with the device (as
    pycaffe hands Python layers their CPU data)."""
    from caffeplus import blob as blob_module
    wrap = getattr(blob_module, 'host_blob', None)
    return wrap(blob) if wrap is not None else blob


def host_blobs(blobs):
    if backend.mode() != backend.GPU:
        return blobs
    return [host_blob(b) for b in blobs]


class HostBlobVec:
    """A Python layer's self.blobs: the layer's BlobVec seen through
    host_blob (NumPy data/diff in GPU mode too), with add_blob."""

    def __init__(self, blobs):
        self._blobs = blobs

    def __len__(self):
        return len(self._blobs)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [host_blob(b) for b in self._blobs[index]]
        return host_blob(self._blobs[index])

    def __iter__(self):
        return (host_blob(b) for b in self._blobs)

    def add_blob(self, *shape):
        return host_blob(self._blobs.add_blob(*shape))

    def __repr__(self):
        return '[%s]' % ', '.join(repr(b) for b in self._blobs)


class Layer:
    """Base class of Python layers (pycaffe's caffe.Layer).

    Subclass it and override setup/reshape/forward/backward; name the module
    and class in the net's python_param. Before setup the layer has:
      self.param_str    python_param.param_str
      self.phase        caffeplus.TRAIN or caffeplus.TEST
      self.blobs        learnable blobs; self.blobs.add_blob(*shape) adds one
      self.layer_param  the LayerParameter (a copy)
      self.type         'Python'
    bottom and top are lists of caffeplus Blobs (data, diff, reshape, shape...).
    """

    def __init__(self, layer_param=None):
        param = caffe_pb2.LayerParameter()
        if layer_param is not None:
            param.CopyFrom(layer_param)
        self.layer_param = param
        self.param_str = param.python_param.param_str
        self.phase = param.phase
        self.blobs = BlobVec(owner=param.name)
        self.type = 'Python'

    @property
    def name(self):
        return self.layer_param.name

    def setup(self, bottom, top):
        """Called once, before the first reshape: check parameters, add blobs."""

    def reshape(self, bottom, top):
        """Shape the tops (and buffers) from the bottoms."""

    def forward(self, bottom, top):
        """Compute the tops."""

    def backward(self, top, propagate_down, bottom):
        """Compute the bottom diffs for which propagate_down is true."""


# -- Net helpers pycaffe writes in Python --------------------------------------
def _to_host(arr):
    return numpy.array(backend.to_numpy(arr), copy=True)


def _batch_size_of(net, names):
    for name in names:
        if name in net.blobs and net.blobs[name].num_axes:
            return net.blobs[name].shape[0]
    first = next(iter(net.blobs.values()))
    return first.shape[0]


def _net_batch(self, blobs):
    """Split {name: array} into batch-sized pieces; pad the last with zeros."""
    if not blobs:
        return
    num = len(next(iter(blobs.values())))
    for name, arr in blobs.items():
        if len(arr) != num:
            raise CaffeplusError('all input arrays must have the same length: %s has %d, '
                                 'expected %d' % (name, len(arr), num))
    batch_size = _batch_size_of(self, list(blobs))
    if batch_size <= 0:
        raise CaffeplusError('cannot batch inputs for a net whose batch size is 0')
    full, remainder = divmod(num, batch_size)
    for b in range(full):
        i = b * batch_size
        yield {name: blobs[name][i:i + batch_size] for name in blobs}
    if remainder:
        padded = {}
        for name, arr in blobs.items():
            arr = numpy.asarray(arr)
            padding = numpy.zeros((batch_size - remainder,) + arr.shape[1:], dtype=arr.dtype)
            padded[name] = numpy.concatenate([arr[-remainder:], padding])
        yield padded


def _net_forward_all(self, blobs=None, **kwargs):
    """Run forward over inputs of any length, batch by batch; return
    {output: array of all rows} (pycaffe's Net.forward_all)."""
    names = unique_names(self.outputs + list(blobs or []))
    if not kwargs:
        outs = self.forward(blobs=blobs)
        return {name: _to_host(outs[name]) for name in names}
    collected = {name: [] for name in names}
    for batch in self._batch(kwargs):
        outs = self.forward(blobs=blobs, **batch)
        for name, arr in outs.items():
            collected[name].append(_to_host(arr))
    num = len(next(iter(kwargs.values())))
    return {name: numpy.concatenate(parts)[:num] if parts else numpy.zeros((0,))
            for name, parts in collected.items()}


def _net_forward_backward_all(self, blobs=None, diffs=None, **kwargs):
    """Forward and backward over inputs (and output diffs) of any length;
    return (outputs, diffs) dicts of whole arrays (pycaffe's version)."""
    out_names = unique_names(self.outputs + list(blobs or []))
    diff_names = unique_names(self.inputs + list(diffs or []))
    fwd = {name: kwargs[name] for name in self.inputs if name in kwargs}
    bwd = {name: kwargs[name] for name in self.outputs if name in kwargs}
    unknown = set(kwargs) - set(fwd) - set(bwd)
    if unknown:
        raise CaffeplusError('forward_backward_all: %s are neither net inputs %s nor outputs %s'
                             % (sorted(unknown), self.inputs, self.outputs))
    all_outs = {name: [] for name in out_names}
    all_diffs = {name: [] for name in diff_names}
    for fb, bb in itertools.zip_longest(self._batch(fwd), self._batch(bwd), fillvalue={}):
        outs = self.forward(blobs=blobs, **fb)
        grads = self.backward(diffs=diffs, **bb)
        for name, arr in outs.items():
            all_outs[name].append(_to_host(arr))
        for name, arr in grads.items():
            all_diffs[name].append(_to_host(arr))
    num = len(next(iter(kwargs.values()))) if kwargs else None

    def pack(parts):
        if not parts:
            return numpy.zeros((0,))
        arr = numpy.concatenate(parts)
        return arr[:num] if num is not None else arr
    return ({name: pack(p) for name, p in all_outs.items()},
            {name: pack(p) for name, p in all_diffs.items()})


def _net_set_input_arrays(self, data, labels):
    """Feed a MemoryData first layer (pycaffe's Net.set_input_arrays)."""
    if not self.layers or self.layers[0].layer_param.type != 'MemoryData':
        raise CaffeplusError('set_input_arrays needs a net whose first layer is MemoryData '
                             '(this net starts with %s)'
                             % (self.layers[0].layer_param.type if self.layers else 'nothing'))
    data = numpy.ascontiguousarray(data, dtype=numpy.float32)
    labels = numpy.asarray(labels, dtype=numpy.float32)
    if labels.ndim == 1:
        labels = labels[:, None, None, None]
    labels = numpy.ascontiguousarray(labels)
    if data.ndim != 4 or labels.ndim != 4:
        raise CaffeplusError('set_input_arrays: data and labels must be 4-D (labels may be '
                             '1-D), got shapes %s and %s' % (data.shape, labels.shape))
    if labels.shape[1:] != (1, 1, 1):
        raise CaffeplusError('set_input_arrays: labels must have shape (N, 1, 1, 1), got %s'
                             % (labels.shape,))
    if len(data) != len(labels):
        raise CaffeplusError('set_input_arrays: data has %d rows but labels %d'
                             % (len(data), len(labels)))
    layer = self.layers[0]
    reset = getattr(layer, 'reset', None) or getattr(layer, 'Reset', None)
    if reset is None:
        raise CaffeplusError('the MemoryData layer %s cannot take arrays' % layer.name)
    # Keep the arrays alive as long as the layer reads them (pycaffe does too).
    self._input_arrays = (data, labels)
    return reset(data, labels, len(data))


def _net_inputs_ids(self):
    return list(self.input_blob_indices)


def _net_outputs_ids(self):
    return list(self.output_blob_indices)


def _net_top_ids(self, i):
    return list(self.top_id_vecs[i])


def _net_bottom_ids(self, i):
    return list(self.bottom_id_vecs[i])


def _net_forward_range(self, start, end):
    """pycaffe's Net._forward(start_index, end_index)."""
    return self.forward_from_to(start, end)


def _net_backward_range(self, start, end):
    """pycaffe's Net._backward(start_index, end_index)."""
    return self.backward_from_to(start, end)


def _net_callback(name, hooks_name):
    """pycaffe's Net.`name`(fn) (before_forward and kin): fn(layer index)
    runs at every layer of every pass, where Caffe's Net runs its callbacks
    (the net's list `hooks_name`)."""
    def add(self, callback):
        getattr(self, hooks_name).append(callback)
    add.__name__ = add.__qualname__ = name
    return add


_NET_HELPERS = {
    'before_forward': _net_callback('before_forward', 'before_layer_forward'),
    'after_forward': _net_callback('after_forward', 'after_layer_forward'),
    'before_backward': _net_callback('before_backward', 'before_layer_backward'),
    'after_backward': _net_callback('after_backward', 'on_layer_backward_done'),
    '_batch': _net_batch,
    'forward_all': _net_forward_all,
    'forward_backward_all': _net_forward_backward_all,
    'set_input_arrays': _net_set_input_arrays,
    '_set_input_arrays': _net_set_input_arrays,
    '_top_ids': _net_top_ids,
    '_bottom_ids': _net_bottom_ids,
    '_forward': _net_forward_range,
    '_backward': _net_backward_range,
}
_NET_PROPERTIES = {
    '_inputs': _net_inputs_ids,
    '_outputs': _net_outputs_ids,
}


def attach_net_helpers(cls=Net):
    """Give `cls` pycaffe's Python-side Net methods it does not define itself."""
    for name, func in _NET_HELPERS.items():
        if name not in cls.__dict__:
            setattr(cls, name, func)
    for name, func in _NET_PROPERTIES.items():
        if name not in cls.__dict__:
            setattr(cls, name, property(func))


def _solver_share_weights(self, net):
    """pycaffe's Solver.share_weights: `net` uses the train net's weights."""
    net.share_with(self.net)


def attach_solver_helpers(cls):
    if not hasattr(cls, 'share_weights'):
        cls.share_weights = _solver_share_weights


def get_solver(path_or_param, **kwargs):
    """pycaffe's caffe.get_solver(path): the solver the file describes, with
    the 'stock' memory plan unless the file names another
    (caffeplus_param { memory_plan: "shared" }); see pycaffe_solver_class."""
    from caffeplus import solver
    return solver.get_solver(path_or_param, pycaffe=True, **kwargs)


attach_net_helpers()


# -- `import caffe` for unmodified modules -------------------------------------
CAFFE_SUBMODULES = ('io', 'proto', 'proto.caffe_pb2', 'draw', 'net_spec', 'classifier',
                    'detector', 'pycaffe', 'coord_map')


def _package():
    """The caffeplus package: this module's parent, imported before it."""
    return sys.modules[__name__.rpartition('.')[0]]


def _alias_modules():
    """{'caffe': caffeplus, 'caffe.io': caffeplus.io, ...}."""
    import importlib
    caffeplus = _package()
    modules = {'caffe': caffeplus}
    for sub in CAFFE_SUBMODULES:
        modules['caffe.' + sub] = importlib.import_module('caffeplus.' + sub)
    return modules


def _other_caffe_imported():
    caffeplus = _package()
    existing = sys.modules.get('caffe')
    return existing is not None and existing is not caffeplus


def install_caffe_alias():
    """Make `import caffe` (and caffe.io, caffe.proto.caffe_pb2, caffe.draw,
    caffe.net_spec, caffe.classifier, caffe.detector) give caffeplus.

    For scripts you cannot edit (Python layer modules get the alias by
    themselves: caffe_alias_for_python_layer). Refuses to replace a real
    `caffe` that is already imported.
    """
    caffeplus = _package()
    if _other_caffe_imported():
        existing = sys.modules['caffe']
        raise CaffeplusError('a module named caffe is already imported (%s); not replacing it'
                             % getattr(existing, '__file__', existing))
    sys.modules.update(_alias_modules())
    return caffeplus


@contextlib.contextmanager
def caffe_alias_for_python_layer():
    """While a Python layer's module is imported, `import caffe` gives caffeplus.

    The layer runs inside caffeplus: its base class (caffe.Layer), the blobs
    it is handed and caffe.TRAIN/TEST must be caffeplus's, so caffeplus's
    alias is what it gets even where a stock pycaffe is installed (stock
    caffe.Layer cannot run in a caffeplus net). If no module named caffe is
    imported yet, the alias stays for the rest of the process, because a
    layer may also `import caffe` inside its methods; this shadows an
    installed stock pycaffe in this process only. If the process has already
    imported another caffe (a script using stock pycaffe beside caffeplus),
    that one is not taken from it: the alias is in place only during the
    import (the module's own `import caffe` binds caffeplus), and the
    script's modules are put back afterwards.
    """
    if not _other_caffe_imported():
        sys.modules.update(_alias_modules())
        yield
        return
    aliases = _alias_modules()
    saved = {name: sys.modules.get(name) for name in aliases}
    sys.modules.update(aliases)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


__all__ = ['Layer', 'BlobVec', 'set_python_layers_allowed', 'python_layers_allowed',
           'install_caffe_alias', 'caffe_alias_for_python_layer', 'attach_net_helpers']
