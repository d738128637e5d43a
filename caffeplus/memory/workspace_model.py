"""Estimates the memory planner makes without a GPU: convolution workspace,
layer-internal buffers, the runtime's fixed cost, and layer times.

Everything here is a model, not a measurement. The constants are either
Caffe's own (the 8 MB limit, 3 streams per group) or fitted to the stock
Caffe measurements in shared/bench/README.md (H100, CUDA 13, cuDNN 9.19:
MODEL_GPU, which `caffeplus memory` names beside the times it gives),
and are meant to be recalibrated with `caffeplus memory -gpu` (see
CALIBRATION below). `caffeplus memory --estimate` prints what they give.

Convolution workspace
---------------------
Each convolution (forward, backward-data, backward-filter: three "kinds")
runs one of several algorithms; the model offers three candidates per
layer and per kind, with the workspace bytes they need and a time factor
relative to the fastest (1.0):

  name        bytes                                        time  when
  gemm        0 (1x1 stride-1 convolutions are plain GEMMs) 1.0   1x1, stride 1, no pad
  implicit    0          (IMPLICIT_GEMM / ALGO_0-like)       1.6   otherwise
  precomp     8 B x (C/g) x prod(kernel) (an index buffer,    1.15  forward only
              IMPLICIT_PRECOMP_GEMM-like; cuDNN's backward
              calls have none: with no workspace to spare,
              VGG-16 b256's conv1_2 measured 1.56x)
  transform   4 B x (input + output feature map), the maps   1.0   stride 1, dilation 1
              once in a tiled transform domain
              (FFT_TILING / WINOGRAD_NONFUSED-like)
  explicit    4 B x the im2col column buffer of the whole    1.0   strided or dilated
              call (GEMM-like)

Over 16-bit maps (FLOAT16, BFLOAT16: tensor-core algorithms) the bytes are
counted at the maps' two bytes a value, and the transform takes
HALF_TRANSFORM_FACTOR (1.1) times the call's 16-bit maps instead.

Plans use them as follows:
  stock    Caffe 1.0's CuDNNConvolutionLayer: per kind the fastest algorithm
           within workspace_limit_bytes = 8 MB, modelled as
           min(im2col column bytes of one group, 8 MB); the layer allocates
           max over the kinds x group x 3 (CUDNN_STREAMS_PER_GROUP), and every
           convolution layer keeps its own. Summed over the layers.
  arena, shared, offload
           one workspace for the net, as large as the largest single
           convolution's need with its fastest candidate.
  auto     a cap chosen by caffeplus.memory.budget; each layer then runs its
           fastest candidate within the cap. Under a budget each call its
           fastest within what its step leaves (budget.fit_calls), on
           cuDNN's measured candidates where caffeplus.memory.calibration
           has them (then these three are not used for that layer).

Layer-internal buffers ("other")
--------------------------------
Some layers keep arrays of their own from forward to backward; they are not
blobs, so the liveness planner does not see them. The model follows the
current layer code (layers/*.py); a layer that defines `internal_bytes()`
overrides it:

  Pooling MAX / STOCHASTIC   int32 argmax, the size of the top
  LRN                        the scale array, the size of the bottom
  Dropout (TRAIN)            a bool mask, 1 byte per bottom element
  BatchNorm (batch stats)    a copy of the normalized top, in the top's type
  Scale (in place, learning) a copy of the bottom, in the bottom's type
  Eltwise MAX                int32 argmax, the size of the top

`stock` counts instead what the stock plan holds: Caffe 1.0's own layer
buffers (caffeplus.memory.caffe1: BatchNorm temp_, x_norm_ and, in place,
x_norm_'s diff; in-place Scale temp_; MAX pooling's int32 max_idx_;
Dropout's uint32 rand_vec_; SoftmaxWithLoss prob_ data and diff; ...),
which our layers keep themselves or caffe1.attach adds on the GPU.

Fixed cost ("other")
--------------------
RUNTIME_BYTES is what the process holds on the device besides the plan's
buffers: the CUDA context, CuPy, cuBLAS's workspace, cuDNN, the fused
kernels and the captured CUDA graphs. It is MEASURED: the "other" of the
`arena` and `shared` plans on the H100 (MODEL_GPU:
637-684 MiB over AlexNet, GoogLeNet, VGG-16
and ResNet-50; mean 660 MiB), at CUDA's default per-thread stack and cuBLAS's default
workspace pool; the plans but `stock` lower that limit and keep one cuBLAS
buffer instead of two, and hold less (caffeplus.memory.thread_stack,
caffeplus.memory.cublas_pool); a net whose convolutions run in 16 bits
settles on a smaller stack than an FP32 one (thread_stack.SETTLED_MODEL_BYTES_16BIT).

For `stock`, Caffe's per-layer cuDNN handles add HANDLE_BYTES each: 3 per
group per convolution layer (with a CUDA stream each) and one per other
layer Caffe builds as a cuDNN class (ReLU, AVE pooling, LRN, softmax...:
caffe1.handle_layers). HANDLE_BYTES is a FIT: with RUNTIME_BYTES, Caffe's
layer buffers and the workspace model above, 5 MiB puts the stock estimate
within 2.7% of all six stock Caffe figures in bench/README.md (an earlier
least-squares fit of both constants gave 555 MiB + 6 MiB per handle).

Layer times (for `auto` and iter_ms estimates)
----------------------------------------------
Convolution and InnerProduct: 2 x weights x output positions FLOPs forward,
twice that backward, at CONV_FLOPS (fitted to stock Caffe's VGG-16 at
b64 and b256: 299 and 940 ms forward-backward without data), each call
adding LAYER_OVERHEAD, all divided by CAFFEPLUS_SPEEDUP (caffeplus's own
runs); 1 x 1 convolutions and image stems at their measured factors
(GEMM_1X1_TIME, STEM_TIME); over 16-bit maps SIXTEEN_BIT_CONV_TIME of
that. Every other layer is caffeplus's own GPU
layer in absolute seconds (own_layer_seconds: its maps moved at
MEASURED_BANDWIDTH, at their stored size, plus a call's cost, fused
chains at their head). On the
four bench nets the modelled steps sum to within 10% of the measured ones
forward and backward, except ResNet-50's backward (11% short) and
GoogLeNet's forward (11% short); they place offload 'free''s copies.

CALIBRATION: `caffeplus memory -gpu 0` prints measured beside estimated
numbers; adjust RUNTIME_BYTES, HANDLE_BYTES, the candidate sizes and the
internal-buffer table until the estimates are within 5%.
"""
import collections

from caffeplus import kernels
from caffeplus.backend.blas import FALLBACK_BYTES
from caffeplus.memory import caffe1, calibration, cublas_pool, thread_stack
from caffeplus.memory.fixed_cost import RUNTIME_BYTES  # measured (see "Fixed cost" above)
from caffeplus.memory.kept_model import internal_bytes, map_itemsize as _itemsize
from caffeplus.memory.liveness import FLOAT_BYTES
from caffeplus.precision import ROUNDED_WEIGHT_TYPES

MiB = 2 ** 20
# The GPU the times and the runtime's fixed cost were fitted on (reports name it).
MODEL_GPU = 'NVIDIA H100 80GB HBM3'
STOCK_WORKSPACE_LIMIT = 8 * 1024 * 1024     # Caffe's workspace_limit_bytes
STREAMS_PER_GROUP = 3                       # Caffe's CUDNN_STREAMS_PER_GROUP
HANDLE_BYTES = 5 * MiB                      # a fit (see "Fixed cost" above)
# (The offload runtime holds no device memory of its own: the 60-64 MiB once
# measured as `offload` less `shared` on AlexNet b128, where nothing moves,
# was its host-link probe's block left in CuPy's pool, now given back.)
CONV_FLOPS = 22e12                          # effective FP32 convolution FLOP/s
LAYER_OVERHEAD = 0.3e-3                     # seconds per conv/IP call (launches, sync)
MEMORY_BANDWIDTH = 1.5e12                   # effective bytes/s of the solver's update
# What VGG-16 b256's ReLUs and poolings move per second on the H100
# (dev/profile_gpu.py: 15 ReLUs forward 27.8 GB in 10.35 ms,
# backward 41.6 GB in 15.5 ms; 5 poolings forward 7.8 GB in 3.0 ms), and
# most of the bench nets' own layers: own_layer_seconds' rate.
MEASURED_BANDWIDTH = 2.7e12
# caffeplus's own convolutions and InnerProducts on the H100 run this much
# faster than the model above (fitted to stock Caffe): arena-plan
# iterations measured against the model's (taken for every layer),
# AlexNet 11.8 vs 43.3 ms, GoogLeNet 38 vs 139, VGG-16 84 vs 313,
# ResNet-50 70 vs 263 (3.7x, +-2%). Step times feed offload decisions
# (policy 'free', `auto`), which weigh them against the host link.
CAFFEPLUS_SPEEDUP = 3.7
# A convolution or InnerProduct over 16-bit maps (FLOAT16, BFLOAT16: tensor
# cores) against the same call in FP32: the sum of cuDNN's fastest forward,
# backward-data and backward-filter times over the bench nets'
# convolutions, NCHW, timed search, H200 (dev/conv_precision_probe.py:
# VGG-16 17.8 against 82.5 ms, 0.22x; ResNet-50 13.1 against 47.1, 0.28x).
SIXTEEN_BIT_CONV_TIME = 0.25
CONV_TYPES = ('Convolution', 'Deconvolution')
KINDS = ('fwd', 'bwd_data', 'bwd_filter')

# `backward_factor`: the backward calls' factor where it differs from the
# forward's (a measured layer's: caffeplus.memory.calibration).
Candidate = collections.namedtuple('Candidate', 'name bytes time_factor backward_factor',
                                   defaults=(None,))


def _prod(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def is_conv(layer):
    return layer.layer_param.type in CONV_TYPES


def conv_layers(net):
    """[(layer index, layer)] of the net's convolutions."""
    return [(i, l) for i, l in enumerate(net.layers) if is_conv(l)]


class ConvShape:
    """What the model needs of a built Convolution/Deconvolution layer."""

    def __init__(self, layer):
        self.reverse = bool(getattr(layer, 'reverse', False))
        self.num = int(layer.num)
        self.group = int(layer.group)
        self.geom = layer.geom
        self.in_count = self.num * int(layer.channels) * _prod(layer.in_spatial)
        self.out_count = self.num * int(layer.num_output) * _prod(layer.out_spatial)
        # The "image" side of im2col and the side the columns run over.
        self.im_channels = int(layer.num_output if self.reverse else layer.channels)
        self.col_spatial = tuple(layer.in_spatial if self.reverse else layer.out_spatial)
        self.weight_count = int(layer.blobs[0].count) if layer.blobs else 0
        # Bytes per value of the maps it convolves: cuDNN's buffers hold them
        # in that type (16-bit nets run tensor-core algorithms).
        dtype = getattr(layer, 'activation_dtype', None)
        self.itemsize = FLOAT_BYTES if dtype is None else int(dtype.itemsize)

    @property
    def column_bytes(self):
        """The im2col column buffer of the whole call (all groups)."""
        return self.itemsize * self.im_channels * self.geom.kernel_count * self.num * \
            _prod(self.col_spatial)

    @property
    def is_1x1(self):
        return self.geom.is_1x1

    @property
    def unit_stride(self):
        return all(s == 1 for s in self.geom.stride) and all(d == 1 for d in self.geom.dilation)

    @property
    def flops(self):
        """Forward FLOPs: 2 x weights x column positions x batch."""
        return 2.0 * self.weight_count * self.num * _prod(self.col_spatial)


# Fitted to cuDNN 9.19's timed choices on the H100 (tools/dump_algorithms.py,
# FP32): the fastest stride-1 algorithms (Winograd non-fused, FFT) need
# about 2.25 x the bytes of the call's input and output maps (VGG-16's
# conv1_2, conv2_1, conv2_2, AlexNet's conv2: 2.15-2.26); forward and
# backward-data also have a tiled FFT a few percent slower in a small
# fraction of that (0.05-0.25: 0.15 here); backward-filter has none.
TRANSFORM_FACTOR = 2.25
# On small maps (AlexNet's 13 x 13 conv3-5) the fastest are FFTs padded to a
# power of two: 3.5-6 x the maps (tools/dump_algorithms.py).
SMALL_MAP = 16
SMALL_TRANSFORM_FACTOR = 4.0
# 16-bit maps (FLOAT16, BFLOAT16): cuDNN 9.19's timed choices on the H200
# need about the bytes of the call's 16-bit input and output maps, 1.0-1.18
# on 14-56 pixel maps (VGG-16's conv3-5, ResNet-50's 3 x 3 ones), 0.5-1.4
# on AlexNet's 13 x 13 (caffeplus memory -gpu 0 --precision fp16's
# workspace_calls, benchmarks/memory).
HALF_TRANSFORM_FACTOR = 1.1
TILING_FACTOR = 0.15
TILING_TIME = 1.04
# Timed search also runs each call over halves, quarters and eighths of the
# batch (cudnn/algo_search.py CHUNK_VARIANTS): the transforms' workspace scales
# with the slice, the time grows a little per slicing (measured on VGG-16's
# conv1_2 at b64: +1-4% over halves, +6-10% over quarters, +7%
# over eighths for the filter gradient).
CHUNK_SLICES = (2, 4, 8)
CHUNK_TIME = {2: 1.02, 4: 1.06, 8: 1.08}
# A slice of FULL_SLICE images or more keeps the GPU as busy as the whole
# batch: its calls cost no more. At b256, VGG-16's conv3-5 calls choose
# 612-1,360 MiB where the whole batch's transforms take 784-1,764, and an
# estimate of `shared` with the whole-batch transform at conv4_3's backward
# is 6.8% over the measured peak; at b64 the same calls took 180-477 MiB, about the whole batch's.
FULL_SLICE = 128
# Small maps' FFTs neither tile nor slice cheaply: AlexNet's conv3-5 (13 x 13)
# at b128 run 13-50% slower over halves (tools/dump_algorithms.py),
# and their tiled FFTs are no faster than the implicit GEMMs.
SMALL_CHUNK_TIME = {2: 1.3, 4: 1.5, 8: 1.7}


def base_seconds(layer):
    """What a time factor of 1.0 means for one call of `layer` (forward, or
    each of the two backward calls), in seconds: step_seconds' scale."""
    return ConvShape(layer).flops / CONV_FLOPS / CAFFEPLUS_SPEEDUP


def _measured(layer, kind):
    """The measured candidates of one call (caffeplus.memory.calibration),
    as time factors on step_seconds' scale; None where not measured."""
    pairs = calibration.lookup(layer, kind)
    if not pairs:
        return None
    base = base_seconds(layer) or 1.0
    return [Candidate('measured', b, t / base) for b, t in pairs]


# Times the model's FLOP rate misses (the step times offload 'free' measured
# on the bench nets, H100): 1 x 1 convolutions are plain GEMMs
# at about a third of the transforms' effective rate, (forward, backward)
# factors by unit stride (ResNet-50's 30 unit-stride ones 1.2 / 1.6 and 6
# strided ones 1.3 / 2.9; GoogLeNet's 39: 1.14 / 1.15); and image stems
# (at most STEM_CHANNELS input channels: AlexNet's conv1, ResNet's and
# GoogLeNet's 7 x 7, VGG's conv1_1) reduce over too few channels to keep
# the GPU busy: 3.6-6.9 x forward, 1.9-3.8 x backward.
GEMM_1X1_TIME = {True: (1.2, 1.5), False: (1.3, 2.9)}
STEM_CHANNELS = 4
STEM_TIME = (4.0, 2.2)


def candidates(layer, kind=None):
    """The algorithm candidates of one convolution layer (for call site
    `kind`: fwd, bwd_data, bwd_filter; None: those every kind has). Where
    the calibration table in use measured the layer, its candidates (kind
    None: every kind's)."""
    if calibration.covers(layer):
        kinds = KINDS if kind is None else (kind,)
        return [c for k in kinds for c in _measured(layer, k)]
    s = ConvShape(layer)
    if s.is_1x1:
        return [Candidate('gemm', 0, *GEMM_1X1_TIME[s.unit_stride])]
    # Backward-filter's GEMM-like algorithms are far slower than its
    # transforms (2-2.7x on VGG-16's first layers), the others' less so.
    slow = 2.0 if kind == 'bwd_filter' else 1.0
    out = [Candidate('implicit', 0, 1.6 * slow)]
    if kind in (None, 'fwd'):
        out.append(Candidate('precomp', 8 * (s.im_channels // s.group) * s.geom.kernel_count,
                             1.15 * slow))
    maps = s.itemsize * (s.in_count + s.out_count)
    small = max(s.col_spatial) <= SMALL_MAP
    chunk_time = SMALL_CHUNK_TIME if small else CHUNK_TIME
    if s.unit_stride:
        if s.itemsize < FLOAT_BYTES:
            factor = HALF_TRANSFORM_FACTOR
        else:
            factor = SMALL_TRANSFORM_FACTOR if small else TRANSFORM_FACTOR
        big = Candidate('transform', int(factor * maps), 1.0)
        out.append(big)
        if kind in ('fwd', 'bwd_data') and not small:
            out.append(Candidate('tiling', int(TILING_FACTOR * maps), TILING_TIME))
    else:
        # Strided (AlexNet's conv1, ResNet's stem): cuDNN's implicit GEMMs
        # beat the explicit column buffer (1.31 vs 1.43 ms on AlexNet's conv1),
        # backward-filter's too (1.35 ms, no workspace).
        out[0] = Candidate('implicit', 0, 1.0)
        big = Candidate('explicit', s.column_bytes, 1.09)
        out.append(big)
    # The batch-sized workspace, run over slices of the batch.
    out.extend(Candidate('%s/%d' % (big.name, k), big.bytes // k,
                         big.time_factor * (1.0 if not small and s.num // k >= FULL_SLICE
                                            else chunk_time[k]))
               for k in CHUNK_SLICES if s.num % k == 0 and s.num >= 2 * k)
    if s.im_channels // s.group <= STEM_CHANNELS and not s.reverse:
        fwd, bwd = STEM_TIME
        out = [c._replace(time_factor=c.time_factor * fwd,
                          backward_factor=(c.backward_factor or c.time_factor) * bwd)
               for c in out]
    return out


def fastest(layer, cap=None):
    """The fastest candidate whose workspace fits `cap` (None: no cap). For
    a measured layer, each call's fastest within the cap (else its least
    workspace), as one candidate: the largest of their bytes, the forward's
    factor and the backward calls' mean."""
    if calibration.covers(layer):
        picks = []
        for kind in KINDS:
            cands = _measured(layer, kind)
            fits = [c for c in cands if cap is None or c.bytes <= cap] or \
                [min(cands, key=lambda c: (c.bytes, c.time_factor))]
            picks.append(min(fits, key=lambda c: (c.time_factor, c.bytes)))
        return Candidate('measured', max(c.bytes for c in picks), picks[0].time_factor,
                         (picks[1].time_factor + picks[2].time_factor) / 2.0)
    fits = [c for c in candidates(layer) if cap is None or c.bytes <= cap]
    return min(fits, key=lambda c: (c.time_factor, c.bytes))


def stock_layer_workspace(layer):
    """Caffe 1.0's cuDNN workspace for one convolution layer (see above)."""
    s = ConvShape(layer)
    per_group = s.column_bytes // s.group
    per_kind = min(per_group, STOCK_WORKSPACE_LIMIT)
    return per_kind * s.group * STREAMS_PER_GROUP


def stock_candidate(layer):
    """What Caffe's 8 MB limit lets one group of a stock layer run."""
    s = ConvShape(layer)
    return fastest(layer, cap=STOCK_WORKSPACE_LIMIT * s.group)


def stock_workspace(net):
    return sum(stock_layer_workspace(l) for _, l in conv_layers(net))


def arena_workspace(net, cap=None):
    """One workspace for the net: the largest need among the convolutions'
    fastest candidates within `cap`."""
    return max([fastest(l, cap).bytes for _, l in conv_layers(net)] + [0])


def knee_cap(net, tolerance=None):
    """The workspace cap the arena takes without a user's limit
    (caffeplus.memory.workspace.knee_budget, on the model's candidates): the
    least at which the convolutions' modelled time, every call site at its
    fastest candidate within the cap, is within the tolerance of their time
    without a cap. None: no cap (the knee is off)."""
    from caffeplus.memory.workspace import knee_tolerance, least_within
    if tolerance is None:
        tolerance = knee_tolerance()
    if tolerance < 0:
        return None
    sites = []
    for _, l in conv_layers(net):
        flops = ConvShape(l).flops
        sites.extend([(c.bytes, flops * c.time_factor) for c in candidates(l, kind)]
                     for kind in KINDS)
    return least_within(sites, tolerance)


def workspace_levels(net):
    """Every distinct arena size a cap can produce, ascending."""
    sizes = {0}
    for _, l in conv_layers(net):
        sizes.update(c.bytes for c in candidates(l))
    return sorted(sizes)


def stock_handles(net):
    """cuDNN handles (and streams) stock Caffe creates: 3 per group per conv."""
    return sum(STREAMS_PER_GROUP * ConvShape(l).group for _, l in conv_layers(net))


# -- layer-internal buffers: caffeplus.memory.kept_model --------------------------
def internals(net, plan_name=None):
    if plan_name == 'stock':
        # What the stock plan holds: Caffe's buffers our layers keep themselves,
        # those caffe1.attach adds, and what layers declare (internal_bytes()).
        declared = sum(int(b) for b in (l.internal_bytes() for l in net.layers)
                       if b is not None)
        return caffe1.own_bytes(net) + caffe1.extra_bytes(net) + declared
    return sum(internal_bytes(net, i) for i in range(len(net.layers)))


def other_bytes(net, plan_name):
    """The estimate's "other": the runtime's fixed cost, stock's per-layer
    handles, and the layers' internal buffers (for stock, Caffe 1.0's) with
    their 16-bit weight copies and the scratch they share."""
    return runtime_bytes(plan_name, net) + handle_bytes(net, plan_name) + \
        internals(net, plan_name) + weight_copy_bytes(net) + shared_scratch_bytes(net, plan_name)


def shared_scratch_bytes(net, plan_name):
    """The device buffers GPU layers take turns with, one per purpose, each
    as large as its largest call (caffeplus.backend.device_scratch): a
    channels-last convolution's bottom relaid from Caffe's order (with its
    diff where backward writes one; none for a 16-bit image layer whose
    timed search weighs calls that read the image as it is for both its
    forward and filter gradient, taken to be chosen: the AlexNets' BFLOAT16
    runs take space-to-depth for both, their FLOAT16 runs cuDNN's forward
    over the relaid image, which this then leaves out), a top written in the other order than
    it is stored in (an image convolution's channels-last calls, a ceil-rule
    max pooling between orders), the double partial sums of a channels-last
    convolution's bias gradient (caffeplus.kernels.channel_sums_nhwc), and
    cuBLAS's workspace for the convolutions that run as GEMMs with none
    placed (blas.FALLBACK_BYTES)."""
    from caffeplus import layout
    nhwc = layout.gpu_blobs(net)
    relaid = relaid_diff = relaid_top = bias_partials = 0
    gemm = False
    for i, layer in enumerate(net.layers):
        bottom, top = net.bottom_vecs[i], net.top_vecs[i]
        if not bottom or not top:
            continue
        if layer.layer_param.type == 'Pooling' and hasattr(layer, '_argmax_geometry'):
            if (net.bottom_id_vecs[i][0] in nhwc) != (net.top_id_vecs[i][0] in nhwc) and \
                    layer._argmax_geometry() and not layer.cudnn_agrees():
                relaid_top = max(relaid_top, _itemsize(top[0]) * top[0].count)
            continue
        if not is_conv(layer):
            continue
        gemm = gemm or (plan_name != 'stock' and ConvShape(layer).is_1x1)
        bottom_relaid, top_relaid, pad, compute_nhwc = _conv_sides(net, i, layer, nhwc)
        if compute_nhwc and len(layer.blobs) > 1 and net.layer_need_backward[i] and \
                layer.param_needs_backward(1):
            c = top[0].shape[1]
            bias_partials = max(bias_partials,
                                kernels.nhwc_sum_scratch_bytes(top[0].count // c, c))
        if bottom_relaid:
            count = bottom[0].count // bottom[0].shape[1] * pad if pad else bottom[0].count
            nbytes = _itemsize(bottom[0]) * count
            reads_as_is = getattr(layer, 'reads_image_as_is', None)
            if not (compute_nhwc and reads_as_is is not None and reads_as_is()):
                relaid = max(relaid, nbytes)
            if net.bottom_need_backward[i][0]:
                relaid_diff = max(relaid_diff, nbytes)
        if top_relaid:
            relaid_top = max(relaid_top, _itemsize(top[0]) * top[0].count)
    return relaid + relaid_diff + relaid_top + bias_partials + (FALLBACK_BYTES if gemm else 0)


def _conv_sides(net, i, layer, nhwc):
    """(bottom relaid, top relaid, channels an image is padded to, calls
    channels-last) of convolution i on a GPU that stores the blobs `nhwc`
    channels-last, as layers/cudnn_conv.py decides."""
    bottom_nhwc = net.bottom_id_vecs[i][0] in nhwc
    top_nhwc = net.top_id_vecs[i][0] in nhwc
    decide = getattr(layer, 'calls_channels_last', None)
    compute_nhwc = decide(bottom_nhwc, top_nhwc, modelled=True) if decide else top_nhwc
    bottom_relaid = bottom_nhwc != compute_nhwc
    pad = layer.image_padding(compute_nhwc, bottom_relaid) if decide else 0
    return bottom_relaid, compute_nhwc and not top_nhwc, pad, compute_nhwc


def weight_copy_bytes(net):
    """The 16-bit copies of their FP32 weights and bias that Convolution,
    Deconvolution and InnerProduct layers keep on the GPU, from call to call,
    where their input map is stored in 16 bits (caffeplus.precision)."""
    total = 0
    for i, layer in enumerate(net.layers):
        bottom = net.bottom_vecs[i]
        if layer.layer_param.type not in ROUNDED_WEIGHT_TYPES or not bottom:
            continue
        itemsize = _itemsize(bottom[0])
        if itemsize < FLOAT_BYTES:
            total += itemsize * sum(b.count for b in layer.blobs[:2])
    return total


def runtime_bytes(plan_name, net=None):
    """The runtime's fixed cost under `plan_name` (see "Fixed cost" above);
    for `net`, whose 16-bit convolutions' kernels need a smaller stack."""
    sixteen_bit = net is not None and weight_copy_bytes(net) > 0
    return RUNTIME_BYTES - thread_stack.saved_bytes(plan_name, sixteen_bit=sixteen_bit) - \
        cublas_pool.saved_bytes(plan_name)


def handle_bytes(net, plan_name):
    """Stock Caffe's per-layer cuDNN handles (and streams); 0 for the other plans."""
    if plan_name != 'stock':
        return 0
    return HANDLE_BYTES * (stock_handles(net) + caffe1.handle_count(net))


# What "other" holds, as reports name its parts.
OTHER_PARTS = ('runtime', 'cudnn_handles', 'layer_buffers')


def other_parts(net, plan_name, other):
    """{part: bytes} of an estimated plan's "other" (`other` bytes): the
    runtime, stock's cuDNN handles, and the rest, the layers' own buffers
    (for the placing plans their share of the arena at its peak)."""
    runtime = min(runtime_bytes(plan_name, net), other)
    handles = min(handle_bytes(net, plan_name), other - runtime)
    return collections.OrderedDict(zip(OTHER_PARTS, (runtime, handles,
                                                      other - runtime - handles)))


# -- layer times --------------------------------------------------------------------
def layer_seconds(net, i, conv_factor=1.0):
    """(forward, backward) seconds of layer i, a convolution or an
    InnerProduct, under the model above; `conv_factor` scales a
    convolution by its algorithm's time factor."""
    layer = net.layers[i]
    backward = net.layer_need_backward[i]
    if is_conv(layer):
        f = ConvShape(layer).flops / CONV_FLOPS * conv_factor
    else:
        m = layer.gemm_rows() or \
            net.bottom_vecs[i][0].count // max(layer.blobs[0].count // layer.blobs[0].shape[0], 1)
        f = 2.0 * layer.blobs[0].count * m / CONV_FLOPS
    if _itemsize(net.bottom_vecs[i][0]) < FLOAT_BYTES:
        f *= SIXTEEN_BIT_CONV_TIME
    b = 2 * f
    return f + LAYER_OVERHEAD, (b + LAYER_OVERHEAD if backward else 0.0)


# caffeplus's own elementwise, pooling and data layers on the H100, in
# absolute seconds (not through CAFFEPLUS_SPEEDUP). Fitted to the step times
# offload 'free' measured on the four bench nets (dev/free_offload_probe.py
# --json, benchmarks/memory/2026-11-28-s13/steps_*.json): most
# such layers move their maps at MEASURED_BANDWIDTH (forward: bottoms and
# tops once; backward: twice) plus about OWN_CALL_SECONDS a call; the GPU's
# fused chains (layers/fused_chain.py: BatchNorm, Scale and a ReLU after them, or
# Eltwise and a ReLU, as one pass each way) run at their head and leave their
# members next to nothing; Split's forward shares its bottom.
OWN_CALL_SECONDS = 20e-6
FUSED_MEMBER_SECONDS = 1.5e-6
# ResNet-50 b64's 53 chains: forward 5.44 ms, backward 8.6 ms for 5.42 GB
# of BatchNorm bottoms and tops (statistics, then normalise-scale-ReLU).
BATCHNORM_CHAIN_PASSES = (2.7, 3.6)
# Max pooling's backward where windows overlap (kernel > stride: AlexNet's,
# GoogLeNet's and ResNet's 3 x 3 / 2) scatters into shared inputs: 0.7-1
# TB/s measured against VGG-16's 2 x 2 / 2 at its full rate.
OVERLAPPING_POOL_BACKWARD_PASSES = 5.4


def remake_seconds(moved, launches):
    """The elementwise passes that make maps again (caffeplus.memory.recompute:
    `moved` bytes over `launches` kernels) on the GPU: the fitted model above."""
    return moved / MEASURED_BANDWIDTH + launches * OWN_CALL_SECONDS


def _moved_bytes(net, i):
    return sum(b.count * _itemsize(b) for b in net.bottom_vecs[i]) + \
        sum(b.count * _itemsize(b) for b in net.top_vecs[i])


def own_layer_seconds(net, i):
    """(forward, backward) seconds of caffeplus's own layer i (neither a
    convolution nor an InnerProduct) on the GPU: the fitted model above."""
    layer = net.layers[i]
    t = layer.layer_param.type
    backward = net.layer_need_backward[i]
    passes = (1.0, 2.0)
    calls = (OWN_CALL_SECONDS, OWN_CALL_SECONDS)
    if _in_fused_chain(net, i) and t not in ('BatchNorm', 'Eltwise') and \
            (t != 'Scale' or _follows(net, i, ('BatchNorm',))):
        passes, calls = (0.0, 0.0), (FUSED_MEMBER_SECONDS, FUSED_MEMBER_SECONDS)
    elif t == 'BatchNorm':
        passes = BATCHNORM_CHAIN_PASSES
    elif t == 'Eltwise':
        passes = (1.0, 1.0)     # backward: its chain's ReLU, the diffs shared
    elif t == 'Split':
        passes, calls = (0.0, 1.0), (FUSED_MEMBER_SECONDS, OWN_CALL_SECONDS)
    elif t == 'Concat':
        calls = (OWN_CALL_SECONDS * len(net.bottom_vecs[i]), OWN_CALL_SECONDS)
    elif t == 'Pooling' and hasattr(layer, 'pool'):
        g = layer.pool.geom
        if any(k > s for k, s in zip(g.kernel, g.stride)):
            passes = (1.0, OVERLAPPING_POOL_BACKWARD_PASSES)
    moved = _moved_bytes(net, i) / MEASURED_BANDWIDTH
    f = passes[0] * moved + calls[0]
    b = passes[1] * moved + calls[1] if backward else 0.0
    return f, b


# Layers the GPU runs as fused chains (layers/fused_chain.py: BatchNorm, Scale,
# Eltwise and a ReLU after them, one pass for the chain).
FUSED_TYPES = ('BatchNorm', 'Scale', 'Eltwise')


def _writer_types(net):
    """Per layer, the types of the earlier layers that wrote any of its
    bottoms (found once per net, in one pass: step_seconds asks of every
    layer, and the search calls it many times)."""
    memo = net.__dict__.get('_wm_writer_types')
    if memo is None:
        written = {}
        memo = []
        for i, layer in enumerate(net.layers):
            memo.append(frozenset().union(*(written.get(b, ()) for b in net.bottom_id_vecs[i])))
            for b in net.top_id_vecs[i]:
                written.setdefault(b, set()).add(layer.layer_param.type)
        net.__dict__['_wm_writer_types'] = memo
    return memo


def _follows(net, i, kinds):
    """Whether layer i reads a top of an earlier layer of one of `kinds`."""
    return not _writer_types(net)[i].isdisjoint(kinds)


def _in_fused_chain(net, i):
    t = net.layers[i].layer_param.type
    return t in FUSED_TYPES or (t == 'ReLU' and _follows(net, i, FUSED_TYPES))


def update_seconds(net, history_copies=1):
    """The solver update: read data, diff and history, write data and history."""
    params = sum(p.count for p in net.learnable_params) * FLOAT_BYTES
    return params * (3 + 2 * history_copies) / MEMORY_BANDWIDTH / CAFFEPLUS_SPEEDUP


def _conv_seconds(net, i, cand, factors=None):
    """(forward, backward) model seconds of conv layer i with candidate
    `cand`, or with (forward, backward) `factors` of calls chosen one by one."""
    factor = cand.time_factor
    f, b = layer_seconds(net, i, factor)
    if cand.backward_factor is not None:
        b = layer_seconds(net, i, cand.backward_factor)[1]
    if factors is not None:
        fwd, bwd = factors
        f, b = f * fwd / factor, b * bwd / (cand.backward_factor or factor)
    return f / CAFFEPLUS_SPEEDUP, b / CAFFEPLUS_SPEEDUP


def conv_step_seconds(net, i, factors):
    """Seconds conv layer i adds to an iteration (forward and backward) with
    (forward, backward) time factors (step_seconds' terms)."""
    return sum(_conv_seconds(net, i, fastest(net.layers[i]), factors))


def step_seconds(net, choice=None, factors=None):
    """Seconds of each of the 2L steps (forward then backward) of one
    iteration; `choice` maps a conv layer index to its Candidate (default:
    the fastest); `factors` maps one to (forward, backward) time factors
    instead (calls chosen one by one: the placed workspace's)."""
    L = len(net.layers)
    steps = [0.0] * (2 * L)
    for i, layer in enumerate(net.layers):
        if is_conv(layer):
            cand = (choice or {}).get(i) or fastest(layer)
            f, b = _conv_seconds(net, i, cand, (factors or {}).get(i))
        elif layer.layer_param.type == 'InnerProduct' and layer.blobs:
            f, b = layer_seconds(net, i)
            f, b = f / CAFFEPLUS_SPEEDUP, b / CAFFEPLUS_SPEEDUP
        else:
            f, b = own_layer_seconds(net, i)
        steps[i] += f
        steps[2 * L - 1 - i] += b
    return steps
