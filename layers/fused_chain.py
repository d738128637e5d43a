"""Fused kernels (caffeplus.kernels) for BatchNorm, Scale, ReLU, Eltwise SUM
and Split, and the chain planner that runs BatchNorm -> Scale (-> ReLU)
and Eltwise SUM -> ReLU as one kernel each way (the Split of that top
too, backward), and a channels-last Convolution's ReLU in its bias pass.
"""
import numpy

from caffeplus import kernels as _kernels
from caffeplus.layer import register_engine
from caffeplus.layers.common import EltwiseLayer, SplitLayer
from caffeplus.layers.cudnn_activations import CuDNNReLULayer, _CudnnActivationMixin
from caffeplus.layers.cudnn_common import F32, _fused, _prod
from caffeplus.layers.cudnn_conv import CuDNNConvolutionLayer
from caffeplus.layers.normalization import BatchNormLayer, ScaleLayer, _same_data
from caffeplus.memory import scratch
from caffeplus.proto import caffe_pb2

_ELTWISE_SUM = caffe_pb2.EltwiseParameter.SUM


# In GPU mode these layers run one CUDA kernel per forward and per backward
# instead of the generic code's ten to twenty CuPy operations; on NumPy
# arrays (CPU mode), for blobs of 2**31 values or more, or with
# CAFFEPLUS_FUSED=0, they run the generic code. Their reshape returns at
# once when the bottom shapes are those of the last call (the net reshapes
# every layer before every forward).
#
# Chains. In a residual net each convolution is followed by BatchNorm,
# Scale and (mostly) ReLU, all in place on one blob. When a pass of the net
# runs the whole chain and nothing watches the layers in between (no
# per-layer hooks but on_layer_backward_done, no debug_info), BatchNorm's
# forward writes the chain's final top, relu(scale * norm(x) + bias), and
# the chain's last layer's backward computes every gradient of the three
# (Scale's parameter gradients included) in one kernel; the other layers
# of the chain then do nothing. The blob's values after the chain, and
# every gradient, are those of the layers run one by one. The net tells
# the chains about each pass through kernels.begin_pass.


def _base_address(array):
    """Where an array's data starts (CuPy or NumPy): a view's identity."""
    data = array.data
    return int(data.ptr) if hasattr(data, 'ptr') else array.__array_interface__['data'][0]


def _view(buf, shape):
    """A cached view of buffer `buf` with `shape` (rebuilt when either changes)."""
    return buf[:_prod(shape)].reshape(shape)


class _FusedMixin:
    """A reshape that skips when the bottom shapes are those of the last call."""
    _rkey = None

    def _reshape_key(self, bottom):
        return tuple((b._shape, b.layout) for b in bottom)

    def reshape(self, bottom, top):
        key = self._reshape_key(bottom)
        if key == self._rkey and all(t._shape == bottom[0]._shape for t in top):
            return
        self._rkey = None
        super().reshape(bottom, top)
        self._rkey = key
        self._reshaped(bottom, top)

    def _reshaped(self, bottom, top):
        pass


class _Chain:
    """BatchNorm -> Scale (-> ReLU), in place on one blob, consecutive layers.
    `dy_from`: another blob whose diff holds this pass's gradient of the
    chain's top, set by the Eltwise SUM chain right after it, which then
    leaves the chain's own diff unwritten (_SumChain.shares_diff)."""
    __slots__ = ('bn', 'scale', 'relu', 'first', 'last', 'head', 'needs_backward',
                 'fwd_active', 'bwd_active', 'fwd_done', 'bwd_done', 'dy_from', 'defer_apply')

    def __init__(self, net, i, bn, scale, relu):
        self.bn, self.scale, self.relu = bn, scale, relu
        self.first, self.last = i, i + (2 if relu is not None else 1)
        self.head = relu if relu is not None else scale      # first in backward order
        self.needs_backward = all(net.layer_need_backward[j] and all(net.bottom_need_backward[j])
                                  for j in range(self.first, self.last + 1))
        self.fwd_active = self.bwd_active = self.fwd_done = self.bwd_done = False
        self.dy_from = None
        # (Each forward pass: the Eltwise SUM chain after it runs the
        # normalize pass, _SumChain.forward_with_branch.)
        self.defer_apply = False

    def settle(self):
        """Before the layers run one by one: the gradient the SUM chain left
        in another blob's diff, copied into the chain's own."""
        if self.dy_from is not None:
            arrays, _ = _kernels.maps((self.dy_from, True), (self.bn._chain_blob, True))
            n = self.bn._chain_blob._count
            arrays[1][:n] = arrays[0][:n]
            self.dy_from = None

    def geometry_ok(self):
        """Scale covers exactly BatchNorm's channel axis (and its bias the same)."""
        sc = self.scale
        return sc.dims == self.bn._cfg and (sc.bias_param_id is None or
                                            sc.bias_dims == sc.dims)

    def scale_bias_flags(self):
        """(scale, bias or None, cp_bn_fwd's chain flags) of the chain's
        Scale and ReLU on the device; None where a parameter is not there."""
        K = _kernels
        sc = self.scale
        s = K.flat(sc.blobs[0])
        b = K.flat(sc.blobs[sc.bias_param_id]) if sc.bias_param_id is not None else None
        if s is None or (sc.bias_param_id is not None and b is None):
            return None
        return s, b, K.BN_SCALE | (K.BN_BIAS if b is not None else 0) | \
            (K.BN_RELU if self.relu is not None else 0)

    def forward(self, x, y):
        """BatchNorm's fused forward for the whole chain (called by BatchNorm)."""
        params = self.scale_bias_flags()
        if params is None:
            return False
        s, b, flags = params
        if not self.bn._launch_forward(x, y, flags, s, b, defer=self.defer_apply):
            return False
        self.scale._bottom_copy = self.bn._x_norm   # Scale's bottom: the normalized x
        self.fwd_done = True
        return True

    def backward(self):
        """The chain's fused backward (called by its head, first in backward order)."""
        K = _kernels
        bn, sc = self.bn, self.scale
        if not self.geometry_ok() or bn._x_norm is None or bn._std is None:
            return False
        n, c, s_ = bn._cfg
        count = n * c * s_
        if not 0 < count <= K.MAX_COUNT or bn._x_norm.size != count:
            return False
        blob = bn._chain_blob
        src = self.dy_from if self.dy_from is not None else blob
        arrays, _ = K.maps((src, True), (blob, True))
        dy, dx = arrays if arrays is not None else (None, None)
        s = K.flat(sc.blobs[0])
        bid = sc.bias_param_id
        b = K.flat(sc.blobs[bid]) if bid is not None else None
        if dy is None or s is None or (bid is not None and b is None):
            return False
        want_ds = sc.param_needs_backward(0)
        want_db = bid is not None and sc.param_needs_backward(bid)
        ds = K.flat(sc.blobs[0], diff=True) if want_ds else None
        db = K.flat(sc.blobs[bid], diff=True) if want_db else None
        if (want_ds and ds is None) or (want_db and db is None):
            return False
        flags = K.BN_SCALE | K.BN_DX | (K.BN_BIAS if b is not None else 0) | \
            (K.BN_RELU if self.relu is not None else 0) | \
            (K.BN_DSCALE if want_ds else 0) | (K.BN_DBIAS if want_db else 0) | \
            (0 if bn.use_global_stats else K.BN_BATCH)
        bn._launch_backward(dy, bn._x_norm, bn._std, dx, s, b if b is not None else s,
                            ds if ds is not None else dy, db if db is not None else dy, flags)
        self.bwd_done = True
        self.dy_from = None
        return True


def _scale_diffs(g, ref, outs, n, mask, dtype=None):
    """cp_scale2 over (diff array, coefficient) pairs, two per launch; with
    `mask`, g is first multiplied by (ref > 0) and written back (an in-place
    ReLU's backward). `dtype`: the arrays' (float32 or a 16-bit type)."""
    K = _kernels
    grid, block = K.elementwise_grid(n), (K.ELEMENTWISE_THREADS,)
    k = K.kernel('cp_scale2', dtype)
    if not outs:
        if mask:
            k(grid, block, (g, g, g, ref, K.u32(n), F32(1), F32(1), K.i32(4)))
        return
    for j in range(0, len(outs), 2):
        d0, c0 = outs[j]
        if j + 1 < len(outs):
            d1, c1, flags = outs[j + 1][0], outs[j + 1][1], 3
        else:
            d1, c1, flags = d0, c0, 1
        if mask and j == 0:
            flags |= 4
        k(grid, block, (g, d0, d1, ref, K.u32(n), F32(c0), F32(c1), K.i32(flags)))


class _SumChain:
    """Eltwise SUM of two bottoms into a new top, then ReLU in place on it;
    with `split`, the Split of that top right after (a residual block's
    output, read by the next block's two branches), whose backward, first
    in backward order, then runs the three layers' in one pass."""
    __slots__ = ('eltwise', 'relu', 'split', 'first', 'last', 'head', 'needs_backward',
                 'bottoms', 'top', 'propagate', 'fwd_active', 'bwd_active', 'fwd_done',
                 'bwd_done', 'split_tops', 'store_sum_diff', 'branch', 'branch_bottom',
                 'can_share_diff', 'shares_diff', 'store_branch_top')

    def __init__(self, net, i, eltwise, relu, split=None):
        self.eltwise, self.relu, self.split = eltwise, relu, split
        self.first = i
        self.last = i + (2 if split is not None else 1)
        self.head = split if split is not None else relu
        self.bottoms, self.top = list(net.bottom_vecs[i]), net.top_vecs[i][0]
        self.split_tops = list(net.top_vecs[i + 2]) if split is not None else None
        self.propagate = list(net.bottom_need_backward[i])
        self.needs_backward = net.layer_need_backward[i] and net.layer_need_backward[i + 1] \
            and all(net.bottom_need_backward[i + 1])
        if split is not None:
            self.needs_backward = self.needs_backward and net.layer_need_backward[i + 2] and \
                net.bottom_need_backward[i + 2][0]
        self.fwd_active = self.bwd_active = self.fwd_done = self.bwd_done = False
        # Whether the fused backward stores the summed diff: the Eltwise top's
        # gradient, which only the two layers it replaces read unless the
        # memory plan keeps it (set for each backward pass, _begin_pass).
        self.store_sum_diff = True
        # `branch`: a BatchNorm -> Scale chain right before, in place on
        # bottom `branch_bottom` (a residual branch's last; _pair_sum_chains).
        # Forward: its normalize pass runs here, adding the other bottom
        # (forward_with_branch), and its top is stored only where something
        # reads it later (`store_branch_top`, each pass). Backward: with both
        # coefficients 1 the two bottom diffs are the same values, so where
        # both chains run fused (`shares_diff`, each pass) only the other
        # bottom's diff is written and the branch reads its gradient there.
        self.branch = self.branch_bottom = None
        self.can_share_diff = self.shares_diff = False
        self.store_branch_top = True

    def forward_with_branch(self):
        """The branch chain's deferred normalize pass with this Eltwise SUM and
        ReLU in it (channels-last vector kernels: the maps aligned)."""
        K = _kernels
        n = self.top._count
        other = self.bottoms[1 - self.branch_bottom]
        arrays, _ = K.maps((other, False), (self.top, False))
        if not 0 < n <= K.MAX_COUNT or arrays is None or \
                any(_base_address(a) % 16 for a in arrays):
            return False
        coeffs = self.eltwise.coeffs
        self.branch.bn.apply_deferred(arrays[0], arrays[1], coeffs[1 - self.branch_bottom],
                                      coeffs[self.branch_bottom],
                                      2 | (1 if self.store_branch_top else 0))
        self.fwd_done = True
        return True

    def settle(self):
        """Before the Eltwise runs on its own: the branch's deferred pass."""
        if self.branch is not None and self.branch.bn._deferred_apply is not None:
            self.branch.bn.apply_deferred()

    def backward(self):
        """ReLU's and Eltwise's backward in one kernel (called by the ReLU),
        or the Split's and theirs (called by the Split)."""
        K = _kernels
        n = self.top._count
        # (A masked ReLU's backward reads its bits, and the plan may have
        # let the top's values go.)
        if not 0 < n <= K.MAX_COUNT or self.relu.masked:
            return False
        wanted = [j for j, _ in enumerate(self.bottoms) if self.propagate[j]]
        if self.shares_diff:
            wanted.remove(self.branch_bottom)
        outs = [(self.bottoms[j], True) for j in wanted]
        if self.split is None:
            arrays, dtype = K.maps((self.top, True), (self.top, False), *outs)
            if arrays is None:
                return False
            g, ref = arrays[0], arrays[1]
            outs = [(a, self.eltwise.coeffs[j]) for a, j in zip(arrays[2:], wanted)]
            _scale_diffs(g, ref, outs, n, 1, dtype)
        else:
            a, b = self.split_tops
            arrays, dtype = K.maps((a, True), (b, True), (self.top, True), (self.top, False),
                                   *outs)
            if arrays is None:
                return False
            outs = [(d, self.eltwise.coeffs[j]) for d, j in zip(arrays[4:], wanted)]
            _sum_scale_diffs(arrays[0], arrays[1], arrays[2], arrays[3], outs, n,
                             self.store_sum_diff or not outs, dtype)
        if self.shares_diff:
            self.branch.dy_from = self.bottoms[1 - self.branch_bottom]
        self.bwd_done = True
        return True


def _sum_scale_diffs(a, b, g, ref, outs, n, store, dtype):
    """cp_sum_scale2: g = a + b masked by (ref > 0) (stored if `store`), and
    each (diff array, coefficient) of `outs` (one or two) that times g."""
    K = _kernels
    flags = 4 | (8 if store else 0) | (1 if outs else 0) | (2 if len(outs) > 1 else 0)
    (d0, c0), (d1, c1) = (outs + [(g, 1.0), (g, 1.0)])[:2]
    K.kernel('cp_sum_scale2', dtype)(
        K.elementwise_grid(n), (K.ELEMENTWISE_THREADS,),
        (a, b, g, d0, d1, ref, K.u32(n), F32(c0), F32(c1), K.i32(flags)))


class _ConvReLUChain:
    """Convolution, then ReLU in place on its top: the convolution's bias
    pass applies the ReLU too (channels-last maps: cp_bias_nhwc), and the
    ReLU's forward then does nothing. Backward runs layer by layer."""
    __slots__ = ('conv', 'relu', 'first', 'last', 'head', 'needs_backward', 'fwd_active',
                 'bwd_active', 'fwd_done', 'bwd_done')

    def __init__(self, i, conv, relu):
        self.conv, self.relu = conv, relu
        self.first, self.last, self.head = i, i + 1, relu
        self.needs_backward = False
        self.fwd_active = self.bwd_active = self.fwd_done = self.bwd_done = False

    def backward(self):
        return False


def _find_chains(net):
    chains = []
    layers = net.layers
    L = len(layers)

    def in_place_on(j, blob):
        return len(net.bottom_vecs[j]) == 1 and len(net.top_vecs[j]) == 1 and \
            net.bottom_vecs[j][0] is blob and net.top_vecs[j][0] is blob
    for i, layer in enumerate(layers):
        if not isinstance(layer, GPUBatchNormLayer) or layer.scale_bias or i + 1 >= L or \
                not net.bottom_vecs[i]:
            continue
        blob = net.bottom_vecs[i][0]
        if not in_place_on(i, blob):
            continue
        sc = layers[i + 1]
        if not isinstance(sc, GPUScaleLayer) or not in_place_on(i + 1, blob):
            continue
        relu = layers[i + 2] if i + 2 < L else None
        if not (isinstance(relu, CuDNNReLULayer) and relu.slope == 0 and in_place_on(i + 2, blob)):
            relu = None
        ch = _Chain(net, i, layer, sc, relu)
        layer._chain_blob = blob
        for member in (layer, sc, relu):
            if member is not None:
                member._chain = ch
        chains.append(ch)
    for i, layer in enumerate(layers):
        if not isinstance(layer, GPUEltwiseLayer) or layer.op != _ELTWISE_SUM or i + 1 >= L or \
                len(net.bottom_vecs[i]) != 2 or len(net.top_vecs[i]) != 1:
            continue
        top = net.top_vecs[i][0]
        relu = layers[i + 1]
        if any(b is top for b in net.bottom_vecs[i]) or not (
                isinstance(relu, CuDNNReLULayer) and relu.slope == 0 and relu._chain is None
                and in_place_on(i + 1, top)):
            continue
        split = layers[i + 2] if i + 2 < L else None
        if not (isinstance(split, GPUSplitLayer) and len(net.bottom_vecs[i + 2]) == 1 and
                net.bottom_vecs[i + 2][0] is top and len(net.top_vecs[i + 2]) == 2):
            split = None
        ch = _SumChain(net, i, layer, relu, split)
        for member in (layer, relu, split):
            if member is not None:
                member._chain = ch
        chains.append(ch)
    for i, layer in enumerate(layers):
        if not isinstance(layer, CuDNNConvolutionLayer) or not layer.bias_term or \
                i + 1 >= L or len(net.bottom_vecs[i]) != 1 or len(net.top_vecs[i]) != 1:
            continue
        top = net.top_vecs[i][0]
        relu = layers[i + 1]
        if net.bottom_vecs[i][0] is top or not (
                isinstance(relu, CuDNNReLULayer) and relu.slope == 0 and relu._chain is None
                and in_place_on(i + 1, top)):
            continue
        ch = _ConvReLUChain(i, layer, relu)
        layer._chain = relu._chain = ch
        chains.append(ch)
    _pair_sum_chains(chains)
    return chains


def _pair_sum_chains(chains):
    """Give each Eltwise SUM chain of two bottoms the BatchNorm -> Scale chain
    right before it, in place on one of them (ResNet's branch2c), as its
    `branch`. Its other bottom comes from a layer before that chain, so it
    is there in forward; and its backward reads that bottom's diff later
    than the branch's, so with coefficients 1 and both bottoms propagated it
    can hand the gradient over (`can_share_diff`). Not a chain ending in a
    ReLU: a masked ReLU's forward reads the top the deferred pass has not
    written yet, and its backward its own diff."""
    by_last = {ch.last: ch for ch in chains if isinstance(ch, _Chain) and ch.relu is None}
    for ch in chains:
        if not isinstance(ch, _SumChain) or len(ch.bottoms) != 2 or \
                ch.bottoms[0] is ch.bottoms[1]:
            continue
        a = by_last.get(ch.first - 1)
        on = [j for j, b in enumerate(ch.bottoms) if a is not None and b is a.bn._chain_blob]
        if not on:
            continue
        ch.branch, ch.branch_bottom = a, on[0]
        ch.can_share_diff = a.needs_backward and all(ch.propagate) and \
            list(ch.eltwise.coeffs) == [1, 1]


def _chain_backward(layer, what):
    """Whether the layer's chain took its backward: done already by the
    chain's last layer, or run now because `layer` is that layer."""
    ch = layer._chain
    if ch is None:
        return False
    if ch.bwd_done:
        return True
    if ch.head is not layer:
        return False
    if ch.bwd_active and _kernels.active() and _fused(what, ch.backward):
        return True
    if isinstance(ch, _Chain):
        ch.settle()
    return False


def _begin_pass(net, start, end, backward):
    """kernels.begin_pass: which chains run fused in this pass of `net`."""
    chains = _chains(net)
    if not chains:
        return
    # Hooks that look at blobs between a chain's layers need it unfused;
    # hooks marked chain_safe (the offload runtime's copies and waits, which
    # act at step boundaries on whole buffers) do not.
    watchers = [h for h in (net.before_layer_forward + net.after_layer_forward +
                            net.before_layer_backward) if not getattr(h, 'chain_safe', False)]
    on = _kernels.active() and not (net.debug_info or watchers)
    for ch in chains:
        if backward:
            ch.bwd_done = False
            ch.bwd_active = on and ch.needs_backward and end <= ch.first and ch.last <= start
            if ch.bwd_active and isinstance(ch, _SumChain) and ch.split is not None:
                ch.store_sum_diff = _read_after(net, ch.top.diff_storage,
                                                2 * len(net.layers) - 1 - ch.first)
            if isinstance(ch, _Chain):
                ch.dy_from = None
        else:
            ch.fwd_done = False
            ch.fwd_active = on and start <= ch.first and ch.last <= end
    for ch in chains:
        if not isinstance(ch, _SumChain) or ch.branch is None:
            continue
        if backward:
            ch.shares_diff = ch.can_share_diff and ch.bwd_active and ch.branch.bwd_active
            continue
        ch.branch.bn._deferred_apply = None
        ch.branch.defer_apply = ch.fwd_active and ch.branch.fwd_active
        # The branch's top: read after the Eltwise's step (stock keeps it)?
        ch.store_branch_top = _read_after(net, ch.branch.bn._chain_blob.data_storage,
                                          ch.first)


def _read_after(net, storage, step):
    """Whether a blob's data or diff `storage` may be read after step `step`:
    always but where a memory plan lets its memory go there (reading it then
    raises, caffeplus.memory.apply)."""
    plan = net.applied_plan
    return plan is None or plan.read_after(storage, step)


def _chains(net):
    """The net's fused chains, found once."""
    chains = net.__dict__.get('_fused_chains')
    if chains is None:
        chains = net._fused_chains = _find_chains(net)
    return chains


def _chain_heads(net):
    """kernels.chain_heads: every chain member -> its last layer, whose
    backward (first in backward order) runs the chain's."""
    return {j: ch.last for ch in _chains(net) if ch.needs_backward
            for j in range(ch.first, ch.last + 1)}


def _register_planner():
    _kernels.set_chain_planner(_begin_pass)
    _kernels.set_chain_heads(_chain_heads)


# The channels-last BatchNorm kernels' blocks: 32 channels (a warp, one
# row's consecutive values) by NHWC_THREADS / 32 rows at a time. The sums
# give each block about NHWC_SHARE_ROWS rows (enough blocks in flight to
# hide the loads' latency; a row lane's dependent adds stay few); the
# per-value passes' row chunks each take every chunk-th group of rows.
NHWC_THREADS = 256
NHWC_SHARE_ROWS = 256
NHWC_LANE_ROWS = 32         # rows a lane of the vector kernels' sums walks
NHWC_MAX_SHARES = 65535
NHWC_TILE_ROW_CHUNKS = 8192
# The vector kernels' per-value passes (normalize, dx) load a group's
# per-channel values once a thread, so a thread should walk many rows: at
# most 1024 blocks (about 8 a multiprocessor of an H200) took ResNet-50
# b256's 53 dx passes from 7.4 to 5.5 ms and its normalize passes from 5.8
# to 5.0 against 8192 blocks; 512 starved the largest maps
# (dev/bn_nhwc_bench.py --row-chunks).
NHWC_ROW_CHUNKS = 1024


def _row_chunks(m):
    return int(max(1, min(NHWC_TILE_ROW_CHUNKS, -(-m // (NHWC_THREADS // 32)))))


# The per-block partial sums of a BatchNorm's statistics or gradient sums:
# read back within the same layer's next kernel, so one buffer serves every
# layer (ResNet-50 b256 in FP16 held 273 MiB of them, a buffer per layer).
PARTIAL_SUMS = 'batchnorm partial sums'


def _partial_sums(count):
    return _kernels.scratch(PARTIAL_SUMS, count, numpy.float64)


def nhwc_vec_launch(m, c, width):
    """(block, sums' blocks P, per-value passes' blocks) of the vector
    kernels (cp_bn_*_nhwc_vec) over m rows of c channels, `width` channels a
    thread: a block's threads take a row's groups and as many rows (lanes)
    as fill NHWC_THREADS."""
    groups = c // width
    gt = min(groups, NHWC_THREADS)
    lanes = max(1, NHWC_THREADS // gt)
    P = int(max(1, min(NHWC_MAX_SHARES, -(-m // (NHWC_LANE_ROWS * lanes)))))
    chunks = int(max(1, min(NHWC_ROW_CHUNKS, -(-m // lanes))))
    return (gt * lanes,), P, chunks


@register_engine('CUDNN')
class GPUBatchNormLayer(_FusedMixin, BatchNormLayer):
    """BatchNorm through caffeplus.kernels' cp_bn_fwd / cp_bn_bwd on the GPU."""
    engine = 'FUSED'
    _chain = None
    _chain_blob = None
    _cfg = None
    _nhwc = False
    _xn_buf = _std_buf = _buf_key = None
    _nhwc_bufs = None

    def _reshaped(self, bottom, top):
        self._cfg = self._dims(bottom[0])
        self._nhwc = bottom[0].layout == 'NHWC'

    def forget_kept_buffers(self):
        super().forget_kept_buffers()
        self._xn_buf = self._buf_key = self._my_xn = None

    def _buffers(self, keep, dtype):
        """The layer's std and normalized copy (in the maps' type `dtype`):
        views of device buffers reused across calls (the generic code's
        self._std and self._x_norm)."""
        K = _kernels
        n, c, s = self._cfg
        count = n * c * s
        if self._std_buf is None or self._std_buf.size < c or not K.is_device(self._std_buf):
            self._std_buf = K.empty(c)
        if keep:
            # The kept normalized copy: the memory plan's view, else the layer's own.
            self._xn_buf = scratch.get(self, 'x_norm', count, dtype, K.array_module())
        key = (self._cfg, keep, id(self._std_buf), _base_address(self._xn_buf) if keep else None)
        if key != self._buf_key:
            self._my_std = self._std_buf[:c]
            self._my_xn = _view(self._xn_buf, (n, c, s)) if keep else None
            self._buf_key = key
        self._std = self._my_std
        self._x_norm = self._my_xn
        return self._xn_buf if keep else None

    def _launch_forward(self, x, y, chain_flags=0, sc=None, bi=None, defer=False):
        """The forward kernels; with `defer` (channels-last vector kernels
        only), the normalize pass waits in _deferred_apply for the Eltwise
        SUM after the chain (apply_deferred)."""
        K = _kernels
        n, c, s = self._cfg
        dtype = x.dtype
        b0, b1, b2 = (K.flat(b) for b in self.blobs[:3])
        if b0 is None or b1 is None or b2 is None:
            return False
        batch = not self.use_global_stats
        # A chain's Scale gradient reads the normalized copy too.
        keep = self.keeps_normalized or bool(chain_flags and self._chain is not None)
        xn = self._buffers(keep, dtype)
        m = n * s
        corr = F32(m) / F32(m - 1) if m > 1 else F32(1)
        flags = (K.BN_BATCH if batch else 0) | (K.BN_KEEP if keep else 0) | chain_flags
        # (A placeholder the flags leave unread.)
        xn = xn if xn is not None else self._std_buf
        sc = sc if sc is not None else b0
        bi = bi if bi is not None else b0
        if self._nhwc:
            self._forward_nhwc(x, y, xn, b0, b1, b2, sc, bi, flags, F32(corr), defer)
            return True
        split = self._split_kernels(('cp_bn_stats_part', 'cp_bn_fwd_apply'), dtype)
        if split is not None:
            kp, ka, P, part, kv, block = split
            if batch:
                kp((c * P,), block, (x, part, kv, K.u32(n), K.u32(c), K.u32(s), K.u32(P)))
            ka((c * P,), block, (
                x, y, xn, b0, b1, b2, self._std_buf, sc, bi, part, kv,
                K.u32(n), K.u32(c), K.u32(s), K.u32(P), K.i32(flags), self.maf, self.eps,
                F32(corr)))
            return True
        K.kernel('cp_bn_fwd', dtype)((c,), (K.channel_block(m),), (
            x, y, xn, b0, b1, b2, self._std_buf, sc, bi,
            K.u32(n), K.u32(c), K.u32(s), K.i32(flags), self.maf, self.eps, F32(corr)))
        return True

    _identity_bufs = None

    def _identity(self, c):
        """Identity statistics for c channels (means 0, deviations 1, and a
        deviation buffer of their own for the kernels that write one)."""
        K = _kernels
        ids = self._identity_bufs
        if ids is None or ids[0].size < c or not K.is_device(ids[0]):
            ids = self._identity_bufs = (K.empty(c), K.empty(c), K.empty(c))
            ids[0].fill(0)
            ids[1].fill(1)
        return tuple(a[:c] for a in ids)

    def remake_chain_top(self):
        """Write the chain's top again from the kept normalized copy
        (caffeplus.memory.recompute.remake): the forward's normalize pass
        with identity statistics (mean 0, deviation sqrt(1 + 0) = 1), so its
        t = (xn - 0) / 1 is xn exactly and the top is cp_chain(xn, s, b), the
        bits the fused forward wrote. False where the last forward did not
        run the chain fused."""
        K = _kernels
        ch = self._chain
        if ch is None or not isinstance(ch, _Chain) or not ch.fwd_done or not K.active() or \
                self._x_norm is None:
            return False
        n, c, s_ = self._cfg
        arrays, dtype = K.maps((self._chain_blob, False))
        params = ch.scale_bias_flags()
        if arrays is None or params is None:
            return False
        y, = arrays
        xn = self._x_norm.reshape(-1)
        s, b, flags = params
        b = b if b is not None else s
        zeros, ones, std = self._identity(c)
        if self._nhwc:
            vec, _, _, _, _, _, passes = self._nhwc_plan(xn, y)
            K.kernel('cp_bn_apply_nhwc' + ('_vec' if vec else ''), dtype)(*passes, (
                xn, y, y, zeros, ones, s, b, K.u32(n), K.u32(c), K.i32(flags)))
            return True
        # (The stored-statistics branch: mean = 0 * 1 / 1, var = 1, eps 0;
        # the deviation goes to a buffer of its own, not the layer's.)
        args = (F32(0), F32(0), F32(1))
        split = self._split_kernels(('cp_bn_stats_part', 'cp_bn_fwd_apply'), dtype)
        if split is not None:
            _, ka, P, part, kv, block = split
            ka((c * P,), block, (xn, y, y, zeros, ones, ones, std, s, b, part, kv, K.u32(n),
                                 K.u32(c), K.u32(s_), K.u32(P), K.i32(flags)) + args)
            return True
        K.kernel('cp_bn_fwd', dtype)((c,), (K.channel_block(n * s_),), (
            xn, y, y, zeros, ones, ones, std, s, b, K.u32(n), K.u32(c), K.u32(s_),
            K.i32(flags)) + args)
        return True

    def _nhwc_plan(self, *maps):
        """The channels-last kernels' launch for `maps`: (vec, P, partials,
        K values, means, sums' grid and block, per-value passes' grid and
        block). vec: the kernels that load CP_V channels at a time (C a
        multiple of it, the maps 16-byte aligned), else 32-channel tiles."""
        K = _kernels
        m, c, _ = self._cfg
        width = 16 // maps[0].dtype.itemsize
        vec = c % width == 0 and all(_base_address(a) % 16 == 0 for a in maps)
        if vec:
            block, P, chunks = nhwc_vec_launch(m, c, width)
            sums, passes = ((P,), block), ((chunks,), block)
        else:
            tiles = -(-c // 32)
            P = int(max(1, min(NHWC_MAX_SHARES, -(-m // NHWC_SHARE_ROWS))))
            sums = ((tiles * P,), (NHWC_THREADS,))
            passes = ((tiles * _row_chunks(m),), (NHWC_THREADS,))
        b = self._nhwc_bufs
        if b is None or b.size < 2 * c or not K.is_device(b):
            b = self._nhwc_bufs = K.empty(2 * c)
        return vec, P, _partial_sums(2 * c * P), b[:c], b, sums, passes

    _deferred_apply = None

    def _forward_nhwc(self, x, y, xn, b0, b1, b2, sc, bi, flags, corr, defer=False):
        K = _kernels
        m, c, _ = self._cfg
        vec, P, part, kv, ms, sums, passes = self._nhwc_plan(x, y, xn)
        suffix = '_vec' if vec else ''
        dtype = x.dtype
        if flags & K.BN_BATCH:
            K.kernel('cp_bn_stats_part_nhwc' + suffix, dtype)(*sums, (
                x, part, kv, K.u32(m), K.u32(c), K.u32(P)))
        mean = ms[c:2 * c]
        K.kernel('cp_bn_stats_nhwc')((c,), (K.SUM_THREADS,), (
            part, kv, b0, b1, b2, self._std_buf, mean, K.u32(m), K.u32(c), K.u32(P),
            K.i32(flags), self.maf, self.eps, corr))
        args = (x, y, xn, mean, self._std_buf, sc, bi, K.u32(m), K.u32(c), K.i32(flags))
        if defer and vec:
            self._deferred_apply = (passes, args)
            return
        K.kernel('cp_bn_apply_nhwc' + suffix, dtype)(*passes, args)

    def apply_deferred(self, other=None, total=None, c_other=1.0, c_own=1.0, add_flags=0):
        """The normalize pass _launch_forward deferred; with `other`, the
        Eltwise SUM's in it: total = c_other * other + c_own * top (its ReLU:
        add_flags & 2; the top itself stored only with add_flags & 1)."""
        passes, args = self._deferred_apply
        self._deferred_apply = None
        if other is None:
            _kernels.kernel('cp_bn_apply_nhwc_vec', args[0].dtype)(*passes, args)
        else:
            _apply_add(passes, args, other, total, c_other, c_own, add_flags)

    def _backward_nhwc(self, dy, xn, std, dx, sc, bi, dsc, dbi, flags):
        K = _kernels
        m, c, _ = self._cfg
        vec, P, part, _, md, sums, passes = self._nhwc_plan(dy, xn, dx)
        suffix = '_vec' if vec else ''
        dtype = dy.dtype
        if flags & (K.BN_BATCH | K.BN_DSCALE | K.BN_DBIAS):
            K.kernel('cp_bn_bwd_part_nhwc' + suffix, dtype)(*sums, (
                dy, xn, sc, bi, part, K.u32(m), K.u32(c), K.u32(P), K.i32(flags)))
        K.kernel('cp_bn_bwd_stats_nhwc')((c,), (K.SUM_THREADS,), (
            part, sc, dsc, dbi, md, K.u32(m), K.u32(c), K.u32(P), K.i32(flags)))
        if flags & K.BN_DX:
            K.kernel('cp_bn_dx_nhwc' + suffix, dtype)(*passes, (
                dy, xn, std, dx, sc, bi, md, K.u32(m), K.u32(c), K.i32(flags)))

    _split_failed = frozenset()     # map types whose split kernels did not build
    _split_bufs = None

    def _split_kernels(self, names, dtype):
        """(kernel, kernel, P, partial sums, K values, block) to run this layer
        over P blocks per channel, on maps of `dtype`; None for one block per
        channel."""
        K = _kernels
        n, c, s = self._cfg
        P = K.blocks_per_channel(c, n * s)
        dtype = numpy.dtype(dtype)
        if P <= 1 or dtype in GPUBatchNormLayer._split_failed:
            return None
        try:
            ks = [K.kernel(name, dtype) for name in names]
        except Exception as exc:        # the extra module: keep the one-block kernels
            GPUBatchNormLayer._split_failed |= {dtype}
            K.note_failure('BatchNorm split kernels (%s maps)' % dtype, exc)
            return None
        b = self._split_bufs
        if b is None or b.size < c or not K.is_device(b):
            b = self._split_bufs = K.empty(c)
        return (ks[0], ks[1], P, _partial_sums(2 * c * P), b, (K.channel_block(n * s // P),))

    def _launch_backward(self, dy, xn, std, dx, sc, bi, dsc, dbi, flags):
        K = _kernels
        n, c, s = self._cfg
        dtype = dy.dtype
        if dtype != numpy.float32:
            # The 16-bit build's float32 pointers: placeholders the flags leave
            # unused (the maps' own arrays stand in for them in float32) become
            # the std buffer. (xn is a map in either build.)
            sc, bi, dsc, dbi = (a if a.dtype == numpy.float32 else std
                                for a in (sc, bi, dsc, dbi))
        if self._nhwc:
            self._backward_nhwc(dy, xn, std, dx, sc, bi, dsc, dbi, flags)
            return
        split = self._split_kernels(('cp_bn_bwd_part', 'cp_bn_bwd_apply'), dtype)
        if split is not None:
            kp, ka, P, part, _, block = split
            args = (K.u32(n), K.u32(c), K.u32(s), K.u32(P), K.i32(flags))
            if flags & (K.BN_BATCH | K.BN_DSCALE | K.BN_DBIAS):
                kp((c * P,), block, (dy, xn, sc, bi, part) + args)
            ka((c * P,), block, (dy, xn, std, dx, sc, bi, dsc, dbi, part) + args)
            return
        K.kernel('cp_bn_bwd', dtype)((c,), (K.channel_block(n * s),), (
            dy, xn, std, dx, sc, bi, dsc, dbi, K.u32(n), K.u32(c), K.u32(s), K.i32(flags)))

    def _fast_forward(self, bottom, top):
        K = _kernels
        n, c, s = self._cfg
        if not 0 < n * c * s <= K.MAX_COUNT:
            return False
        arrays, _ = K.maps((bottom[0], False), (top[0], False))
        if arrays is None:
            return False
        x, y = arrays
        ch = self._chain
        if ch is not None and ch.fwd_active and ch.geometry_ok() and ch.forward(x, y):
            return True
        if self.scale_bias:
            s, b = K.flat(self.blobs[3]), K.flat(self.blobs[4])
            if s is None or b is None:
                return False
            return self._launch_forward(x, y, K.BN_SCALE | K.BN_BIAS, s, b)
        return self._launch_forward(x, y)

    def _forward(self, bottom, top):
        if not (_kernels.active() and _fused('BatchNorm forward', self._fast_forward, bottom, top)):
            super()._forward(bottom, top)

    def _fast_backward(self, top, propagate_down, bottom):
        K = _kernels
        n, c, s = self._cfg
        count = n * c * s
        if not 0 < count <= K.MAX_COUNT or self._std is None or self._std.size != c:
            return False
        batch = not self.use_global_stats
        xn = self._x_norm
        if (batch or self.scale_bias) and (xn is None or xn.size != count):
            return False
        arrays, _ = K.maps((top[0], True), (bottom[0], True))
        dy, dx = arrays if arrays is not None else (None, None)
        if dy is None or dx is None or not K.is_device(self._std) or \
                (xn is not None and not K.is_device(xn)):
            return False
        flags = K.BN_DX | (K.BN_BATCH if batch else 0)
        if self.scale_bias:
            # The kernel always writes dx; without it the generic code runs.
            if not propagate_down[0]:
                return False
            s, b = K.flat(self.blobs[3]), K.flat(self.blobs[4])
            want_ds, want_db = self.param_needs_backward(3), self.param_needs_backward(4)
            ds = K.flat(self.blobs[3], diff=True) if want_ds else dx
            db = K.flat(self.blobs[4], diff=True) if want_db else dx
            if s is None or b is None or ds is None or db is None:
                return False
            flags |= K.BN_SCALE | K.BN_BIAS | (K.BN_DSCALE if want_ds else 0) | \
                (K.BN_DBIAS if want_db else 0)
            self._launch_backward(dy, xn, self._std, dx, s, b, ds, db, flags)
            return True
        self._launch_backward(dy, xn if xn is not None else dy, self._std, dx, dy, dy, dx, dx,
                              flags)
        return True

    def _backward(self, top, propagate_down, bottom):
        ch = self._chain
        if ch is not None and ch.bwd_done:
            return
        if not propagate_down[0] and not self.scale_bias:
            return
        if not (_kernels.active() and _fused('BatchNorm backward', self._fast_backward, top,
                                            propagate_down, bottom)):
            super()._backward(top, propagate_down, bottom)


@register_engine('CUDNN')
class GPUScaleLayer(_FusedMixin, ScaleLayer):
    """Scale through caffeplus.kernels' cp_scale_fwd / cp_scale_bwd on the GPU."""
    engine = 'FUSED'
    _chain = None
    _keep_buf = _keep_key = None

    def _scale_grad_needed(self, bottom):
        return len(bottom) > 1 or self.param_needs_backward(0)

    def internal_buffers(self):
        """In a BatchNorm -> Scale chain the scale gradient reads BatchNorm's
        kept normalized copy: nothing of its own to keep."""
        if self._chain is not None:
            return {}
        return super().internal_buffers()

    def forget_kept_buffers(self):
        super().forget_kept_buffers()
        self._keep_buf = self._keep_key = self._my_copy = None

    def _fast_forward(self, bottom, top):
        K = _kernels
        outer, dim, inner = self.dims
        count = outer * dim * inner
        if not 0 < count <= K.MAX_COUNT:
            return False
        bid = self.bias_param_id
        if bid is not None and self.bias_dims != self.dims:
            return False
        arrays, dtype = K.maps((bottom[0], False), (top[0], False))
        s = K.flat(self._scale_blob(bottom))
        b = K.flat(self.blobs[bid]) if bid is not None else None
        if arrays is None or s is None or (bid is not None and b is None):
            return False
        x, y = arrays
        keep = _same_data(bottom[0], top[0]) and self._scale_grad_needed(bottom)
        flags = (K.SC_BIAS if b is not None else 0)
        kp = y
        if keep:
            # In the maps' type (internal_buffers declares it so).
            self._keep_buf = kp = scratch.get(self, 'bottom_copy', count, dtype,
                                              K.array_module())
            key = (self.dims, _base_address(kp))
            if key != self._keep_key:
                self._my_copy = _view(kp, self.dims)
                self._keep_key = key
            self._bottom_copy = self._my_copy
            flags |= K.SC_KEEP
        else:
            self._bottom_copy = None
        K.kernel('cp_scale_fwd', dtype)(K.elementwise_grid(count), (K.ELEMENTWISE_THREADS,), (
            x, y, kp, s, b if b is not None else s, K.u32(outer), K.u32(dim), K.u32(inner),
            K.i32(flags)))
        return True

    def _forward(self, bottom, top):
        ch = self._chain
        if ch is not None and ch.fwd_done:
            return
        if not (_kernels.active() and _fused('Scale forward', self._fast_forward, bottom, top)):
            super()._forward(bottom, top)

    def _fast_backward(self, top, propagate_down, bottom):
        K = _kernels
        outer, dim, inner = self.dims
        count = outer * dim * inner
        if not 0 < count <= K.MAX_COUNT:
            return False
        bid = self.bias_param_id
        want_db = bid is not None and self.param_needs_backward(bid)
        if want_db and self.bias_dims != self.dims:
            return False
        learned = len(bottom) == 1
        want_ds = (learned and self.param_needs_backward(0)) or \
            (not learned and propagate_down[1])
        want_dx = bool(propagate_down[0])
        if not (want_ds or want_db or want_dx):
            return True
        arrays, dtype = K.maps((top[0], True))
        s = K.flat(self._scale_blob(bottom))
        if arrays is None or s is None:
            return False
        dy, = arrays
        x = ds = db = dx = None
        flags = 0
        if want_ds:
            if _same_data(bottom[0], top[0]):
                x = self._bottom_copy
                if x is None or x.size != count or not K.is_device(x) or x.dtype != dtype:
                    return False            # the generic code names the problem
            else:
                x = K.flat(bottom[0], any_dtype=True)
            ds = K.flat(self.blobs[0], diff=True) if learned else K.flat(bottom[1], diff=True)
            if x is None or x.dtype != dtype or ds is None:
                return False
            flags |= K.SC_DSCALE | (K.SC_DSCALE_ACC if learned else 0)
        if want_db:
            db = K.flat(self.blobs[bid], diff=True)
            if db is None:
                return False
            flags |= K.SC_DBIAS
        if want_dx:
            dx = K.flat(bottom[0], diff=True, any_dtype=True)
            if dx is None or dx.dtype != dtype:
                return False
            flags |= K.SC_DX
        K.kernel('cp_scale_bwd', dtype)((dim,), (K.channel_block(outer * inner),), (
            dy, x if x is not None else dy, s, dx if dx is not None else dy,
            ds if ds is not None else dy, db if db is not None else dy,
            K.u32(outer), K.u32(dim), K.u32(inner), K.i32(flags)))
        return True

    def _backward(self, top, propagate_down, bottom):
        if _chain_backward(self, 'BatchNorm-Scale backward'):
            return
        if not (_kernels.active() and _fused('Scale backward', self._fast_backward, top,
                                            propagate_down, bottom)):
            super()._backward(top, propagate_down, bottom)


class _FusedReLUMixin:
    """ReLU (any slope) through cp_relu_fwd / cp_relu_bwd; a link of a chain."""
    _chain = None

    # Elementwise: a blob over the kernels' 32-bit count runs in pieces
    # (the generic code's temporaries would take 1-4 bytes per value more).
    def _fast_forward(self, bottom, top):
        K = _kernels
        n = bottom[0]._count
        if n <= 0:
            return False
        arrays, dtype = K.maps((bottom[0], False), (top[0], False))
        if arrays is None:
            return False
        k = K.kernel('cp_relu_fwd', dtype)
        for m, (xs, ys) in _pieces(n, K.MAX_COUNT, *arrays):
            k(K.elementwise_grid(m), (K.ELEMENTWISE_THREADS,), (xs, ys, K.u32(m), F32(self.slope)))
        return True

    def _fast_backward(self, top, propagate_down, bottom):
        K = _kernels
        n = top[0]._count
        if n <= 0:
            return False
        arrays, dtype = K.maps((top[0], True), (top[0] if self.slope >= 0 else bottom[0], False),
                               (bottom[0], True))
        if arrays is None:
            return False
        k = K.kernel('cp_relu_bwd', dtype)
        for m, (dys, refs, dxs) in _pieces(n, K.MAX_COUNT, *arrays):
            k(K.elementwise_grid(m), (K.ELEMENTWISE_THREADS,),
              (dys, refs, dxs, K.u32(m), F32(self.slope)))
        return True


def _apply_add(passes, args, other, total, c_other, c_own, add_flags):
    """cp_bn_apply_add_nhwc_vec: a BatchNorm chain's channels-last normalize
    pass (`args` as cp_bn_apply_nhwc_vec's) with an Eltwise SUM in it, total
    = c_other * other + c_own * top (GPUBatchNormLayer.apply_deferred)."""
    K = _kernels
    K.kernel('cp_bn_apply_add_nhwc_vec', args[0].dtype)(*passes, args + (
        other, total, F32(c_other), F32(c_own), K.i32(add_flags)))


def _pieces(n, most, *arrays):
    """(count, the arrays' views) of consecutive pieces of n values, each at
    most `most`; one piece (every blob below 2**31 values) passes the
    arrays themselves, without making views on this per-layer path."""
    if n <= most:
        return [(n, arrays)]
    return [(min(most, n - o), tuple(a[o:o + most] for a in arrays)) for o in range(0, n, most)]


# The fused kernels replace cuDNN's activation for ReLU (same values; one
# launch with less Python around it): CuDNNReLULayer takes them first.
def _relu_forward(self, bottom, top):
    if self.masked:
        return self._masked_forward(bottom, top)
    ch = self._chain
    if ch is not None and ch.fwd_done:
        return
    if not (_kernels.active() and _fused('ReLU forward', self._fast_forward, bottom, top)):
        _CudnnActivationMixin._forward(self, bottom, top)


def _relu_backward(self, top, propagate_down, bottom):
    if self.masked:
        if propagate_down[0]:
            self._masked_backward(top, bottom)
        return
    if _chain_backward(self, 'BatchNorm-Scale-ReLU backward'):
        return
    if not propagate_down[0]:
        return
    if not (_kernels.active() and _fused('ReLU backward', self._fast_backward, top,
                                        propagate_down, bottom)):
        _CudnnActivationMixin._backward(self, top, propagate_down, bottom)


for _name, _value in (('_fast_forward', _FusedReLUMixin._fast_forward),
                      ('_fast_backward', _FusedReLUMixin._fast_backward),
                      ('_forward', _relu_forward), ('_backward', _relu_backward),
                      ('_chain', None)):
    setattr(CuDNNReLULayer, _name, _value)


@register_engine('CUDNN')
class GPUEltwiseLayer(_FusedMixin, EltwiseLayer):
    """Eltwise SUM through cp_axpby / cp_scale2 on the GPU (PROD and MAX: generic)."""
    engine = 'FUSED'
    _chain = None

    def _fast_forward(self, bottom, top):
        K = _kernels
        n = top[0]._count
        if not 0 < n <= K.MAX_COUNT:
            return False
        arrays, dtype = K.maps(*[(b, False) for b in bottom], (top[0], False))
        if arrays is None:
            return False
        xs, y = arrays[:-1], arrays[-1]
        grid, block, c = K.elementwise_grid(n), (K.ELEMENTWISE_THREADS,), self.coeffs
        ch = self._chain
        relu = ch is not None and ch.fwd_active and len(xs) == 2
        k = K.kernel('cp_axpby', dtype)
        k(grid, block, (xs[0], xs[1], y, K.u32(n), F32(c[0]), F32(c[1]), K.i32(relu)))
        for a, ci in zip(xs[2:], c[2:]):
            k(grid, block, (y, a, y, K.u32(n), F32(1), F32(ci), K.i32(0)))
        if relu:
            ch.fwd_done = True          # the ReLU after us has nothing left to do
        return True

    def paired_branch(self):
        """The BatchNorm of the branch chain this Eltwise SUM's fused pass
        can take (_SumChain.branch), or None."""
        ch = self._chain
        return ch.branch.bn if isinstance(ch, _SumChain) and ch.branch is not None else None

    def remake_with_branch(self):
        """Write the sum's top again (caffeplus.memory.recompute.remake_sum)
        in one channels-last pass from the paired branch's kept copy and the
        other bottom: the normalize-and-add kernel the forward runs, with
        identity statistics (remake_chain_top), so the forward's bits where
        its Eltwise ran fused with its ReLU. False (nothing done) elsewhere."""
        K = _kernels
        ch = self._chain
        if not isinstance(ch, _SumChain) or ch.branch is None or not ch.fwd_done or \
                not ch.branch.fwd_done or not K.active():
            return False
        bn = ch.branch.bn
        n = ch.top._count
        if not bn._nhwc or bn._x_norm is None or not 0 < n <= K.MAX_COUNT:
            return False
        other = ch.bottoms[1 - ch.branch_bottom]
        arrays, _ = K.maps((other, False), (ch.top, False))
        params = ch.branch.scale_bias_flags()
        if arrays is None or params is None:
            return False
        xn = bn._x_norm.reshape(-1)
        vec, _, _, _, _, _, passes = bn._nhwc_plan(xn, *arrays)
        if not vec:
            return False
        m, c, _ = bn._cfg
        zeros, ones, _ = bn._identity(c)
        s, b, flags = params
        coeffs = self.coeffs
        # (The branch's top itself not stored.)
        _apply_add(passes, (xn, arrays[1], arrays[1], zeros, ones, s, b if b is not None else s,
                            K.u32(m), K.u32(c), K.i32(flags)),
                   arrays[0], arrays[1], coeffs[1 - ch.branch_bottom], coeffs[ch.branch_bottom],
                   2)
        return True

    def _fast_backward(self, top, propagate_down, bottom):
        K = _kernels
        n = top[0]._count
        if not 0 < n <= K.MAX_COUNT:
            return False
        wanted = [i for i, b in enumerate(bottom) if propagate_down[i]]
        arrays, dtype = K.maps((top[0], True), *[(bottom[i], True) for i in wanted])
        if arrays is None:
            return False
        dy = arrays[0]
        outs = [(a, self.coeffs[i]) for a, i in zip(arrays[1:], wanted)]
        _scale_diffs(dy, dy, outs, n, 0, dtype)
        return True

    def _forward(self, bottom, top):
        ch = self._chain
        if ch is not None and ch.branch is not None and \
                ch.branch.bn._deferred_apply is not None:
            if _fused('BatchNorm-Scale-Eltwise forward', ch.forward_with_branch):
                return
            ch.settle()
        if not (self.op == _ELTWISE_SUM and _kernels.active() and
                _fused('Eltwise forward', self._fast_forward, bottom, top)):
            super()._forward(bottom, top)

    def _backward(self, top, propagate_down, bottom):
        ch = self._chain
        if ch is not None and ch.bwd_done:
            return
        if not (self.op == _ELTWISE_SUM and _kernels.active() and
                _fused('Eltwise backward', self._fast_backward, top, propagate_down, bottom)):
            super()._backward(top, propagate_down, bottom)


@register_engine('CUDNN')
class GPUSplitLayer(SplitLayer):
    """Split whose backward sums the top diffs with cp_axpby on the GPU; the
    last link of an Eltwise SUM -> ReLU chain (_SumChain)."""
    engine = 'FUSED'
    _chain = None

    def _fast_backward(self, top, propagate_down, bottom):
        K = _kernels
        n = bottom[0]._count
        if len(top) < 2 or not 0 < n <= K.MAX_COUNT:
            return False
        arrays, dtype = K.maps(*[(t, True) for t in top], (bottom[0], True))
        if arrays is None:
            return False
        ds, dx = arrays[:-1], arrays[-1]
        grid, block = K.elementwise_grid(n), (K.ELEMENTWISE_THREADS,)
        k = K.kernel('cp_axpby', dtype)
        one, no = F32(1), K.i32(0)
        k(grid, block, (ds[0], ds[1], dx, K.u32(n), one, one, no))
        for a in ds[2:]:
            k(grid, block, (dx, a, dx, K.u32(n), one, one, no))
        return True

    def _backward(self, top, propagate_down, bottom):
        if not propagate_down[0] or _chain_backward(self, 'Split-ReLU-Eltwise backward'):
            return
        if not (_kernels.active() and
                _fused('Split backward', self._fast_backward, top, propagate_down, bottom)):
            super()._backward(top, propagate_down, bottom)


_register_planner()
