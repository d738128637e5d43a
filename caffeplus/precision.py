"""Mixed precision: NVCaffe's storage types, the `precision` switch, loss scaling.

A net's precision comes from NVCaffe's fields (docs/precision.md):
default_forward_type / default_backward_type on the net, forward_type /
backward_type on a layer (the layer's win). forward_type is the type a
layer's tops are stored in, backward_type the type of the gradients it
writes. The `precision` switch (`caffeplus train --precision`,
caffeplus_param.precision) overrides every one of them.

On the CPU the 16-bit types are emulated exactly where it matters for the
numbers: every layer computes in float32, and after it runs its results are
rounded to the storage type (round to nearest even; FLOAT16 overflows to
inf and loses small values to subnormals and zero, as FP16 memory would).
The arrays stay float32, so no memory is saved; what the 16-bit storage does
to training (and what loss scaling must undo) is reproduced bit for bit.
Kept in FP32, as mixed-precision training needs: the parameters (master
weights) and the solver's history, the losses (a loss layer's output is not
rounded), and the net's outputs (accuracy). The layers that multiply by
their weights (Convolution, Deconvolution, InnerProduct) use a copy rounded
to their forward type, in forward and backward, as NVCaffe's 16-bit layers
and AMP's casts do; the master weights are put back after each pass. Of
the parameters' gradients only Convolution's and Deconvolution's weight
gradients are rounded (each pass's, before it joins the float32 total), as
the GPU takes them; the others are summed in float32 there and here.

FP32 nets (every type FLOAT or DOUBLE) get nothing installed: they run as
before, bit for bit. On the GPU a FLOAT16 net's maps are float16 arrays
(top_storage_dtypes, decided before the layers allocate) and the layers
that multiply by weights keep 16-bit copies of their own: nothing is
emulated there; a BFLOAT16 net's are ml_dtypes.bfloat16 arrays (CuPy's
bfloat16 type; without the ml_dtypes package it runs in FP32, with a
warning).

Loss scaling (FLOAT16 gradients underflow without it): the loss layers'
top gradients are multiplied by the scale for backward and every weight
gradient is divided by it before the update (LossScaler). Adaptive scaling
(global_grad_scale_adaptive) follows AMP's dynamic scaling: a step whose
gradients hold an inf or a NaN is skipped and the scale halved; after
`loss_scale_window` good steps in a row it doubles.
"""
import contextlib

import numpy

from caffeplus import backend, log
from caffeplus.errors import CaffeplusError, NetError
from caffeplus.proto import caffe_pb2

PRECISIONS = ('fp32', 'tf32', 'fp16', 'bf16')
SIXTEEN_BIT = (caffe_pb2.FLOAT16, caffe_pb2.BFLOAT16)
# Adaptive scaling starts here when the net gives no global_grad_scale:
# AMP's initial scale, large enough that small FP16 gradients survive.
ADAPTIVE_INITIAL_SCALE = 2.0 ** 16
# Below this the scale stops falling: an overflow at scale 1 is not one that
# scaling causes, and the NaN check then stops training and says where.
MIN_SCALE = 1.0
SCALE_FACTOR = 2.0
# Layers whose weights enter the math in the layer's storage type (a 16-bit
# copy of the FP32 master weights): what AMP casts, what NVCaffe stores in
# 16 bits. Normalization layers keep theirs in FP32.
ROUNDED_WEIGHT_TYPES = frozenset(('Convolution', 'Deconvolution', 'InnerProduct'))
# Layers whose weight gradient the GPU takes in 16 bits and adds to the FP32
# master's (cuDNN has no FP16-input, FP32-output filter gradient); every
# other parameter gradient (InnerProduct's through cuBLAS, biases,
# BatchNorm's and Scale's) is summed in float32 there.
ROUNDED_WEIGHT_GRADIENT_TYPES = frozenset(('Convolution', 'Deconvolution'))


def type_name(value):
    return caffe_pb2.Type.Name(value)


# -- rounding to the 16-bit types -------------------------------------------------
def round_to_float16(a):
    """Round a float32 array in place to the nearest FLOAT16 values (ties to
    even; beyond FLOAT16's range: inf)."""
    with numpy.errstate(over='ignore'):
        a[...] = a.astype(numpy.float16)
    return a


def float32_to_bfloat16_bits(a):
    """The BFLOAT16 nearest each float32 value (ties to even), as uint16 bits."""
    bits = numpy.ascontiguousarray(a, dtype=numpy.float32).view(numpy.uint32)
    # Adding 0x7FFF plus the lowest kept bit carries into the kept half
    # exactly when the dropped half is above a tie, or a tie with an odd
    # kept half; finite values too large round up to the infinity pattern.
    rounded = (bits + (numpy.uint32(0x7FFF) + ((bits >> 16) & numpy.uint32(1)))) >> 16
    nan = numpy.isnan(a)
    # A NaN stays a NaN (its sign kept, quiet): the carry could turn it into inf.
    rounded = numpy.where(nan, (bits >> 16) | numpy.uint32(0x0040), rounded)
    return rounded.astype(numpy.uint16)


def bfloat16_bits_to_float32(bits):
    """float32 values of BFLOAT16 uint16 bits (exact)."""
    return (numpy.asarray(bits, dtype=numpy.uint16).astype(numpy.uint32) << 16).view(numpy.float32)


def round_to_bfloat16(a):
    """Round a float32 array in place to the nearest BFLOAT16 values."""
    a[...] = bfloat16_bits_to_float32(float32_to_bfloat16_bits(a)).reshape(a.shape)
    return a


ROUNDING = {caffe_pb2.FLOAT16: round_to_float16, caffe_pb2.BFLOAT16: round_to_bfloat16}


def raw_blob_values(blob_proto, diff=False):
    """The float32 values of a BlobProto's NVCaffe raw_data (raw_diff), or
    None where it has none. NVCaffe writes FLOAT16 weights this way."""
    raw = blob_proto.raw_diff if diff else blob_proto.raw_data
    kind = blob_proto.raw_diff_type if diff else blob_proto.raw_data_type
    if not raw:
        return None
    if kind == caffe_pb2.BFLOAT16:
        return bfloat16_bits_to_float32(numpy.frombuffer(raw, dtype='<u2'))
    dtypes = {caffe_pb2.FLOAT16: '<f2', caffe_pb2.FLOAT: '<f4', caffe_pb2.DOUBLE: '<f8'}
    if kind not in dtypes:
        raise CaffeplusError('BlobProto raw_%s_type %s holds no floating-point values'
                             % ('diff' if diff else 'data', type_name(kind)))
    width = numpy.dtype(dtypes[kind]).itemsize
    if len(raw) % width:
        raise CaffeplusError('BlobProto raw_%s: %d bytes is not a whole number of %s values'
                             % ('diff' if diff else 'data', len(raw), type_name(kind)))
    return numpy.frombuffer(raw, dtype=dtypes[kind]).astype(numpy.float32)


# -- the precision switch ----------------------------------------------------------
_SWITCH = {'precision': None}


def check_precision(name, where='--precision'):
    if name not in PRECISIONS:
        raise CaffeplusError("%s must be one of %s, not '%s'" % (where, ', '.join(PRECISIONS), name))
    return name


@contextlib.contextmanager
def setting(name):
    """Nets built inside take precision `name` (None or '': their files' own)."""
    if name:
        check_precision(name)
    previous = _SWITCH['precision']
    _SWITCH['precision'] = name or None
    try:
        yield
    finally:
        _SWITCH['precision'] = previous


def prepare_solver_param(param):
    """Check caffeplus_param.precision; tf32 asks for TF32 math on the GPU
    (caffeplus_param.math) unless the file sets the math itself."""
    cp = param.caffeplus_param
    if not cp.HasField('precision') or not cp.precision:
        return
    check_precision(cp.precision, 'caffeplus_param.precision')
    if cp.precision == 'tf32' and not cp.HasField('math'):
        cp.math = 'tf32'


def override(net_param, name):
    """Rewrite `net_param`'s types (in place) as precision `name` says."""
    storage = {'fp16': caffe_pb2.FLOAT16, 'bf16': caffe_pb2.BFLOAT16}.get(name, caffe_pb2.FLOAT)
    for field in ('default_forward_type', 'default_backward_type', 'default_forward_math',
                  'default_backward_math'):
        net_param.ClearField(field)
    if storage != caffe_pb2.FLOAT:
        net_param.default_forward_type = storage
        net_param.default_backward_type = storage
    for lp in net_param.layer:
        for field in ('forward_type', 'backward_type', 'forward_math', 'backward_math'):
            lp.ClearField(field)
    if storage != caffe_pb2.FLOAT16:
        # Only FLOAT16's narrow range needs the loss scaled.
        net_param.ClearField('global_grad_scale')
        net_param.ClearField('global_grad_scale_adaptive')
    elif not net_param.HasField('global_grad_scale') and \
            not net_param.HasField('global_grad_scale_adaptive'):
        net_param.global_grad_scale_adaptive = True


# -- a net's types -------------------------------------------------------------------
def layer_storage_types(net_param, lp):
    """(forward type, backward type) of layer `lp`, as NVCaffe resolves them:
    the layer's own, else the net's default; a data layer's gradients stay
    FLOAT (nothing reads them). DOUBLE runs as FLOAT (caffeplus computes in
    float32); INT and UINT have no math and are an error."""
    fwd = lp.forward_type if lp.HasField('forward_type') else net_param.default_forward_type
    if lp.HasField('backward_type'):
        bwd = lp.backward_type
    elif lp.HasField('transform_param'):
        bwd = caffe_pb2.FLOAT
    else:
        bwd = net_param.default_backward_type
    for what, value in (('forward_type', fwd), ('backward_type', bwd)):
        if value in (caffe_pb2.INT, caffe_pb2.UINT):
            raise NetError('layer %s (%s): %s %s has no math (NVCaffe stores it only); use '
                           'FLOAT, FLOAT16 or BFLOAT16' % (lp.name, lp.type, what, type_name(value)))
    return tuple(caffe_pb2.FLOAT if v == caffe_pb2.DOUBLE else v for v in (fwd, bwd))


class NetPrecision:
    """The 16-bit storage of one net (its hooks on the net) and the loss scale
    its backward applies."""

    def __init__(self, net, types, emulate=True):
        self.net = net
        self.types = types              # per layer: (forward type, backward type)
        # False on the GPU: the storage itself rounds, and the layers that
        # multiply by weights keep 16-bit copies of their own.
        self.emulate = emulate
        self.scale = 1.0
        self._saved_loss_diffs = {}
        consumed = {blob_id for ids in net.bottom_id_vecs for blob_id in ids}
        # Tops a later layer reads are stored rounded; the net's outputs
        # (losses, accuracies) keep the float32 values computed.
        self.rounded_tops = {i: [j for j, blob_id in enumerate(net.top_id_vecs[i])
                                 if blob_id in consumed]
                             for i, (fwd, _) in enumerate(types) if fwd in SIXTEEN_BIT}
        self.rounded_grads = {i for i, (_, bwd) in enumerate(types) if bwd in SIXTEEN_BIT}
        self.loss_layers = {i for i, layer in enumerate(net.layers)
                            if any(layer.loss_weights)}
        self.rounded_weights = {i for i, (fwd, _) in enumerate(types)
                                if fwd in SIXTEEN_BIT and net.layers[i].blobs and
                                net.layers[i].layer_param.type in ROUNDED_WEIGHT_TYPES}
        self.rounded_weight_grads = {i for i in self.rounded_grads if net.layers[i].blobs and
                                     net.layers[i].layer_param.type in
                                     ROUNDED_WEIGHT_GRADIENT_TYPES}
        self._held_weight_diffs = {}
        self._masters = {}
        self._hook()

    def _hook(self):
        net = self.net

        def round_tops(i):
            self._round_tops(i)
        round_tops.at = frozenset(self.rounded_tops)

        def scale_loss(i):
            if self.scale != 1.0:
                self._scale_loss_diffs(i)
        scale_loss.at = frozenset(self.loss_layers)
        scale_loss.chain_safe = True        # loss tops only: fused chains stay fused
        # (The scale is part of a CUDA graph's key: caffeplus.pass_graph.)
        scale_loss.graph_safe = True

        if not self.emulate:
            def restore_loss_diffs(i):
                self._restore_loss_diffs(i)
            restore_loss_diffs.at = frozenset(self.loss_layers)
            restore_loss_diffs.chain_safe = True
            restore_loss_diffs.graph_safe = True
            net.before_layer_backward.append(scale_loss)
            net.on_layer_backward_done.append(restore_loss_diffs)
            return

        def after_backward(i):
            self._restore_loss_diffs(i)
            if i in self.rounded_grads and net.layer_need_backward[i]:
                self._round_gradients(i)
        after_backward.at = frozenset(self.loss_layers | self.rounded_grads)

        def use_rounded_weights(i):
            self._swap_in_rounded_weights(i)
        use_rounded_weights.at = frozenset(self.rounded_weights)

        def hold_weight_diff(i):
            self._hold_weight_diff(i)
        hold_weight_diff.at = frozenset(self.rounded_weight_grads)

        def put_back_master_weights(i):
            self._restore_master_weights(i)
        put_back_master_weights.at = frozenset(self.rounded_weights)

        net.before_layer_forward.append(use_rounded_weights)
        net.after_layer_forward.append(put_back_master_weights)
        net.after_layer_forward.append(round_tops)
        net.before_layer_backward.append(scale_loss)
        net.before_layer_backward.append(use_rounded_weights)
        net.before_layer_backward.append(hold_weight_diff)
        net.on_layer_backward_done.append(put_back_master_weights)
        net.on_layer_backward_done.append(after_backward)

    def _round_tops(self, i):
        rounding = ROUNDING[self.types[i][0]]
        self.net.layers[i].round_kept(rounding, self.net.top_vecs[i])
        for j in self.rounded_tops[i]:
            rounding(self.net.top_vecs[i][j].data)

    def round_forward(self, i):
        """What the hooks do after layer i's forward where 16 bits are
        emulated (a forward run again outside a pass: caffeplus.memory.recompute)."""
        if self.emulate and i in self.rounded_tops:
            self._round_tops(i)

    def _swap_in_rounded_weights(self, i):
        if i in self._masters:
            return
        rounding = ROUNDING[self.types[i][0]]
        blobs = self.net.layers[i].blobs
        self._masters[i] = [b.data.copy() for b in blobs]
        for b in blobs:
            rounding(b.data)

    def _restore_master_weights(self, i):
        for b, master in zip(self.net.layers[i].blobs, self._masters.pop(i, ())):
            b.data[...] = master

    def _scale_loss_diffs(self, i):
        layer, tops = self.net.layers[i], self.net.top_vecs[i]
        saved = []
        for j, weight in enumerate(layer.loss_weights):
            if weight:
                diff = tops[j].diff
                saved.append((j, diff.copy()))
                diff *= numpy.float32(self.scale)
        self._saved_loss_diffs[i] = saved

    def _restore_loss_diffs(self, i):
        # The loss weights live in the loss tops' diffs: put them back exactly.
        for j, values in self._saved_loss_diffs.pop(i, ()):
            self.net.top_vecs[i][j].diff[...] = values

    def _round_gradients(self, i):
        rounding = ROUNDING[self.types[i][1]]
        net = self.net
        for blob, needed in zip(net.bottom_vecs[i], net.bottom_need_backward[i]):
            if needed:
                rounding(blob.diff)
        held = self._held_weight_diffs.pop(i, None)
        if held is not None:
            # This pass's weight gradient alone, rounded, then added in float32.
            diff = net.layers[i].blobs[0].diff
            rounding(diff)
            diff += held

    def _hold_weight_diff(self, i):
        """Before layer i's backward: its weight gradient so far is set aside
        and the diff zeroed, so the pass writes its own gradient alone."""
        layer = self.net.layers[i]
        if layer.param_needs_backward(0) and self.net.layer_need_backward[i]:
            diff = layer.blobs[0].diff
            self._held_weight_diffs[i] = diff.copy()
            diff[...] = 0


def resolve(net_param):
    """The per-layer (forward type, backward type) of `net_param`, after the
    precision switch (if set) has rewritten its types in place. Called
    before the layers are made: the GPU stores 16-bit tops from the start."""
    if _SWITCH['precision']:
        override(net_param, _SWITCH['precision'])
    return [layer_storage_types(net_param, lp) for lp in net_param.layer]


def bfloat16_dtype():
    """NumPy's dtype for BFLOAT16 (ml_dtypes.bfloat16, which CuPy stores
    and computes with), or None without the ml_dtypes package."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return numpy.dtype(ml_dtypes.bfloat16)


def device_dtype(storage, sizes_only=False):
    """The dtype the GPU stores `storage` (a layer's type) in: float16 for
    FLOAT16, bfloat16 for BFLOAT16 where ml_dtypes is installed, else None
    (FP32: a BFLOAT16 net without ml_dtypes runs in FP32 there). With
    `sizes_only` (a shape-only build: the memory estimate) float16 stands
    in for a missing bfloat16, as big."""
    if storage == caffe_pb2.FLOAT16:
        return _FLOAT16
    if storage != caffe_pb2.BFLOAT16:
        return None
    if not _BFLOAT16:
        # Imported only for BFLOAT16 nets: the import takes most of a second.
        _BFLOAT16.append(bfloat16_dtype())
    if _BFLOAT16[0] is not None:
        return _BFLOAT16[0]
    return _FLOAT16 if sizes_only else None


_FLOAT16 = numpy.dtype(numpy.float16)
_BFLOAT16 = []          # [ml_dtypes' bfloat16 dtype or None], once looked up


def is_loss_layer(lp):
    """Caffe's rule: a "Loss" type weighs its first top 1 unless told."""
    return 'Loss' in lp.type or any(w != 0 for w in lp.loss_weight)


def top_storage_dtypes(net_param, types, sizes_only=False):
    """{layer index: {top index: dtype}} of the tops stored in 16 bits: the
    tops a later layer reads, of layers whose forward type has a device
    storage. A data layer's labels (its tops after the first), the losses
    and the net's outputs stay float32, as does an in-place top (the
    producer's storage decides). Each gradient is stored as its value."""
    consumed = {name for lp in net_param.layer for name in lp.bottom}
    out = {}
    for i, (lp, (fwd, _)) in enumerate(zip(net_param.layer, types)):
        dtype = device_dtype(fwd, sizes_only)
        if dtype is None or is_loss_layer(lp):
            continue
        tops = {j: dtype for j, name in enumerate(lp.top)
                if name in consumed and (lp.bottom or j == 0) and
                not (j < len(lp.bottom) and lp.bottom[j] == name)}
        if tops:
            out[i] = tops
    return out


def type_names(types, among=None):
    """The sorted names of the storage types in `types` (per-layer (forward,
    backward) pairs) that are in `among` (default: the 16-bit types)."""
    among = SIXTEEN_BIT if among is None else among
    return sorted({type_name(t) for pair in types for t in pair if t in among})


def attach(net):
    """Give `net` the precision its NetParameter (and the switch) asks for:
    net.precision, a NetPrecision, or None for FP32. On the GPU the 16-bit
    tops are already stored so (top_storage_dtypes); on the CPU they are
    emulated."""
    param = net.net_param
    net.precision = None
    types = getattr(net, 'layer_types', None) or resolve(param)
    sixteen = type_names(types)
    if not sixteen:
        return None
    if backend.mode() == backend.GPU:
        stored = type_names(types, [t for t in SIXTEEN_BIT if device_dtype(t) is not None])
        if not stored:
            log.warning('Net %s asks for %s storage, which the GPU backend has only with the '
                        'ml_dtypes package (pip install ml_dtypes): it runs in FLOAT (FP32)',
                        net.name, ' and '.join(sixteen))
            return None
        log.info('Net %s stores %s activations and gradients on the GPU (float32 math, '
                 'FP32 master weights)', net.name, ' and '.join(stored))
        net.precision = NetPrecision(net, types, emulate=False)
        return net.precision
    log.info('Net %s stores %s activations and gradients (float32 math, FP32 weights)',
             net.name, ' and '.join(sixteen))
    net.precision = NetPrecision(net, types)
    return net.precision


# -- loss scaling --------------------------------------------------------------------
class LossScaler:
    """A solver callback: divides the weight gradients by the loss scale
    before the update and, when adaptive, skips overflowed steps and moves
    the scale. Runs after the other callbacks (a gradient sync across ranks:
    every rank judges the averaged gradients) and before the NaN check."""
    runs_after_sync = True

    def __init__(self, solver, net_precision, scale, adaptive, window):
        self.solver = solver
        self.net_precision = net_precision
        self.adaptive = adaptive
        self.window = max(int(window), 1)
        self.good_steps = 0
        self.skipped_steps = 0
        self._skip = False
        net_precision.scale = float(scale)

    @property
    def scale(self):
        return self.net_precision.scale

    def state(self):
        """What a snapshot's sidecar keeps: the scale and the run of good steps."""
        return {'scale': self.scale, 'good_steps': self.good_steps,
                'skipped_steps': self.skipped_steps}

    def set_state(self, state):
        scale = float(state['scale'])
        if not scale > 0:
            raise CaffeplusError('the snapshot sidecar holds loss scale %r; it must be positive'
                                 % (state['scale'],))
        self.net_precision.scale = scale
        self.good_steps = int(state.get('good_steps', 0))
        self.skipped_steps = int(state.get('skipped_steps', 0))

    def on_start(self):
        self._skip = False
        self._queued = None     # (an iteration that stopped before its settle)

    _unscale = None
    _guard = None
    _queued = None      # (guard, iteration): a verdict read once the update is queued

    def on_gradients_ready(self):
        params = self.solver.net.learnable_params
        diffs = [p.diff for p in params]
        if backend.on_device_float32(diffs):
            guard = self._unscale_on_device(diffs)
            if self.adaptive and self.solver.can_guard_update():
                # The update skips on the guard; settle() reads it after.
                self.solver.update_guard = guard
                self._queued = (guard, self.solver.iter)
                return
            finite = not self.adaptive or float(guard) != numpy.inf
        else:
            scale = numpy.float32(self.scale)
            if scale != 1:
                for p in params:
                    p.diff /= scale
            finite = not self.adaptive or all(bool(numpy.isfinite(p.diff).all()) for p in params)
        if self._adapt(finite, self.solver.iter):
            self._skip = True
            for p in params:
                p.diff[...] = 0         # nothing of the step reaches the weights

    def settle(self):
        """After the update is queued: read a queued verdict (one read, where
        the solver reads the loss anyway) and move the scale. An overflow
        already skipped the update on the device."""
        queued, self._queued = self._queued, None
        if queued is not None:
            guard, iteration = queued
            self._adapt(float(guard) != numpy.inf, iteration)

    def _adapt(self, finite, iteration):
        """The adaptive scale's move after a step; True when the step is to
        be skipped (its gradients overflowed)."""
        if not self.adaptive:
            return False
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.window:
                self.good_steps = 0
                self.net_precision.scale = self.scale * SCALE_FACTOR
                log.info('Iteration %d, global_grad_scale raised to %g after %d steps '
                         'without overflow', iteration, self.scale, self.window)
            return False
        if self.scale <= MIN_SCALE:
            return False        # not scaling's doing: the NaN check reports it
        self.good_steps = 0
        self.skipped_steps += 1
        self.net_precision.scale = max(self.scale / SCALE_FACTOR, MIN_SCALE)
        log.info('Iteration %d, gradient overflow in FLOAT16: step skipped, '
                 'global_grad_scale lowered to %g', iteration, self.scale)
        return True

    def _unscale_on_device(self, diffs):
        """Every gradient divided by the scale in one kernel; returns the
        device guard, +inf where a result was not finite. Above the lowest
        scale such values become 0, so the NaN check (after this) sees the
        overflow as the scale's; at the lowest it sees them and reports."""
        import cupy
        from caffeplus.solver import gpu_kernels
        if self._unscale is None:
            self._unscale = gpu_kernels.MultiTensorUnscale()
            self._guard = cupy.zeros((), dtype=numpy.float64)
        self._guard.fill(0)
        self._unscale.run(diffs, self.scale, self._guard,
                          zero_bad=self.adaptive and self.scale > MIN_SCALE)
        return self._guard

    def skips_update(self):
        """Whether this iteration's update is skipped (its gradients overflowed)."""
        skip, self._skip = self._skip, False
        return skip


def loss_scaling(net):
    """(initial scale, adaptive) of the loss scaling a solver gives `net`:
    a net that stores FLOAT16 gradients and asks for a scale; None otherwise."""
    np_ = getattr(net, 'precision', None)
    if np_ is None or not any(bwd == caffe_pb2.FLOAT16 for _, bwd in np_.types):
        return None
    param = net.net_param
    adaptive = param.global_grad_scale_adaptive
    if param.HasField('global_grad_scale'):
        scale = param.global_grad_scale
    else:
        scale = ADAPTIVE_INITIAL_SCALE if adaptive else 1.0
    if scale <= 0:
        raise NetError('net %s: global_grad_scale must be positive (got %g)' % (net.name, scale))
    if scale == 1.0 and not adaptive:
        return None
    return scale, adaptive


def install_loss_scaling(solver):
    """Add a LossScaler to `solver` when its train net asks for loss scaling
    (loss_scaling); returns it (None otherwise)."""
    net = solver.net
    asked = loss_scaling(net)
    if asked is None:
        return None
    scale, adaptive = asked
    np_ = net.precision
    window = solver.param.caffeplus_param.loss_scale_window
    scaler = LossScaler(solver, np_, scale, adaptive, window)
    log.info('Loss scaling: global_grad_scale %g%s', scale,
             ', adaptive (doubled after %d good steps, halved on overflow)' % scaler.window
             if adaptive else '')
    solver.loss_scaler = scaler
    solver.add_callback(scaler)
    return scaler


def add_argument(parser):
    """--precision for train, test and time."""
    parser.add_argument('--precision', default=None, choices=PRECISIONS,
                        help="override the net files' types: fp32, tf32 (TF32 math on the "
                             "GPU), fp16 (adaptive loss scaling unless the net sets a scale), "
                             "bf16")
