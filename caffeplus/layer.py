"""The layer interface and the registry of layer types.

A layer follows Caffe's four steps: layer_setup (once: read parameters,
create learnable blobs), reshape (shape tops from bottoms), _forward and
_backward (the math). The base class adds what every layer shares: the
bottom/top count checks, loss weights, and the loss a forward returns.

Each layer class also declares, for the memory planner:
  backward_reads  which arrays its backward reads: a subset of
                  {'bottom_data', 'top_data'} (internal buffers, such as a
                  pooling mask, are the layer's own and always kept)
  inplace_ok      whether top may be the same blob as bottom
  diff_over_top_diff
                  whether its backward gives the same bits when it writes
                  its bottom's gradient over its top's (a reusing plan may
                  then place both in the same bytes: liveness.diff_overlays)
"""

import numpy

from caffeplus import backend, deferred_loss
from caffeplus.blob import Blob
from caffeplus.errors import NetError, UnknownLayerError
from caffeplus.proto import caffe_pb2

_REGISTRY = {}


def register(cls):
    """Class decorator: make `cls` the implementation of `cls.type`."""
    names = cls.type if isinstance(cls.type, (list, tuple)) else [cls.type]
    for name in names:
        _REGISTRY[name] = cls
    return cls


def layer_types():
    _load_layers()
    return sorted(_REGISTRY)


def layer_class(type_name):
    _load_layers()
    return _REGISTRY.get(type_name)


# -- engines -----------------------------------------------------------------
# GPU_ENGINES: layer type -> the cuDNN class (layers/cudnn_*.py) that create_layer
# picks when the layer's engine is DEFAULT or CUDNN; engine: CAFFE keeps the
# generic class. The cuDNN classes fall back to the generic code on NumPy
# arrays, so picking them costs CPU runs nothing. CUDNN_ENGINES = False keeps
# the generic classes everywhere.
GPU_ENGINES = {}
CUDNN_ENGINES = True
ENGINE_DEFAULT, ENGINE_CAFFE, ENGINE_CUDNN = 0, 1, 2
ENGINE_FIELDS = {'Convolution': 'convolution_param', 'Deconvolution': 'convolution_param',
                 'Pooling': 'pooling_param', 'LRN': 'lrn_param', 'ReLU': 'relu_param',
                 'Sigmoid': 'sigmoid_param', 'TanH': 'tanh_param', 'Softmax': 'softmax_param',
                 'SPP': 'spp_param'}


def register_engine(engine, cls=None):
    """register_engine('CUDNN', cls), or @register_engine('CUDNN') on a class:
    make `cls` the engine's implementation of `cls.type`."""
    if engine != 'CUDNN':
        raise ValueError("unknown engine '%s'" % engine)

    def add(c):
        names = c.type if isinstance(c.type, (list, tuple)) else [c.type]
        for name in names:
            GPU_ENGINES[name] = c
        return c
    return add(cls) if cls is not None else add


def layer_engine(layer_param):
    """The engine a LayerParameter asks for (ENGINE_DEFAULT if it has no field)."""
    field = ENGINE_FIELDS.get(layer_param.type)
    if field is None or not layer_param.HasField(field):
        return ENGINE_DEFAULT
    return getattr(layer_param, field).engine


def create_layer(layer_param):
    """Instantiate the layer a LayerParameter describes."""
    cls = layer_class(layer_param.type)
    if cls is None:
        from caffeplus.io.prototxt import did_you_mean
        guess = did_you_mean(layer_param.type, layer_types())
        hint = "; did you mean '%s'?" % guess if guess else '.'
        raise UnknownLayerError(
            "Unknown layer type: '%s' (layer '%s')%s Known types: %s"
            % (layer_param.type, layer_param.name, hint, ', '.join(layer_types())))
    gpu_cls = GPU_ENGINES.get(layer_param.type)
    if gpu_cls is not None and layer_engine(layer_param) != ENGINE_CAFFE and CUDNN_ENGINES:
        cls = gpu_cls
    return cls(layer_param)


def _reraise_out_of_memory(layer, stage, exc):
    """Turn CuPy's OutOfMemoryError into a CaffeplusError naming the layer."""
    if type(exc).__name__ in ('OutOfMemoryError', 'CUDARuntimeError', 'CudnnError'):
        from caffeplus.memory import oom
        if oom.is_out_of_memory(exc):
            raise oom.out_of_memory_error(layer, stage, exc) from exc


def _load_layers():
    # Importing the family modules registers their classes.
    import caffeplus.layers
    if getattr(caffeplus.layers, '__file__', None) is None:
        # A stray caffeplus/layers/ folder shadows the real package (layers/).
        raise ImportError('caffeplus.layers resolved to a namespace package %s: layer '
                          'modules belong in the top-level layers/ folder'
                          % list(caffeplus.layers.__path__))


class Layer:
    type = None
    exact_num_bottom = -1
    min_num_bottom = -1
    max_num_bottom = -1
    exact_num_top = -1
    min_num_top = -1
    max_num_top = -1
    equal_num_bottom_top = False
    auto_top_blobs = False
    backward_reads = frozenset(('bottom_data', 'top_data'))
    inplace_ok = False
    diff_over_top_diff = False
    # Layers that have no backward at all (Accuracy, ArgMax, data layers).
    has_backward = True

    def __init__(self, layer_param):
        self.layer_param = caffe_pb2.LayerParameter()
        self.layer_param.CopyFrom(layer_param)
        self.phase = self.layer_param.phase
        self.blobs = []
        for i, bp in enumerate(self.layer_param.blobs):
            b = Blob(name='%s.%d' % (self.layer_param.name, i))
            b.from_proto(bp, reshape=True)
            self.blobs.append(b)
        self.param_propagate_down = []
        self.loss_weights = []

    # -- Caffe's SetUp -------------------------------------------------------
    @property
    def name(self):
        return self.layer_param.name

    def setup(self, bottom, top):
        self.check_blob_counts(bottom, top)
        try:
            self.layer_setup(bottom, top)
            self.reshape(bottom, top)
            self.set_loss_weights(top)
        except Exception as exc:        # out of GPU memory: name the layer
            _reraise_out_of_memory(self, 'setup', exc)
            raise

    def layer_setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        raise NotImplementedError

    def check_blob_counts(self, bottom, top):
        name, kind = self.layer_param.name, self.layer_param.type

        def fail(what):
            raise NetError('layer %s (%s) %s' % (name, kind, what))
        nb, nt = len(bottom), len(top)
        if self.exact_num_bottom >= 0 and nb != self.exact_num_bottom:
            fail('takes %d bottom blob(s) as input, got %d' % (self.exact_num_bottom, nb))
        if self.min_num_bottom >= 0 and nb < self.min_num_bottom:
            fail('takes at least %d bottom blob(s) as input, got %d' % (self.min_num_bottom, nb))
        if self.max_num_bottom >= 0 and nb > self.max_num_bottom:
            fail('takes at most %d bottom blob(s) as input, got %d' % (self.max_num_bottom, nb))
        if self.exact_num_top >= 0 and nt != self.exact_num_top:
            fail('produces %d top blob(s) as output, got %d' % (self.exact_num_top, nt))
        if self.min_num_top >= 0 and nt < self.min_num_top:
            fail('produces at least %d top blob(s) as output, got %d' % (self.min_num_top, nt))
        if self.max_num_top >= 0 and nt > self.max_num_top:
            fail('produces at most %d top blob(s) as output, got %d' % (self.max_num_top, nt))
        if self.equal_num_bottom_top and nb != nt:
            fail('produces one top blob as output for each bottom blob input')

    def set_loss_weights(self, top):
        weights = list(self.layer_param.loss_weight)
        if weights and len(weights) != len(top):
            raise NetError('layer %s: loss_weight must be unspecified or specified once per '
                           'top blob (%d given for %d tops)'
                           % (self.layer_param.name, len(weights), len(top)))
        self.loss_weights = [0.0] * len(top)
        for i, w in enumerate(weights):
            if w == 0:
                continue
            self.loss_weights[i] = w
            top[i].diff[...] = w

    def loss(self, top_index):
        return top_index < len(self.loss_weights) and self.loss_weights[top_index] != 0

    def allow_force_backward(self, bottom_index):
        return True

    def set_param_propagate_down(self, index, value):
        while len(self.param_propagate_down) <= index:
            self.param_propagate_down.append(True)
        self.param_propagate_down[index] = value

    def param_needs_backward(self, index):
        return index >= len(self.param_propagate_down) or self.param_propagate_down[index]

    # -- Caffe's Forward/Backward -------------------------------------------
    def forward(self, bottom, top):
        """Run the layer; return its weighted loss (0 for non-loss layers)."""
        return self._run_forward(bottom, top, deferred=False)

    def forward_deferred(self, bottom, top):
        """forward(), its weighted loss left on the device: a float, or a
        callable that reads it (caffeplus.deferred_loss). A layer with a
        forward() of its own runs that (its loss is read now)."""
        if type(self).forward is not Layer.forward:
            return self.forward(bottom, top)
        return self._run_forward(bottom, top, deferred=True)

    def _run_forward(self, bottom, top, deferred):
        try:
            self._forward(bottom, top)
        except Exception as exc:        # out of GPU memory: name the layer
            _reraise_out_of_memory(self, 'forward', exc)
            raise
        return self.weighted_loss(top, deferred)

    def weighted_loss(self, top, deferred=False):
        """Caffe's loss of a forward: each top's data dotted with its diff,
        where the loss weight (set in the diff at setup) is not zero.
        `deferred`: device values are read later (a callable is returned)."""
        values = []
        for i, w in enumerate(self.loss_weights):
            if w:
                xp = backend.get_array_module(top[i].data)
                values.append(xp.dot(top[i].data.ravel(), top[i].diff.ravel()))
        if not values:
            return 0.0          # (every layer's forward comes here: no closure for none)
        read = deferred_loss.read_later(values)
        if deferred and any(backend.get_array_module(v) is not numpy for v in values):
            return read
        return read()

    def backward(self, top, propagate_down, bottom):
        try:
            self._backward(top, propagate_down, bottom)
        except Exception as exc:        # out of GPU memory: name the layer
            _reraise_out_of_memory(self, 'backward', exc)
            raise

    def _forward(self, bottom, top):
        raise NotImplementedError

    def _backward(self, top, propagate_down, bottom):
        if any(propagate_down):
            raise NetError('layer %s (%s) cannot back-propagate'
                           % (self.layer_param.name, self.layer_param.type))

    def net_ready(self):
        """Called when the net holding the layer is built, before it logs
        "Network initialization done": background work starts here (a data
        layer's prefetching), after every layer is set up."""

    # -- workspace, for the memory planner -----------------------------------
    def workspace_bytes(self):
        """Scratch bytes the layer needs during one call (0: none)."""
        return 0

    def stock_workspace_bytes(self):
        """Workspace stock Caffe 1.0 allocates for this layer (cuDNN convolutions)."""
        return 0

    # -- the memory planner's contract ---------------------------------------
    # caffeplus.memory plans a net's memory from what its layers declare here
    # (besides their configuration: layer_param, blobs, a convolution's
    # geometry) and reads no private attribute of theirs: what each backward
    # reads (backward_reads, diff_over_top_diff above), the buffers a layer
    # keeps from forward to backward, the calls that take workspace, and
    # whether it can keep a mask instead of its maps. A layer overrides what
    # applies to it.
    masked = False          # a mask replaces the maps its backward reads (set_masked)
    refill = None           # DummyData: per top, whether each forward fills it again
    # Calls that take workspace from a manager (cuDNN convolutions); such a
    # layer also has set_workspace_manager(manager, plan_name) and
    # time_calls(ws_ptr, ws_bytes).
    workspace_calls = False

    def gpu_backward_reads(self):
        """backward_reads of the layer's GPU path (a cuDNN backward may read
        more than the generic code): the estimate, built on the CPU, plans
        with these (caffeplus.memory.shapes.build_net)."""
        return self.backward_reads

    def unmasked_backward_reads(self):
        """What backward reads when the layer is not masked."""
        return self.backward_reads

    def internal_buffers(self):
        """{name: (count, numpy dtype)} the layer keeps from forward to
        backward, which a plan may place (caffeplus.memory.scratch)."""
        return {}

    def forget_kept_buffers(self):
        """Drop every cached view of the kept buffers: the plan's views are dead."""

    def round_kept(self, rounding, top):
        """Emulated 16-bit storage (caffeplus.precision, CPU): round in place,
        with `rounding`, what the layer keeps for its backward where the GPU
        keeps it in the maps' 16-bit type, before its tops are rounded."""

    def internal_bytes(self):
        """Bytes the layer keeps between its passes, where it knows them
        better than the planner's model; None: the model's estimate."""
        return None

    def gpu_internal_bytes(self):
        """What internal_buffers keeps on a GPU with cuDNN, for the estimate
        made on a CPU net; None: the model's estimate."""
        return None

    def can_mask(self):
        """Whether the layer can keep a mask instead of its maps (caffeplus.memory.masks)."""
        return False

    def set_masked(self, on):
        """Mask (or stop masking) the layer; returns whether it is masked."""
        return False

    def workspace_manager(self):
        """The workspace manager the layer's calls take workspace from, if it holds one."""
        return None

    def chosen_workspace_bytes(self):
        """workspace_bytes() of the algorithms chosen so far, without choosing."""
        return self.workspace_bytes()

    def can_time_calls(self):
        """Whether time_calls(ws_ptr, ws_bytes) can time the layer's calls now
        (plan auto's search: caffeplus.memory.calibration.measure_net)."""
        return False

    def auto_timed_search(self):
        """Whether the layer's calls ask for a timed algorithm search under
        its workspace manager although the search mode is not 'timed'."""
        return False

    def gemm_rows(self):
        """Rows of the layer's matrix product (InnerProduct's M), for the
        time model; None: not known."""
        return None

    def to_proto(self, write_diff=False):
        param = caffe_pb2.LayerParameter()
        param.CopyFrom(self.layer_param)
        del param.blobs[:]
        for b in self.blobs:
            b.to_proto(param.blobs.add(), write_diff)
        return param

    def __repr__(self):
        return '<%s layer %s>' % (self.layer_param.type, self.layer_param.name)


class LossLayer(Layer):
    """Caffe's LossLayer: two bottoms by default, a scalar top, weight 1.
    A prototxt may leave the top out (auto_top_blobs), as Caffe allows."""
    exact_num_bottom = 2
    exact_num_top = 1
    auto_top_blobs = True

    def setup(self, bottom, top):
        if len(self.layer_param.loss_weight) == 0:
            self.layer_param.loss_weight.append(1.0)
        super().setup(bottom, top)

    def allow_force_backward(self, bottom_index):
        # Labels never take a gradient.
        return bottom_index != 1

    def reshape(self, bottom, top):
        if bottom[0].shape[:1] != bottom[1].shape[:1]:
            raise NetError('layer %s: the data and label should have the same first '
                           'dimension (%s vs %s)' % (self.layer_param.name,
                                                    bottom[0].shape_string(), bottom[1].shape_string()))
        top[0].reshape(())


class NeuronLayer(Layer):
    """One bottom, one top of the same shape, may run in place."""
    exact_num_bottom = 1
    exact_num_top = 1
    inplace_ok = True

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape)


def layer_error(layer, message):
    """A NetError naming the layer and its type: 'layer conv1 (Convolution): ...'."""
    return NetError('layer %s (%s): %s' % (layer.layer_param.name, layer.layer_param.type, message))


def float32(x):
    """Round a Python float to the nearest float32, as Caffe's Dtype does."""
    return float(numpy.float32(x))
