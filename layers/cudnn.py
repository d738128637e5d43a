"""cuDNN engines for the layers cuDNN has: Convolution, Deconvolution,
Pooling, LRN, Softmax, ReLU, Sigmoid, TanH, ELU.

Each class here subclasses the generic layer and is registered with
caffeplus.layer.register_engine('CUDNN'): create_layer picks it when the
layer's engine is DEFAULT or CUDNN (engine: CAFFE keeps the generic class).
With NumPy arrays (CPU mode), or a configuration cuDNN does not cover, every
method falls back to the parent's generic code, so CPU results are the
generic layer's, bit for bit. With CuPy arrays the math goes to cuDNN.

Descriptors are built at reshape (cached by shape, so the net's reshape
before every forward costs a dict lookup), never per call. Convolution
workspace comes from the layer's workspace manager (caffeplus.memory.
workspace): the net's arena, or under plan 'stock' the layer's own buffer,
with the groups run one cuDNN call each, as in Caffe 1.0.

Where cuDNN disagrees with Caffe, the generic CuPy path runs instead:
  * Pooling whose Caffe output shape (ceil rule) differs from cuDNN's floor
    rule, STOCHASTIC pooling, and MAX pooling with the mask top;
  * LRN WITHIN_CHANNEL, or parameters outside cuDNN's ranges;
  * ReLU with a negative slope; ELU computed in place (cuDNN's ELU backward
    reads the bottom, which in place is gone);
  * convolutions with more than 3 spatial axes or the channel axis not 1.
"""
import numpy

from caffeplus import backend, log
from caffeplus.errors import CaffeplusError
from caffeplus.layer import register_engine
from caffeplus.layers.common import SoftmaxLayer
from caffeplus.layers.neuron import ELULayer, ReLULayer, SigmoidLayer, TanHLayer
from caffeplus.layers.vision import (AVE, MAX, ConvolutionLayer, DeconvolutionLayer,
                                     LRNLayer, PoolingLayer)
from caffeplus.proto import caffe_pb2

READS_BOTH = frozenset(('bottom_data', 'top_data'))
FLOAT_BYTES = 4
CUDNN_ENGINE = 2
_status = {'available': None, 'warned': False}


def _is_cupy(*arrays):
    return all(type(a).__module__.startswith('cupy') for a in arrays)


def cudnn_available():
    if _status['available'] is None:
        from caffeplus.cudnn import lib
        _status['available'] = lib.available()
    return _status['available']


def _prod(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _contiguous_strides(shape):
    strides, acc = [], 1
    for d in reversed(shape):
        strides.insert(0, acc)
        acc *= int(d)
    return strides


def _as4d(shape):
    """A blob shape as cuDNN's (N, C, H, W): trailing axes folded, 1s added."""
    shape = [int(d) for d in shape] or [1]
    if len(shape) > 4:
        shape = shape[:3] + [_prod(shape[3:])]
    while len(shape) < 4:
        shape.append(1)
    return tuple(shape)


# cuDNN's tensor descriptors index with 32-bit ints: larger blobs run generically.
MAX_CUDNN_COUNT = 2 ** 31 - 1


def _fits(*shapes):
    return all(_prod(s) <= MAX_CUDNN_COUNT for s in shapes)


def _addr(array, offset_bytes=0):
    return int(array.data.ptr) + int(offset_bytes)


class _CudnnMixin:
    """Shared by every cuDNN layer: the decision to use cuDNN."""
    engine = 'CUDNN'

    def _explicit_cudnn(self):
        field = {'Convolution': 'convolution_param', 'Deconvolution': 'convolution_param',
                 'Pooling': 'pooling_param', 'LRN': 'lrn_param', 'ReLU': 'relu_param',
                 'Sigmoid': 'sigmoid_param', 'TanH': 'tanh_param',
                 'Softmax': 'softmax_param'}.get(self.layer_param.type)
        return field is not None and self.layer_param.HasField(field) and \
            getattr(self.layer_param, field).engine == CUDNN_ENGINE

    def _cudnn_usable(self, *arrays):
        """CuPy arrays and a loadable cuDNN (engine: CUDNN without one is an error)."""
        if not _is_cupy(*arrays):
            return False
        if cudnn_available():
            return True
        if self._explicit_cudnn():
            from caffeplus.cudnn import lib
            lib.library()           # raises the error that names what is missing
        if not _status['warned']:
            _status['warned'] = True
            log.warning('cuDNN was not found: GPU layers run their generic CuPy code. %s',
                        _missing_cudnn_hint())
        return False

    @staticmethod
    def _gpu_mode():
        return backend.mode() == backend.GPU


def _missing_cudnn_hint():
    try:
        from caffeplus.cudnn import lib
        lib.library()
    except CaffeplusError as exc:
        return str(exc)
    return ''


# =============================================================================
# Convolution and Deconvolution
# =============================================================================
class _ConvDescs:
    """Descriptors of one convolution geometry in cuDNN's terms: conv-x is
    the convolution's input (the layer's bottom, or a Deconvolution's top),
    conv-y its output. With `split` (plan stock) each group is its own call
    on channel-sliced, full-stride descriptors, as Caffe 1.0 does."""

    def __init__(self, layer, split):
        from caffeplus.backend import mathmode
        from caffeplus.cudnn import api
        n = layer.num
        if layer.reverse:
            xsp, ysp, cx, cy = layer.out_spatial, layer.in_spatial, layer.num_output, layer.channels
        else:
            xsp, ysp, cx, cy = layer.in_spatial, layer.out_spatial, layer.channels, layer.num_output
        group = layer.group
        G = group if split else 1
        self.loops = G
        x_full = (n, cx) + tuple(xsp)
        y_full = (n, cy) + tuple(ysp)
        self.x_full, self.y_full = x_full, y_full
        self.x = api.TensorDesc((n, cx // G) + tuple(xsp), _contiguous_strides(x_full))
        self.y = api.TensorDesc((n, cy // G) + tuple(ysp), _contiguous_strides(y_full))
        w_shape = tuple(layer.blobs[0].shape)
        self.w_shape = w_shape
        self.w = api.FilterDesc((w_shape[0] // G,) + tuple(w_shape[1:]))
        geom = layer.geom
        self.conv = api.ConvDesc(geom.pad, geom.stride, geom.dilation, group // G,
                                 mathmode.cudnn_math_type())
        self.x_off = (cx // G) * _prod(xsp) * FLOAT_BYTES
        self.y_off = (cy // G) * _prod(ysp) * FLOAT_BYTES
        self.w_off = (_prod(w_shape) // G) * FLOAT_BYTES
        m = layer.num_output
        self.b_off = (m // G) * FLOAT_BYTES
        self.bias = api.TensorDesc((1, m // G) + (1,) * len(geom.kernel)) \
            if layer.bias_term else None
        self.top = self.x if layer.reverse else self.y
        self.top_off = self.x_off if layer.reverse else self.y_off

    def candidates(self, kind):
        from caffeplus.cudnn import api
        return api.heuristic_algorithms(kind, self.x, self.w, self.conv, self.y)

    def timer(self, kind):
        """A callable that times `kind` with FindEx on scratch arrays."""
        def run(ws_ptr, ws_bytes):
            import cupy
            from caffeplus.cudnn import api
            xa = cupy.random.standard_normal(self.x_full, dtype=numpy.float32)
            ya = cupy.random.standard_normal(self.y_full, dtype=numpy.float32)
            wa = cupy.random.standard_normal(self.w_shape, dtype=numpy.float32)
            try:
                return api.timed_algorithms(kind, self.x, self.w, self.conv, self.y, xa, wa, ya,
                                            ws_ptr or None, ws_bytes)
            finally:
                del xa, ya, wa
        return run


class _CudnnConvolutionMixin(_CudnnMixin):

    def layer_setup(self, bottom, top):
        super().layer_setup(bottom, top)
        self._cd = None
        self._cd_key = None
        self._sites = {}
        self._ws = None
        if not hasattr(self, 'memory_plan'):
            self.memory_plan = None

    # -- which configurations go to cuDNN ------------------------------------
    def _cudnn_geometry_ok(self):
        if not (self.channel_axis == 1 and 1 <= self.num_spatial <= 3 and self.num > 0):
            return False
        return _fits((self.num, self.channels) + tuple(self.in_spatial),
                     (self.num, self.num_output) + tuple(self.out_spatial))

    def _split_groups(self):
        return self.memory_plan == 'stock' and self.group > 1

    # -- workspace ----------------------------------------------------------
    def set_workspace_manager(self, manager, plan_name):
        """Called by caffeplus.memory.workspace.apply_workspace_plan."""
        if self._ws is not None and self._ws is not manager:
            self._ws.unregister(self)
        self._ws = manager
        self.memory_plan = plan_name
        if plan_name == 'stock' and backend.mode() == backend.GPU and cudnn_available():
            manager.create_handles()
        if self._cd is not None:
            if self._cd.loops == (self.group if self._split_groups() else 1):
                manager.register(self, list(self._sites.values()))     # same descriptors
                if plan_name == 'stock':
                    manager.plan()
            else:
                self._cd_key = None
                self._build_cudnn()

    def _manager(self):
        if self._ws is None:
            from caffeplus.memory import workspace
            self._ws = workspace.default_arena()
        return self._ws

    def _key(self):
        from caffeplus.backend import mathmode
        from caffeplus.memory import workspace
        return (self.num, tuple(self.in_spatial), tuple(self.out_spatial), self._split_groups(),
                mathmode.generation(), workspace.search_mode(), backend.device())

    def _build_cudnn(self):
        """Descriptors and call sites for the current shapes (cached)."""
        key = self._key()
        if key == self._cd_key:
            return
        from caffeplus.memory import workspace
        cd = _ConvDescs(self, self._split_groups())
        timed = workspace.search_mode() == 'timed' and self.memory_plan != 'stock'
        sites = {}
        for kind in workspace.KINDS:
            sites[kind] = workspace.Site(kind, cd.candidates(kind),
                                         timer=cd.timer(kind) if timed else None)
        self._cd, self._sites, self._cd_key = cd, sites, key
        mgr = self._manager()
        mgr.register(self, list(sites.values()))
        if self.memory_plan == 'stock':
            mgr.plan()          # Caffe allocates its workspace in Reshape

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if self._gpu_mode() and self._cudnn_geometry_ok() and cudnn_available():
            self._build_cudnn()

    def _ready(self, *arrays):
        if not self._cudnn_geometry_ok() or not self._cudnn_usable(*arrays):
            return False
        self._build_cudnn()
        return True

    def workspace_bytes(self):
        """Arena need: the largest workspace of this layer's chosen algorithms."""
        if self._cd is None or not self._sites:
            return super().workspace_bytes()
        self._manager().ensure_planned()
        return max([s.choice.memory for s in self._sites.values() if s.choice is not None] + [0])

    def stock_workspace_bytes(self):
        """What Caffe 1.0 allocates for this layer: per-group descriptors,
        first _v7 algorithm within 8 MiB per kind, max * group * 3."""
        if self._cd is None:
            return 0
        from caffeplus.memory import workspace
        cd = self._cd if self._cd.loops == self.group else _ConvDescs(self, True)
        choices = [workspace.choose_stock(cd.candidates(k)) for k in workspace.KINDS]
        return workspace.stock_bytes(choices, self.group)

    def algorithms(self):
        """{kind: chosen AlgoChoice} (for logs and tests)."""
        if self._cd is not None:
            self._manager().ensure_planned()
        return {k: s.choice for k, s in self._sites.items()}

    # -- the math -----------------------------------------------------------
    def _forward(self, bottom, top):
        if not self._ready(bottom[0].data, self.blobs[0].data):
            return super()._forward(bottom, top)
        from caffeplus.cudnn import api
        cd, mgr = self._cd, self._manager()
        mgr.ensure_planned()
        w = self.blobs[0].data
        b = self.blobs[1].data if self.bias_term else None
        for bb, tt in zip(bottom, top):
            x, y = bb.data, tt.data
            if not self.reverse:
                algo = self._sites['fwd'].choice.algo
                with mgr.checkout(self, 'fwd') as (ws, ws_bytes):
                    for g in range(cd.loops):
                        api.conv_forward(cd.x, _addr(x, g * cd.x_off), cd.w, _addr(w, g * cd.w_off),
                                         cd.conv, algo, ws or None, ws_bytes, cd.y,
                                         _addr(y, g * cd.y_off))
            else:
                # Deconvolution forward = the convolution's backward data:
                # the bottom is conv-y, the top conv-x.
                algo = self._sites['bwd_data'].choice.algo
                with mgr.checkout(self, 'bwd_data') as (ws, ws_bytes):
                    for g in range(cd.loops):
                        api.conv_backward_data(cd.w, _addr(w, g * cd.w_off), cd.y,
                                               _addr(x, g * cd.y_off), cd.conv, algo,
                                               ws or None, ws_bytes, cd.x, _addr(y, g * cd.x_off))
            if b is not None:
                for g in range(cd.loops):
                    api.add_tensor(cd.bias, _addr(b, g * cd.b_off), cd.top,
                                   _addr(y, g * cd.top_off))

    def _backward(self, top, propagate_down, bottom):
        if not self._ready(top[0].diff, self.blobs[0].data):
            return super()._backward(top, propagate_down, bottom)
        from caffeplus.cudnn import api
        cd, mgr = self._cd, self._manager()
        mgr.ensure_planned()
        wblob = self.blobs[0]
        w = wblob.data
        dw = wblob.diff if self.param_needs_backward(0) else None
        db = self.blobs[1].diff if self.bias_term and self.param_needs_backward(1) else None
        for i, (bb, tt) in enumerate(zip(bottom, top)):
            dtop = tt.diff
            if db is not None:
                for g in range(cd.loops):
                    api.conv_backward_bias(cd.top, _addr(dtop, g * cd.top_off), cd.bias,
                                           _addr(db, g * cd.b_off), beta=1.0)
            if not self.reverse:
                if dw is not None:
                    x = bb.data
                    algo = self._sites['bwd_filter'].choice.algo
                    with mgr.checkout(self, 'bwd_filter') as (ws, ws_bytes):
                        for g in range(cd.loops):
                            api.conv_backward_filter(cd.x, _addr(x, g * cd.x_off), cd.y,
                                                     _addr(dtop, g * cd.y_off), cd.conv, algo,
                                                     ws or None, ws_bytes, cd.w,
                                                     _addr(dw, g * cd.w_off), beta=1.0)
                if propagate_down[i]:
                    dx = bb.diff
                    algo = self._sites['bwd_data'].choice.algo
                    with mgr.checkout(self, 'bwd_data') as (ws, ws_bytes):
                        for g in range(cd.loops):
                            api.conv_backward_data(cd.w, _addr(w, g * cd.w_off), cd.y,
                                                   _addr(dtop, g * cd.y_off), cd.conv, algo,
                                                   ws or None, ws_bytes, cd.x,
                                                   _addr(dx, g * cd.x_off))
            else:
                if dw is not None:
                    x = bb.data         # conv-y
                    algo = self._sites['bwd_filter'].choice.algo
                    with mgr.checkout(self, 'bwd_filter') as (ws, ws_bytes):
                        for g in range(cd.loops):
                            api.conv_backward_filter(cd.x, _addr(dtop, g * cd.x_off), cd.y,
                                                     _addr(x, g * cd.y_off), cd.conv, algo,
                                                     ws or None, ws_bytes, cd.w,
                                                     _addr(dw, g * cd.w_off), beta=1.0)
                if propagate_down[i]:
                    dx = bb.diff
                    algo = self._sites['fwd'].choice.algo
                    with mgr.checkout(self, 'fwd') as (ws, ws_bytes):
                        for g in range(cd.loops):
                            api.conv_forward(cd.x, _addr(dtop, g * cd.x_off), cd.w,
                                             _addr(w, g * cd.w_off), cd.conv, algo, ws or None,
                                             ws_bytes, cd.y, _addr(dx, g * cd.y_off))


@register_engine('CUDNN')
class CuDNNConvolutionLayer(_CudnnConvolutionMixin, ConvolutionLayer):
    """Convolution through cuDNN (groups by cudnnSetConvolutionGroupCount,
    dilation, 1-3 spatial axes through Nd descriptors)."""


@register_engine('CUDNN')
class CuDNNDeconvolutionLayer(_CudnnConvolutionMixin, DeconvolutionLayer):
    """Deconvolution through cuDNN: forward is backward-data, backward is
    forward and backward-filter."""


# =============================================================================
# Pooling
# =============================================================================
def cudnn_pool_size(size, kernel, stride, pad):
    """cuDNN's output size (floor rule)."""
    return 1 + (size + 2 * pad - kernel) // stride


@register_engine('CUDNN')
class CuDNNPoolingLayer(_CudnnMixin, PoolingLayer):
    """MAX and AVE pooling through cuDNN where cuDNN's output shape equals
    Caffe's; there Caffe's AVE divisor (the window clipped to H + pad) is
    the full kernel, which is cuDNN's AVERAGE_COUNT_INCLUDE_PADDING."""

    def __init__(self, layer_param):
        super().__init__(layer_param)
        if backend.mode() == backend.GPU and \
                self.layer_param.pooling_param.pool in (MAX, AVE):
            self.backward_reads = READS_BOTH        # cuDNN's backward reads x and y

    def layer_setup(self, bottom, top):
        super().layer_setup(bottom, top)
        self._pd = None
        self._pd_key = None

    def cudnn_agrees(self):
        """Whether cuDNN computes exactly Caffe's pooling for this geometry."""
        pool = self.pool
        if pool is None or pool.method not in (MAX, AVE) or self._ntop != 1 or \
                not _fits(pool.x_shape):
            return False
        (kh, kw), (sh, sw), (ph, pw) = pool.geom
        h, w = pool.x_shape[2:]
        oh, ow = pool.out_shape[2:]
        return cudnn_pool_size(h, kh, sh, ph) == oh and cudnn_pool_size(w, kw, sw, pw) == ow

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self._ntop = len(top)
        if self._gpu_mode() and cudnn_available() and self.cudnn_agrees():
            self._build()

    def _build(self):
        from caffeplus.backend import mathmode
        from caffeplus.cudnn import api
        pool = self.pool
        key = (pool.x_shape, pool.out_shape, tuple(pool.geom), pool.method,
               mathmode.generation(), backend.device())
        if key == self._pd_key:
            return
        if pool.method == MAX:
            mode = api.POOL_MAX_DETERMINISTIC if mathmode.deterministic() else api.POOL_MAX
        else:
            mode = api.POOL_AVG_INCLUDE_PAD
        self._pd = (api.PoolDesc(mode, pool.geom.kernel, pool.geom.pad, pool.geom.stride),
                    api.TensorDesc(pool.x_shape), api.TensorDesc(pool.out_shape))
        self._pd_key = key

    def _ready(self, *arrays):
        if not self.cudnn_agrees() or not self._cudnn_usable(*arrays):
            return False
        self._build()
        return True

    def _forward(self, bottom, top):
        if not self._ready(bottom[0].data):
            return super()._forward(bottom, top)
        from caffeplus.cudnn import api
        pd, xd, yd = self._pd
        api.pooling_forward(pd, xd, bottom[0].data, yd, top[0].data)

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if not self._ready(top[0].diff):
            return super()._backward(top, propagate_down, bottom)
        from caffeplus.cudnn import api
        pd, xd, yd = self._pd
        api.pooling_backward(pd, yd, top[0].data, top[0].diff, xd, bottom[0].data,
                             bottom[0].diff)


# =============================================================================
# LRN
# =============================================================================
@register_engine('CUDNN')
class CuDNNLRNLayer(_CudnnMixin, LRNLayer):
    """ACROSS_CHANNELS LRN through cuDNN (same formula: k + alpha/n * sum x^2);
    WITHIN_CHANNEL and parameters outside cuDNN's ranges run generically."""

    def __init__(self, layer_param):
        super().__init__(layer_param)
        if backend.mode() == backend.GPU:
            self.backward_reads = READS_BOTH

    def layer_setup(self, bottom, top):
        super().layer_setup(bottom, top)
        self._desc = None
        self._desc_key = None

    def _cudnn_ok(self, shape=()):
        return (self.region == caffe_pb2.LRNParameter.ACROSS_CHANNELS and _fits(shape) and
                1 <= self.size <= 16 and self.k >= 1e-5 and self.beta >= 0.01 and
                self.alpha >= 1e-5)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if self._gpu_mode() and cudnn_available() and self._cudnn_ok(bottom[0].shape):
            self._build(bottom[0].shape)

    def _build(self, shape):
        from caffeplus.cudnn import api
        key = (tuple(shape), backend.device())
        if key == self._desc_key:
            return
        self._desc = (api.LRNDesc(self.size, self.alpha, self.beta, self.k),
                      api.TensorDesc(_as4d(shape)))
        self._desc_key = key

    def _ready(self, x):
        if not self._cudnn_ok(x.shape) or not self._cudnn_usable(x):
            return False
        self._build(x.shape)
        return True

    def _forward(self, bottom, top):
        if not self._ready(bottom[0].data):
            return super()._forward(bottom, top)
        from caffeplus.cudnn import api
        lrn, xd = self._desc
        api.lrn_forward(lrn, xd, bottom[0].data, top[0].data)

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if not self._ready(bottom[0].data):
            return super()._backward(top, propagate_down, bottom)
        from caffeplus.cudnn import api
        lrn, xd = self._desc
        api.lrn_backward(lrn, xd, top[0].data, top[0].diff, bottom[0].data, bottom[0].diff)


# =============================================================================
# Softmax
# =============================================================================
@register_engine('CUDNN')
class CuDNNSoftmaxLayer(_CudnnMixin, SoftmaxLayer):
    """Softmax along `axis` as cuDNN's CHANNEL mode on (outer, C, inner, 1)."""

    def layer_setup(self, bottom, top):
        super().layer_setup(bottom, top)
        self._desc = None
        self._desc_key = None

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if self._gpu_mode() and cudnn_available() and _fits(bottom[0].shape):
            self._build(bottom[0].shape)

    def _build(self, shape):
        from caffeplus.cudnn import api
        key = (tuple(shape), self.axis, backend.device())
        if key == self._desc_key:
            return
        outer = _prod(shape[:self.axis])
        inner = _prod(shape[self.axis + 1:])
        self._desc = api.TensorDesc((outer, int(shape[self.axis]), inner, 1))
        self._desc_key = key

    def _ready(self, x):
        if not _fits(x.shape) or not self._cudnn_usable(x):
            return False
        self._build(x.shape)
        return True

    def _forward(self, bottom, top):
        if not self._ready(bottom[0].data):
            return super()._forward(bottom, top)
        from caffeplus.cudnn import api
        api.softmax_forward(self._desc, bottom[0].data, top[0].data)

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if not self._ready(top[0].data):
            return super()._backward(top, propagate_down, bottom)
        from caffeplus.cudnn import api
        api.softmax_backward(self._desc, top[0].data, top[0].diff, bottom[0].diff)


# =============================================================================
# Activations
# =============================================================================
class _CudnnActivationMixin(_CudnnMixin):
    """cuDNN activation forward/backward on the blob as one (N, C, H, W)."""
    act_mode = None
    # Whether backward may pass the top as cuDNN's x: true for ReLU, Sigmoid
    # and TanH, whose gradients cuDNN computes from y (Caffe's cuDNN layers
    # run them in place, where x is y).
    x_from_top = True

    def _act_coef(self):
        return 0.0

    def _act_ok(self, bottom, top):
        return True

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if self._gpu_mode() and cudnn_available() and self._act_ok(bottom, top) and \
                _fits(bottom[0].shape):
            self._build(bottom[0].shape)

    def _build(self, shape):
        from caffeplus.cudnn import api
        key = (tuple(shape), backend.device())
        if key == getattr(self, '_act_key', None):
            return
        self._act = (api.ActivationDesc(self.act_mode, self._act_coef()),
                     api.TensorDesc(_as4d(shape)))
        self._act_key = key

    def _ready(self, bottom, top, x):
        if not self._act_ok(bottom, top) or not _fits(x.shape) or not self._cudnn_usable(x):
            return False
        self._build(x.shape)
        return True

    def _forward(self, bottom, top):
        if not self._ready(bottom, top, bottom[0].data):
            return super()._forward(bottom, top)
        from caffeplus.cudnn import api
        act, xd = self._act
        api.activation_forward(act, xd, bottom[0].data, top[0].data)

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if not self._ready(bottom, top, top[0].data):
            return super()._backward(top, propagate_down, bottom)
        from caffeplus.cudnn import api
        act, xd = self._act
        y = top[0].data
        x = y if self.x_from_top else bottom[0].data
        api.activation_backward(act, xd, y, top[0].diff, x, bottom[0].diff)


@register_engine('CUDNN')
class CuDNNReLULayer(_CudnnActivationMixin, ReLULayer):
    """ReLU through cuDNN (negative_slope 0 only; a leaky ReLU runs generically)."""

    @property
    def act_mode(self):
        from caffeplus.cudnn import api
        return api.ACT_RELU

    def _act_ok(self, bottom, top):
        return self.slope == 0


@register_engine('CUDNN')
class CuDNNSigmoidLayer(_CudnnActivationMixin, SigmoidLayer):

    @property
    def act_mode(self):
        from caffeplus.cudnn import api
        return api.ACT_SIGMOID


@register_engine('CUDNN')
class CuDNNTanHLayer(_CudnnActivationMixin, TanHLayer):

    @property
    def act_mode(self):
        from caffeplus.cudnn import api
        return api.ACT_TANH


@register_engine('CUDNN')
class CuDNNELULayer(_CudnnActivationMixin, ELULayer):
    """ELU through cuDNN when not in place (its backward reads the bottom)."""
    x_from_top = False

    def __init__(self, layer_param):
        super().__init__(layer_param)
        if backend.mode() == backend.GPU:
            self.backward_reads = READS_BOTH

    @property
    def act_mode(self):
        from caffeplus.cudnn import api
        return api.ACT_ELU

    def _act_coef(self):
        return float(self.alpha)

    def _act_ok(self, bottom, top):
        return bottom[0].data_storage is not top[0].data_storage
