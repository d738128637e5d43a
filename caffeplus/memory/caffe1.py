"""Stock Caffe 1.0's layer-internal device buffers, for the `stock` plan.

BVLC Caffe 1.0 (built with cuDNN) keeps, besides every blob's data and diff
and the cuDNN convolution workspaces (caffeplus.memory.workspace's
StockWorkspace), buffers of its own inside some layer classes, for the whole
run. caffeplus's layers keep fewer, so its `stock` plan would fall short of
stock Caffe's device memory. This module lists Caffe's buffers for a built
net and, in GPU mode under `stock`, allocates the ones our layers do not
already keep:

  layer (Caffe class)            buffer          size, type           when
  BatchNorm                      temp_           bottom, float32      always
                                 x_norm_         bottom, float32      always
                                 x_norm_.diff    bottom, float32      in place, backward
  Scale                          temp_           bottom, float32      in place
  Pooling MAX, one top           max_idx_        top, int32           always (Caffe's own
                                                                      PoolingLayer, not cuDNN)
  Pooling STOCHASTIC             rand_idx_       top, float32         TRAIN
  Dropout                        rand_vec_       bottom, uint32       TRAIN
  SoftmaxWithLoss                prob_           bottom 0, float32    always
                                 prob_.diff      bottom 0, float32    always (the label counts)
  MVN                            temp_           bottom, float32      always
  LRN ACROSS_CHANNELS, engine    scale_          bottom, float32      always (size > 16 or
    CAFFE or local_size > 16                                          engine CAFFE: LRNLayer)
  LRN WITHIN_CHANNEL (cuDNN LCN) tempData1, 2    bottom, float32 each always
  Eltwise MAX, one top           max_idx_        top, int32           always

("always": every forward touches it; "backward": the layer runs backward:
net.layer_need_backward, in a net that trains: TRAIN phase or
force_backward.) Left out: per-channel and per-sample vectors (a
BatchNorm's mean_/variance_/num_by_chans_, the multipliers; under 0.1% of
any bench net), engine: CAFFE convolutions' col_buffer_, and LRN
WITHIN_CHANNEL with engine CAFFE (a sub-net of five layers).

cuDNN handles. Besides the convolutions (3 handles per group, emulated by
StockWorkspace), every other layer Caffe 1.0 builds as a cuDNN class
creates a cuDNN handle of its own in LayerSetUp (cudnnCreate; no buffer):
ReLU, Sigmoid, TanH, Softmax (and SoftmaxWithLoss's internal Softmax), AVE
pooling, LRN (cuDNN LRN or LCN); engine: CAFFE layers do not. A handle
costs device memory (about what workspace_model.HANDLE_BYTES says), and
nets like GoogLeNet have dozens, so attach() creates one per such layer
too (handle_layers()).

Who holds each buffer (Caffe1Buffer.holder):
  'layer'   our layer already keeps one like it (Eltwise MAX's int32 mask,
            the generic LRN's scale): counted, nothing allocated.
  'caffe1'  attach() allocates it, zero-filled, on the layer
            (layer._caffe1_buffers). Where our layer has a buffer of the same
            role, the layer is handed Caffe's buffer and computes in it
            instead of its own, so nothing is held twice: as the kept buffer
            Caffe1Buffer.role names (BatchNorm's normalized copy x_norm, an
            unchained in-place Scale's bottom_copy, max pooling's argmax),
            when the layer declares it (`internal_buffers()`,
            caffeplus.memory.scratch), viewed in the declared dtype if that
            fits in Caffe's bytes; through the attribute Caffe1Buffer.adopt
            names for Dropout's mask (`mask_buffer`).

The estimator (caffeplus.memory.workspace_model) counts, for `stock`,
own_bytes(net) + extra_bytes(net): exactly what these buffers hold.
On the CPU nothing is allocated.
"""
import collections

import numpy

from caffeplus import backend, log
from caffeplus.memory import scratch
from caffeplus.proto import caffe_pb2

CUDNN_LRN_MAX_N = 16        # Caffe 1.0 runs LRN through cuDNN up to this local_size
ATTR = '_caffe1_buffers'    # where a layer holds what attach() allocated: {name: array}
ADOPTED = '_caffe1_adopted'  # {layer attribute or ('kept', name): array} lent to the layer
KEPT = scratch.OWN           # a layer's own kept buffers {name: array}
HANDLE = '_caffe1_handle'    # the cuDNN handle a layer holds as Caffe's does

Caffe1Buffer = collections.namedtuple(
    'Caffe1Buffer', 'layer_index layer name shape dtype nbytes holder adopt role')


def _count(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _buffer(i, layer, name, shape, dtype, holder='caffe1', adopt=None, role=None):
    shape = tuple(int(d) for d in shape)
    dtype = numpy.dtype(dtype)
    if adopt is not None and not hasattr(type(layer), adopt):
        adopt = None            # this class has no buffer of that role
    return Caffe1Buffer(i, layer.layer_param.name, name, shape, dtype.name,
                        _count(shape) * dtype.itemsize, holder, adopt, role)


def _engine(layer):
    from caffeplus.layer import layer_engine
    return layer_engine(layer.layer_param)


# -- Caffe 1.0's rules, one function per layer type ---------------------------------
def _runs_backward(net, i):
    """Whether layer i's backward runs: it needs one and the net trains (TRAIN
    phase or force_backward, as the memory plans assume; a TEST net's
    backward never runs under a solver)."""
    trains = net.phase == caffe_pb2.TRAIN or bool(getattr(net.net_param, 'force_backward',
                                                          False))
    return trains and bool(net.layer_need_backward[i])


def _batch_norm(net, i, layer):
    bottom, top = net.bottom_vecs[i][0], net.top_vecs[i][0]
    out = [_buffer(i, layer, 'temp_', bottom.shape, numpy.float32),
           _buffer(i, layer, 'x_norm_', bottom.shape, numpy.float32, role='x_norm')]
    if bottom is top and _runs_backward(net, i):
        # In place, Backward_gpu copies the top diff here before overwriting it.
        out.append(_buffer(i, layer, 'x_norm_.diff', bottom.shape, numpy.float32))
    return out


def _scale(net, i, layer):
    bottom, top = net.bottom_vecs[i][0], net.top_vecs[i][0]
    if bottom is not top:
        return []
    return [_buffer(i, layer, 'temp_', bottom.shape, numpy.float32, role='bottom_copy')]


def _pooling(net, i, layer):
    pool = layer.layer_param.pooling_param.pool
    P = caffe_pb2.PoolingParameter
    top = net.top_vecs[i]
    if pool == P.MAX and len(top) == 1:
        # layer_factory: MAX pooling always runs Caffe's own PoolingLayer.
        return [_buffer(i, layer, 'max_idx_', top[0].shape, numpy.int32, role='argmax')]
    if pool == P.STOCHASTIC and layer.phase == caffe_pb2.TRAIN:
        return [_buffer(i, layer, 'rand_idx_', top[0].shape, numpy.float32)]
    return []


def _dropout(net, i, layer):
    if layer.phase != caffe_pb2.TRAIN:
        return []
    return [_buffer(i, layer, 'rand_vec_', net.bottom_vecs[i][0].shape, numpy.uint32,
                    adopt='mask_buffer', role='mask')]


def _softmax_loss(net, i, layer):
    shape = net.bottom_vecs[i][0].shape
    return [_buffer(i, layer, 'prob_', shape, numpy.float32),
            _buffer(i, layer, 'prob_.diff', shape, numpy.float32)]


def _mvn(net, i, layer):
    return [_buffer(i, layer, 'temp_', net.bottom_vecs[i][0].shape, numpy.float32)]


def _lrn(net, i, layer):
    p = layer.layer_param.lrn_param
    shape = net.bottom_vecs[i][0].shape
    from caffeplus.layer import ENGINE_CAFFE
    if p.norm_region == caffe_pb2.LRNParameter.ACROSS_CHANNELS:
        if _engine(layer) == ENGINE_CAFFE or p.local_size > CUDNN_LRN_MAX_N:
            # Caffe's LRNLayer; ours runs its generic code there and keeps `scale`.
            return [_buffer(i, layer, 'scale_', shape, numpy.float32, holder='layer')]
        return []
    if _engine(layer) == ENGINE_CAFFE:
        return []               # Caffe's within-channel sub-net: not modelled
    # CuDNNLCNLayer; our generic within-channel code keeps `scale` (one of them).
    return [_buffer(i, layer, 'tempData1', shape, numpy.float32, holder='layer'),
            _buffer(i, layer, 'tempData2', shape, numpy.float32)]


def _eltwise(net, i, layer):
    if layer.layer_param.eltwise_param.operation != caffe_pb2.EltwiseParameter.MAX or \
            len(net.top_vecs[i]) != 1:
        return []
    return [_buffer(i, layer, 'max_idx_', net.top_vecs[i][0].shape, numpy.int32,
                    holder='layer')]


RULES = {'BatchNorm': _batch_norm, 'Scale': _scale, 'Pooling': _pooling,
         'Dropout': _dropout, 'SoftmaxWithLoss': _softmax_loss, 'MVN': _mvn, 'LRN': _lrn,
         'Eltwise': _eltwise}


# -- what a net holds ---------------------------------------------------------------
def layer_buffers(net, i):
    """Caffe 1.0's internal buffers of layer i of a built net."""
    layer = net.layers[i]
    rule = RULES.get(layer.layer_param.type)
    return rule(net, i, layer) if rule is not None else []


def stock_buffers(net):
    """Every Caffe 1.0 internal buffer of a built net, in layer order."""
    out = []
    for i in range(len(net.layers)):
        out.extend(layer_buffers(net, i))
    return out


def extra_bytes(net):
    """Bytes attach() allocates for `net` (the buffers our layers lack)."""
    return sum(b.nbytes for b in stock_buffers(net) if b.holder == 'caffe1')


def own_bytes(net):
    """Bytes of Caffe's buffers that our layers keep themselves under `stock`."""
    return sum(b.nbytes for b in stock_buffers(net) if b.holder == 'layer')


def layer_bytes(net, i):
    """All of layer i's Caffe 1.0 buffers, whoever holds them."""
    return sum(b.nbytes for b in layer_buffers(net, i))


# -- cuDNN handles of the layers other than convolution ---------------------------
def _softmax_engine(layer):
    return layer.layer_param.softmax_param.engine


def _has_cudnn_class(net, i, layer):
    """Whether Caffe 1.0's layer_factory builds layer i as a cuDNN class
    (convolutions aside)."""
    from caffeplus.layer import ENGINE_CAFFE
    t = layer.layer_param.type
    if t in ('ReLU', 'Sigmoid', 'TanH', 'Softmax'):
        return _engine(layer) != ENGINE_CAFFE
    if t == 'SoftmaxWithLoss':          # its internal Softmax, from softmax_param
        return _softmax_engine(layer) != ENGINE_CAFFE
    if t == 'Pooling':                  # MAX runs Caffe's own class; so do two tops
        return layer.layer_param.pooling_param.pool == caffe_pb2.PoolingParameter.AVE and \
            len(net.top_vecs[i]) == 1 and _engine(layer) != ENGINE_CAFFE
    if t == 'LRN':
        p = layer.layer_param.lrn_param
        return _engine(layer) != ENGINE_CAFFE and (
            p.norm_region == caffe_pb2.LRNParameter.WITHIN_CHANNEL or
            p.local_size <= CUDNN_LRN_MAX_N)
    return False


def handle_layers(net):
    """Indices of the layers that hold a cuDNN handle of their own in Caffe
    1.0, convolutions aside (see above)."""
    return [i for i, layer in enumerate(net.layers) if _has_cudnn_class(net, i, layer)]


def handle_count(net):
    return len(handle_layers(net))


# -- on the device ----------------------------------------------------------------
def held(layer):
    """{buffer name: array} attach() gave `layer` (empty if none)."""
    return layer.__dict__.get(ATTR) or {}


def attach(net, handles=True, xp=None):
    """GPU mode: allocate (zero-filled, so the memory is really touched) the
    Caffe 1.0 buffers our layers lack, held by each layer in
    layer._caffe1_buffers; layers with a buffer of the same role compute in
    Caffe's. With `handles`, each layer of handle_layers() also gets a cuDNN
    handle (layer._caffe1_handle). A second call re-sizes to the net's
    current shapes. On the CPU nothing happens, unless `xp` (numpy, for
    tests under caffeplus.kernels' emulator) says what to allocate with.
    Returns the bytes held."""
    if xp is None:
        if backend.mode() != backend.GPU:
            return 0
        import cupy as xp
    else:
        handles = False
    detach(net)
    total = made = 0
    try:
        for b in stock_buffers(net):
            if b.holder != 'caffe1':
                continue
            layer = net.layers[b.layer_index]
            array = _zeros(xp, layer, b)
            layer.__dict__.setdefault(ATTR, {})[b.name] = array
            if b.adopt is not None:
                setattr(layer, b.adopt, array)
                layer.__dict__.setdefault(ADOPTED, {})[b.adopt] = array
            if b.role is not None:
                _lend_kept(layer, b.role, array)
            total += b.nbytes
        made = _create_handles(net) if handles else 0
    except Exception:
        detach(net)             # all or nothing
        raise
    log.info('Stock plan: %d bytes of Caffe 1.0 layer buffers, %d cuDNN handles of layers '
             'other than convolution', total, made)
    return total


def _declared(layer):
    """{name: (count, dtype)} the layer declares it keeps (caffeplus.memory.scratch)."""
    fn = getattr(layer, 'internal_buffers', None)
    return fn() if callable(fn) else {}


def _lend_kept(layer, role, array):
    """Make `array` the layer's own kept buffer `role`, in the dtype the layer
    declares for it, when the layer declares one that fits in its bytes."""
    want = _declared(layer).get(role)
    if want is None:
        return
    count, dtype = int(want[0]), numpy.dtype(want[1])
    if count * dtype.itemsize > array.nbytes or array.nbytes % dtype.itemsize:
        return
    view = array.view(dtype)            # 1-D and contiguous: a reinterpretation
    layer.__dict__.setdefault(KEPT, {})[role] = view
    layer.__dict__.setdefault(ADOPTED, {})[('kept', role)] = view


def _create_handles(net):
    from caffeplus.cudnn import api
    made = 0
    for i in handle_layers(net):
        layer = net.layers[i]
        try:
            layer.__dict__[HANDLE] = api.Handle()
        except Exception as exc:
            from caffeplus.memory import oom
            if oom.is_out_of_memory(exc):
                raise oom.out_of_memory_error(layer, 'cuDNN handle creation', exc,
                                              'stock') from exc
            # No cuDNN here: the handles only mimic Caffe's memory; go on without.
            log.warning('Stock plan: no cuDNN handles for the layers other than '
                        'convolution (%s)', exc)
            break
        made += 1
    return made


def _zeros(xp, layer, b):
    try:
        return xp.zeros(_count(b.shape), dtype=b.dtype)
    except Exception as exc:
        from caffeplus.memory import oom
        if oom.is_out_of_memory(exc):
            raise oom.out_of_memory_error(
                layer, "allocation of Caffe 1.0's %s" % b.name, exc, 'stock',
                b.nbytes) from exc
        raise


def detach(net):
    """Give back what attach() allocated; a layer that computed in one of
    them allocates its own again when it next needs it."""
    for layer in net.layers:
        layer.__dict__.pop(ATTR, None)
        layer.__dict__.pop(HANDLE, None)        # cudnnDestroy when collected
        kept = layer.__dict__.get(KEPT) or {}
        for key, array in (layer.__dict__.pop(ADOPTED, None) or {}).items():
            if isinstance(key, tuple):              # ('kept', name)
                if kept.get(key[1]) is array:
                    del kept[key[1]]                # the layer allocates its own again
            elif layer.__dict__.get(key) is array:  # not replaced by the layer since
                del layer.__dict__[key]             # back to the class default (None)
