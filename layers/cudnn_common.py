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

This module holds what the cuDNN and fused GPU layers share: the decision
to use cuDNN, cuDNN's 32-bit limits, device addresses and masking.
"""
import numpy

from caffeplus import backend, log
from caffeplus import kernels as _kernels
from caffeplus.cudnn.algo_search import _prod  # noqa: F401 (the layers' too)
from caffeplus.errors import CaffeplusError


READS_BOTH = frozenset(('bottom_data', 'top_data'))
F32 = numpy.float32


CUDNN_ENGINE = 2
_status = {'available': None, 'warned': False}


def _is_cupy(*arrays):
    return all(type(a).__module__.startswith('cupy') for a in arrays)


def cudnn_available():
    if _status['available'] is None:
        from caffeplus.cudnn import lib
        _status['available'] = lib.available()
    return _status['available']


def _as4d(shape):
    """A blob shape as cuDNN's (N, C, H, W): trailing axes folded, 1s added."""
    shape = [int(d) for d in shape] or [1]
    if len(shape) > 4:
        shape = shape[:3] + [_prod(shape[3:])]
    while len(shape) < 4:
        shape.append(1)
    return tuple(shape)


# cuDNN's tensor descriptors index with 32-bit ints. Convolution and pooling
# run larger blobs in equal slices of the batch that fit (batch_slices), one
# cuDNN call per slice; the other layers run them generically.
MAX_CUDNN_COUNT = 2 ** 31 - 1


def _fits(*shapes):
    return all(_prod(s) <= MAX_CUDNN_COUNT for s in shapes)


def batch_slices(num, *item_shapes):
    """How many equal slices of a batch of `num` items, each item of the
    given shapes (one image's tensors), each cuDNN call must run over so
    that every tensor of a call fits MAX_CUDNN_COUNT: 1 when the whole
    batch does, the fewest dividing `num` otherwise, None when one item
    alone does not fit."""
    per = max([_prod(s) for s in item_shapes] + [1])
    if per > MAX_CUDNN_COUNT or num < 1:
        return None
    if num * per <= MAX_CUDNN_COUNT:
        return 1
    for k in range(2, num + 1):
        if num % k == 0 and (num // k) * per <= MAX_CUDNN_COUNT:
            return k
    return None


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


def _dptr(blob, diff=False):
    """Device address of a blob's data (diff): its storage array, no views
    (float32 or 16-bit: the caller's descriptors carry the type)."""
    return int(_kernels.flat(blob, diff, any_dtype=True).data.ptr)


def storage_dtype(blob, diff=False):
    """The type a blob's data (diff) is stored in on the device."""
    return (blob.diff_storage if diff else blob.data_storage).dtype


def _same_storage_dtype(bottom, top):
    """Whether one type describes the layer's bottoms' and tops' data and
    diffs (float32, or a 16-bit net's), as one cuDNN descriptor does."""
    d = bottom[0].data_storage.dtype
    return all(b.data_storage.dtype == d and b.diff_storage.dtype == d
               for b in list(bottom) + list(top))


# The name of a convolution's 16-bit filters in cuDNN's channels-last order
# (K, kh, kw, C): transposed, so the one-launch refresh (a flat cast) skips them.
NHWC_WEIGHTS = 'w_nhwc'


def padded_count(blob, channels):
    """Values of `blob` with its channel axis (axis 1) padded to `channels`
    (0: as it is)."""
    return blob.count // blob.shape[1] * channels if channels else blob.count


def relaid_top(top, top_nhwc, diff=False):
    """The scratch a layer writes its top into in the other order than the
    top is stored in (its calls' or kernels' order; one buffer shared by
    every such layer, in turn); with `diff`, the top's diff copied into it
    in that order, for backward to read."""
    out = backend.device_scratch('relaid top', top.count, storage_dtype(top))
    if diff:
        copy_between_orders(out, _kernels.flat(top, True, any_dtype=True), top.shape, top_nhwc)
    return out


def top_from_relaid(top, scratch, top_nhwc):
    """relaid_top's scratch copied into the top, in the order the top is stored in."""
    copy_between_orders(_kernels.flat(top, any_dtype=True), scratch, top.shape, not top_nhwc)


class KernelPath:
    """A path through caffeplus's kernels that a layer takes until it first
    fails: the failure is noted (kernels.note_failure) and from then on the
    caller's fallback runs (a kernel that did not build or launch once
    would not the next time)."""

    def __init__(self, what):
        self.what = what
        self.ok = True

    def run(self, fn, *args):
        """fn(*args); whether it ran (False: it failed, now or before)."""
        if not self.ok:
            return False
        try:
            fn(*args)
            return True
        except Exception as exc:
            self.ok = False
            _kernels.note_failure(self.what, exc)
            return False


_TRANSPOSE = KernelPath('relayout between orders (cp_transpose)')


def _transpose_between_orders(dst, src, n, c, hw, cs, src_nhwc):
    if src_nhwc:
        _kernels.transpose(src, dst, n, hw, c, lds=cs)
    else:
        _kernels.transpose(src, dst, n, c, hw, ldd=cs, pad=cs > c)


def copy_between_orders(dst, src, shape, src_nhwc, channels=0):
    """Flat `src`, an (N, C, H, W) map channels-last if `src_nhwc` (else in
    Caffe's order), copied into flat `dst` in the other order. `channels`:
    the channels-last side's values a pixel where it is padded past C (an
    image relaid to 4 channels); the padding it writes is 0."""
    n, c, h, w = shape
    cs = channels or c
    if _TRANSPOSE.run(_transpose_between_orders, dst, src, n, c, h * w, cs, src_nhwc):
        return
    import cupy
    if src_nhwc:
        cupy.copyto(dst[:n * c * h * w].reshape(n, c, h, w),
                    src[:n * h * w * cs].reshape(n, h, w, cs)[..., :c].transpose(0, 3, 1, 2))
    else:
        out = dst[:n * h * w * cs].reshape(n, h, w, cs)
        if cs > c:
            out[..., c:] = 0
        cupy.copyto(out[..., :c], src[:n * c * h * w].reshape(n, c, h, w).transpose(0, 2, 3, 1))


def sixteen_bit_copy(copies, name, blob, dtype, reuse=False, channels_last=False,
                     pad_channels=0):
    """The values of the FP32 parameter `blob` in `dtype`, kept in
    `copies[name]` from call to call: its address stays (the CUDA-graph
    replays and cuBLAS calls key on it). A net's forward pass writes every
    layer's copies in one launch (_refresh_weight_copies); a layer's forward
    copies itself only outside that (run on its own, or the first pass). A
    backward (`reuse`) takes the copy of its pass's forward, as the weights
    cannot have changed in between (the update follows the backward).
    `channels_last`: a (K, C, kh, kw) blob copied as (K, kh, kw, C), or with
    `pad_channels` as (K, kh, kw, pad_channels), the channels past C zero."""
    import cupy
    c, made, by_pass, _ = copies.get(name, (None, None, False, None))
    now = _kernels.forward_passes()
    if made == now and (reuse or by_pass) and c is not None and c.dtype == dtype and \
            c.size == padded_count(blob, pad_channels):
        return c
    master = blob.data
    if channels_last:
        master = master.transpose(0, 2, 3, 1)
    shape = master.shape[:3] + (pad_channels,) if pad_channels else master.shape
    if c is None or c.shape != shape or c.dtype != dtype:
        c = cupy.zeros(shape, dtype)
    cupy.copyto(c[..., :master.shape[3]] if pad_channels else c, master, casting='same_kind')
    copies[name] = (c, now, False, blob)
    _copies_made[0] = True
    return c


_copies_made = [False]      # (FP32 nets skip the pass hook's walk over their layers)


def _refresh_weight_copies(net, start, end, backward):
    """At the start of a forward pass on the GPU: the 16-bit weight copies of
    layers start..end written in one launch (kernels.cast_many) instead of
    one or two CuPy casts a layer (host time set the pace of GoogLeNet in
    FLOAT16)."""
    if backward or not _copies_made[0] or not _kernels.active() or _kernels.emulating():
        return
    now = _kernels.forward_passes()
    jobs, marks = {}, []
    for layer in net.layers[start:end + 1]:
        copies = layer.__dict__.get('_weight_copies')
        if not copies:
            continue
        for name, (c, _, _, blob) in copies.items():
            job = _copy_job(name, c, blob)
            if job is None:
                continue            # (the layer copies it itself)
            jobs.setdefault((c.dtype, name == NHWC_WEIGHTS), []).append(job)
            marks.append((copies, name, c, blob))
    for (dtype, krsc), arrays in jobs.items():
        (_kernels.cast_many_krsc if krsc else _kernels.cast_many)(arrays, dtype)
    for copies, name, c, blob in marks:
        copies[name] = (c, now, True, blob)


def _copy_job(name, copy, blob):
    """(src, dst, count) for kernels.cast_many, or for a channels-last copy
    ((K, C, kh, kw) as (K, kh, kw, P), P >= C: an image convolution's
    filters padded) (src, dst, count, C, kh kw, P) for cast_many_krsc; None
    where the kernels cannot write this copy."""
    master = _kernels.flat(blob)
    if master is None:
        return None
    job = (int(master.data.ptr), int(copy.data.ptr), copy.size)
    if name != NHWC_WEIGHTS:
        return job if copy.size == blob.count else None
    k, c = blob.shape[:2]
    s, p = blob.count // (k * c), copy.shape[-1]
    if copy.size != k * s * p or p < c or \
            any(v >= limit for v, limit in zip((c, s, p), _kernels.KRSC_LIMITS)):
        return None
    return job + (c, s, p)


_kernels.add_pass_hook(_refresh_weight_copies)


class _MaskableMixin:
    """What caffeplus.memory.masks switches: a masked layer's backward reads
    what its forward kept (can_mask says whether it can), none of its blobs."""
    masked = False

    def set_masked(self, on):
        """Mask (or stop masking) this layer; returns whether it is masked."""
        on = bool(on) and self.can_mask()
        if on != self.masked:
            if on:
                self._reads_unmasked = self.backward_reads
            self.backward_reads = frozenset() if on else self._reads_unmasked
            self.masked = on
            self.forget_kept_buffers()      # kept by the other kind of pass
        return on

    def unmasked_backward_reads(self):
        return self._reads_unmasked if self.masked else self.backward_reads


def _fused(what, fn, *args):
    """Run a fused path; False (the caller runs the generic code) when it
    does not apply or its kernel failed to build or launch."""
    try:
        return fn(*args)
    except CaffeplusError:
        raise                   # the layer's own errors (labels, released memory)
    except Exception as exc:
        from caffeplus.memory import workspace
        if workspace.is_out_of_memory(exc):
            raise
        _kernels.note_failure(what, exc)
        return False
