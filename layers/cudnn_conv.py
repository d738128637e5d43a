"""Convolution and Deconvolution through cuDNN (or the im2col + cuBLAS or
space-to-depth variant where timed search picks it): descriptors per shape, workspace
from the layer's workspace manager, calls replayed as CUDA graphs.
"""
import functools
import types

import numpy

from caffeplus import backend
from caffeplus import kernels as _kernels
from caffeplus.backend import mathmode
from caffeplus.cudnn import api
from caffeplus.cudnn.algo_search import (CHUNK_VARIANTS, S2D_VARIANT, _ConvDescs,
                                         _chunk_search, _per_group_search, batch_slices_ok,
                                         search_default)
from caffeplus.errors import CaffeplusError
from caffeplus.layer import register_engine
from caffeplus.layers import cudnn_common as _common
from caffeplus.layers.conv_gemm import _GemmConv
from caffeplus.layers.conv_s2d import _SpaceToDepthConv
from caffeplus.layers.cudnn_common import (NHWC_WEIGHTS, KernelPath, _CudnnMixin, _dptr, _prod,
                                           _same_storage_dtype, batch_slices, cudnn_available,
                                           copy_between_orders, padded_count, relaid_top,
                                           sixteen_bit_copy, storage_dtype, top_from_relaid)
from caffeplus.layers.vision import ConvolutionLayer, DeconvolutionLayer
from caffeplus.proto import caffe_pb2


def _conv_forward_calls(cd, conv, algo, reverse, x, w, y, b, ws, nbytes, relu=False):
    """One convolution forward (each group with `split` descriptors) and its
    bias (`relu`: and the ReLU after it, _bias_add_calls)."""
    ws = ws or None
    for g in range(cd.loops):
        if not reverse:
            api.conv_forward(cd.x, x + g * cd.x_off, cd.w, w + g * cd.w_off, conv, algo, ws,
                             nbytes, cd.y, y + g * cd.y_off)
        else:   # a Deconvolution's forward is the convolution's backward data
            api.conv_backward_data(cd.w, w + g * cd.w_off, cd.y, x + g * cd.y_off, conv, algo,
                                   ws, nbytes, cd.x, y + g * cd.x_off)
    if b:
        _bias_add_calls(cd, b, y, relu)


# A 16-bit image convolution runs channels-last even where its top stays in
# Caffe's order (_CudnnConvolutionMixin.calls_channels_last): cuDNN's 16-bit
# calls over 3 channels in Caffe's order are slower than FP32's
# (docs/precision.md, Channels-last maps).
IMAGE_CHANNELS_LAST = True
# A grouped 16-bit convolution may run channels-last too (cuDNN's group count
# over channels-last descriptors; BVLC AlexNet's conv2, conv4 and conv5), but
# not Caffe's per-group calls (the `stock` plan) or the per-group timed
# variant, whose offsets are Caffe's order's. Off by default: slower on
# BVLC AlexNet (cudnn_lrn.CHANNELS_LAST; docs/precision.md, Channels-last maps).
GROUPED_CHANNELS_LAST = False
_BIAS_NHWC = KernelPath('convolution bias (cp_bias_nhwc)')


def _bias_add_calls(cd, b, y, relu=False):
    """The bias added to the top; `relu` (channels-last only): and the
    in-place ReLU after it, in the same pass. Where cp_bias_nhwc fails
    (_BIAS_NHWC.ok turns False) the ReLU is left to its layer."""
    if cd.nhwc:
        # Channels-last 16-bit maps: one pass over the whole top (every batch
        # slice; one group) with caffeplus.kernels' cp_bias_nhwc.
        c = cd.top_full[1]
        if _BIAS_NHWC.run(_kernels.bias_nhwc, y, b, _prod(cd.top_full) // c, c, cd.dtype, relu):
            return
    for g in range(cd.loops):
        api.add_tensor(cd.bias, b + g * cd.b_off, cd.top, y + g * cd.top_off)


_CHANNEL_SUMS = KernelPath('convolution bias gradient (cp_channel_sum)')


def _bias_gradient(cd, dtop, db, dtype=None):
    """db += the top diff summed over batch and space, per output channel
    (beta 1), with caffeplus.kernels.channel_sums over the whole top: every
    group and batch slice at once. cudnnConvolutionBackwardBias's kernel
    (calc_bias_diff) took 2.1 of AlexNet's 9.2 ms a TF32 iteration on the
    H100 (dev/kernel_profile.py); it stays as the fallback."""
    if cd.nhwc:
        # Channels-last: rows of C values, the channels across each block's
        # threads (cp_channel_sum_part walks a channel's values C apart).
        m, c = _prod(cd.top_full) // cd.top_full[1], cd.top_full[1]
        if _CHANNEL_SUMS.run(_kernels.channel_sums_nhwc, dtop, db, m, c, dtype):
            return
    elif _CHANNEL_SUMS.ok:
        # A top too large for one call is summed slice by slice (the kernel
        # indexes with 32-bit ints); each slice adds to db.
        pieces = cd.batch_chunks if _prod(cd.top_full) > _common.MAX_CUDNN_COUNT else 1
        n, c = cd.top_full[0] // pieces, cd.top_full[1]
        s = _prod(cd.top_full[2:])
        p = _kernels.sum_blocks_per_channel(c, n * s)
        if cd.bias_part is None or cd.bias_part.size < c * p:
            cd.bias_part = _kernels.empty(c * p, numpy.float64)

        def slices():
            for g in range(pieces):
                _kernels.channel_sums(dtop + g * cd.top_off, cd.bias_part, db,
                                      n, c, s, p, dtype)
        if _CHANNEL_SUMS.run(slices):
            return
    for g in range(cd.loops):
        api.conv_backward_bias(cd.top, dtop + g * cd.top_off, cd.bias, db + g * cd.b_off,
                               beta=1.0)


def _conv_params_calls(cd, conv, algo, reverse, x, dtop, dw, db, ws, nbytes, beta=1.0,
                       dtype=None):
    """The bias gradient (if db), accumulated, and the filter gradient (if
    dw), accumulated (beta 1) or written (beta 0: a 16-bit layer's scratch);
    the maps of `dtype` (float32 unless given)."""
    if db:
        _bias_gradient(cd, dtop, db, dtype)
    if dw:
        ws = ws or None
        for g in range(cd.loops):
            # Batch slices (w_off 0) write one filter gradient: a written one
            # (beta 0) is written by the first slice and added to by the rest.
            b = 1.0 if g and not cd.w_off else beta
            if not reverse:
                api.conv_backward_filter(cd.x, x + g * cd.x_off, cd.y, dtop + g * cd.y_off, conv,
                                         algo, ws, nbytes, cd.w, dw + g * cd.w_off, beta=b)
            else:       # x is conv-y, the top conv-x
                api.conv_backward_filter(cd.x, dtop + g * cd.x_off, cd.y, x + g * cd.y_off, conv,
                                         algo, ws, nbytes, cd.w, dw + g * cd.w_off, beta=b)


def _conv_data_calls(cd, conv, algo, reverse, dtop, w, dx, ws, nbytes):
    """The bottom gradient."""
    ws = ws or None
    for g in range(cd.loops):
        if not reverse:
            api.conv_backward_data(cd.w, w + g * cd.w_off, cd.y, dtop + g * cd.y_off, conv, algo,
                                   ws, nbytes, cd.x, dx + g * cd.x_off)
        else:
            api.conv_forward(cd.x, dtop + g * cd.x_off, cd.w, w + g * cd.w_off, conv, algo, ws,
                             nbytes, cd.y, dx + g * cd.y_off)


_BIAS_RELU = []


def _bias_relu():
    """y = max(y + b[channel], 0) in place (forward_then_relu)."""
    if not _BIAS_RELU:
        import cupy
        _BIAS_RELU.append(cupy.ElementwiseKernel(
            'raw float32 b, int64 spatial, int64 channels', 'float32 y',
            'float v = y + b[(i / spatial) % channels]; y = v > 0.0f ? v : 0.0f;',
            'cp_bias_relu'))
    return _BIAS_RELU[0]


def _workspace():
    from caffeplus.memory import workspace
    return workspace


class _CudnnConvolutionMixin(_CudnnMixin):
    _chain = None       # a Convolution -> ReLU chain (layers/fused_chain.py)
    workspace_calls = True
    # caffeplus.layout: channels-last maps on either side (channels_last_ok).
    layout_role = 'channels_last'
    # The layout the calls run in: the top's. A bottom stored the other way
    # is copied into it first (a net's first convolution reads Caffe's order).
    compute_nhwc = False
    _bottom_relaid = False
    # An image convolution whose top stays in Caffe's order (an LRN reads it:
    # BVLC's AlexNet) still runs channels-last in 16 bits (calls_channels_last):
    # its calls write a channels-last scratch that is transposed into the top,
    # and the top's diff is transposed into it before backward.
    _top_relaid = False
    # An image input of fewer than 4 channels relaid channels-last is padded
    # to 4 (a zero channel, and zero filter taps for it): cuDNN's 16-bit
    # channels-last kernels for a net's first layer take 4 channels, and
    # with 3 its search fell to generic kernels (ResNet-50's conv1 at b64:
    # 0.17 ms forward with 4 channels against 0.20 with 3 in isolation,
    # 2.6 ms in a net whose arena stopped at its knee;
    # dev/nhwc_layout_probe.py --convs conv1).
    padded_channels = 0

    def workspace_manager(self):
        return self._ws

    def can_time_calls(self):
        return self._cd is not None

    def auto_timed_search(self):
        return getattr(self, '_auto_timed', False)

    def layer_setup(self, bottom, top):
        super().layer_setup(bottom, top)
        self._cd = None
        self._cd_groups = None
        self._cd_chunks = {}
        self._gemm = None
        self._s2d = None
        self._cd_key = None
        self._sites = {}
        self._ws = None
        if not hasattr(self, 'memory_plan'):
            self.memory_plan = None

    # -- which configurations go to cuDNN ------------------------------------
    # The type the layer's maps are stored in: float32, or a 16-bit net's
    # (then cuDNN reads 16-bit copies of the weights, _sixteen_bit_params).
    activation_dtype = numpy.dtype(numpy.float32)
    _dtypes_agree = True
    _weight_copies = None   # the 16-bit weights and bias, sixteen_bit_copy

    def _cudnn_geometry_ok(self):
        if not (self.channel_axis == 1 and 1 <= self.num_spatial <= 3 and self.num > 0):
            return False
        if not self._dtypes_agree:
            return False            # mixed types: the generic code casts
        k = self._batch_slices()
        # Caffe's per-group calls (plan stock) over batch slices too: not built.
        return k is not None and (k == 1 or not self._split_groups())

    def _batch_slices(self):
        """Slices of the batch each cuDNN call runs over (batch_slices): 1
        unless an input or output blob exceeds cuDNN's 32-bit count."""
        return batch_slices(self.num, (self.channels,) + tuple(self.in_spatial),
                            (self.num_output,) + tuple(self.out_spatial))

    def _split_groups(self):
        return self.memory_plan == 'stock' and self.group > 1

    def channels_last_ok(self):
        """Whether the calls can run channels-last: a 16-bit 2-D convolution
        (not a Deconvolution) of one group (or several, GROUPED_CHANNELS_LAST)
        and one bottom, through cuDNN."""
        return self._gpu_mode() and cudnn_available() and self.gpu_channels_last_ok()

    def gpu_channels_last_ok(self):
        """channels_last_ok() on a GPU with cuDNN (caffeplus.layout.modelled_blobs)."""
        groups_ok = self.group == 1 or (GROUPED_CHANNELS_LAST and not self._split_groups())
        return not self.reverse and groups_ok and self.num_spatial == 2 and \
            self._sixteen_bit() and len(self.layer_param.bottom) == 1 and \
            self._cudnn_geometry_ok()

    def calls_channels_last(self, bottom_nhwc, top_nhwc, modelled=False):
        """Whether the calls run channels-last, given how the bottom and top
        are stored: where the top is, and for a 16-bit image input (at most
        layout.IMAGE_CHANNELS channels, padded to 4) under the `layout`
        setting 'nhwc' even where the top stays in Caffe's order (an LRN
        reads it: BVLC's AlexNet, GoogLeNet): cuDNN's first-layer kernels
        take channels-last images of 4 channels; over 3 channels in Caffe's
        order its 16-bit calls fell to generic kernels, slower than FP32's.
        `modelled`: as on a GPU, for a net built anywhere (the estimate)."""
        if top_nhwc:
            return True
        from caffeplus import config
        from caffeplus import layout
        ok = self.gpu_channels_last_ok() if modelled else self.channels_last_ok()
        return IMAGE_CHANNELS_LAST and not bottom_nhwc and len(self.layer_param.top) == 1 and \
            self.channels <= layout.IMAGE_CHANNELS and config.get('layout') == 'nhwc' and ok

    def reads_image_as_is(self):
        """Whether timed search weighs, for both this 16-bit image layer's
        forward and its filter gradient, calls that read its bottom in Caffe's
        order (space-to-depth, im2row): chosen, they leave the bottom's
        channels-last relay unmade (the estimate takes them to be chosen)."""
        if self.reverse or not self._sixteen_bit():
            return False
        descs = types.SimpleNamespace(loops=1, dtype=self.activation_dtype)
        return _SpaceToDepthConv.eligible(self, descs) or _GemmConv.eligible(self, rows=True)

    def image_padding(self, compute_nhwc, bottom_relaid):
        """The channels an image input is padded to where the calls run
        channels-last on it relaid (see padded_channels); 0: none."""
        return 4 if compute_nhwc and bottom_relaid and self.channels < 4 and \
            self.group == 1 and not self.reverse else 0

    def _relaid(self, blob, diff=False, into=None):
        """The bottom's values (or diff) in the calls' layout, in a scratch
        buffer (channels-last: padded to padded_channels with zeros); with
        `into` (the scratch holding the calls' dx), that copied back into the
        bottom's own layout instead."""
        own = _kernels.flat(blob, diff, any_dtype=True)
        pad = self.padded_channels if self.compute_nhwc else 0
        if into is not None:        # (the calls' order is the other one)
            copy_between_orders(own, into, blob.shape, self.compute_nhwc, pad)
            return own
        out = self._relaid_scratch(blob, diff)
        copy_between_orders(out, own, blob.shape, not self.compute_nhwc, pad)
        return out

    def _relaid_scratch(self, blob, diff):
        """The scratch holding a relaid bottom (or its diff), padded channels included."""
        return backend.device_scratch('relaid bottom diff' if diff else 'relaid bottom',
                                      padded_count(blob, self.padded_channels),
                                      self.activation_dtype)

    def _bottom_ptr(self, blob):
        """The address of the bottom's values in the calls' layout."""
        return int(self._relaid(blob).data.ptr) if self._bottom_relaid else _dptr(blob)

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
            # The plan decides per-group calls (stock) and timed search: the
            # descriptors serve again only if they describe the same calls.
            if self._cd_key == self._key() and \
                    getattr(self, '_built_timed', False) == self._timed_search():
                manager.register(self, list(self._sites.values()))     # same descriptors
                if plan_name == 'stock':
                    manager.plan()
            else:
                self._cd_key = None
                if self._cudnn_geometry_ok():
                    self._build_cudnn()
                else:               # runs generically now (e.g. stock's groups over slices)
                    self._cd, self._sites = None, {}

    def _manager(self):
        if self._ws is None:
            from caffeplus.memory import workspace
            self._ws = workspace.default_arena()
        return self._ws

    def _key(self):
        return (self.num, tuple(self.in_spatial), tuple(self.out_spatial), self._split_groups(),
                self._batch_slices(), mathmode.generation(), _workspace().search_mode(),
                backend.device(), self.activation_dtype, self.compute_nhwc, self.padded_channels)

    def _build_cudnn(self):
        """Descriptors and call sites for the current shapes (cached)."""
        key = self._key()
        if key == self._cd_key:
            return
        workspace = _workspace()
        slices = self._batch_slices()
        if self.compute_nhwc and self._split_groups():
            # (the layout was chosen at the net's build, the plan after it)
            raise CaffeplusError('layer %s: a grouped convolution over channels-last maps '
                                 '(GROUPED_CHANNELS_LAST) cannot run the stock plan\'s per-group '
                                 'calls; use --layout nchw with --plans stock'
                                 % self.layer_param.name)
        cd = _ConvDescs(self, self._split_groups(), slices)
        timed = self._timed_search()
        self._built_timed = timed
        self._auto_timed = timed and workspace.search_mode() != 'timed'
        gkey = self._geometry_key() if timed else None
        # Grouped convolutions under timed search: one call per group is a
        # candidate too (cuDNN's grouped kernels are often slower, in TF32
        # mode especially); the fastest of both wins per call site.
        per_group = _ConvDescs(self, True) if timed and cd.loops == 1 and self.group > 1 and \
            not cd.nhwc and _per_group_search() else None
        gemm, chunked, s2d = self._timed_variants(cd, slices) if timed else (None, {}, None)
        sites = {}
        for kind in workspace.KINDS:
            sites[kind] = workspace.Site(kind, cd.candidates(kind), timer=cd.timer(
                kind, gkey, per_group, gemm, chunked, s2d) if timed else None)
        self._cd, self._cd_groups, self._sites, self._cd_key = cd, per_group, sites, key
        self._cd_chunks = chunked
        self._gemm, self._s2d = gemm, s2d
        mgr = self._manager()
        mgr.register(self, list(sites.values()))
        if self.memory_plan == 'stock':
            mgr.plan()          # Caffe allocates its workspace in Reshape

    def _timed_variants(self, cd, slices):
        """(cuBLAS variant or None, {variant: batch-sliced descriptors},
        space-to-depth variant or None): the calls timed search weighs beside
        cuDNN's own for descriptors `cd`."""
        if cd.loops != 1:
            return None, {}, None
        # Few input channels (an image net's first layer): im2col + GEMM too
        # over maps in Caffe's order, or im2row from an image in Caffe's
        # order into channels-last maps (read as it is, like space-to-depth);
        # a 1x1 convolution in either order.
        direct = _GemmConv.is_direct(self)
        if not cd.nhwc or direct:
            ok = not self._bottom_relaid and _GemmConv.eligible(self)
        else:
            ok = self._bottom_relaid and _GemmConv.eligible(self, rows=True)
        gemm = _GemmConv(self, self.activation_dtype, nhwc=cd.nhwc) if ok else None
        # The batch in halves, quarters and eighths: less workspace at about the speed.
        chunked = {v: _ConvDescs(self, False, k) for v, k in CHUNK_VARIANTS.items()
                   if slices == 1 and batch_slices_ok(self.num, k) and _chunk_search()}
        s2d = _SpaceToDepthConv(self, cd) if _SpaceToDepthConv.eligible(self, cd) else None
        return gemm, chunked, s2d

    def _check_variant_workspace(self, choice, ws, nbytes):
        """The workspace checked out for a cuBLAS or space-to-depth choice
        holds what the choice needs (its memory, as timed)."""
        need = choice.memory
        if need and (not ws or nbytes < need):
            what = 'cuBLAS' if choice.variant == 2 else 'space-to-depth'
            raise CaffeplusError('layer %s: the workspace (%d bytes) is smaller than the %s '
                                 'variant of its %s call needs (%d)'
                                 % (self.layer_param.name, nbytes, what, choice.kind, need))

    def _descs_for(self, choice):
        """The descriptors an algorithm choice runs with (per group or not)."""
        if choice.variant == 1 and self._cd_groups is not None:
            return self._cd_groups
        if choice.variant in self._cd_chunks:
            return self._cd_chunks[choice.variant]
        return self._cd

    def _timed_search(self):
        """FindEx (timed) rather than cuDNN's heuristics for this layer's algorithms."""
        from caffeplus.memory import workspace
        if self.memory_plan == 'stock':
            return False            # Caffe 1.0's choice
        if workspace.search_mode() == 'timed':
            return True
        mode = search_default()
        if mode == 'timed':
            return True
        # auto: training nets, whose shapes stay put, under a net's own arena
        return mode == 'auto' and self.phase == caffe_pb2.TRAIN and \
            self._ws is not None and self._ws is not workspace._default.get(backend.device())

    def _geometry_key(self):
        from caffeplus.backend import mathmode
        g = self.geom
        return (self.reverse, self.num, self.channels, self.num_output, tuple(self.in_spatial),
                tuple(self.out_spatial), tuple(self.blobs[0].shape), tuple(g.kernel),
                tuple(g.pad), tuple(g.stride), tuple(g.dilation), self.group,
                mathmode.generation(), mathmode.deterministic(), backend.device(),
                self.activation_dtype, self.compute_nhwc, self.padded_channels)

    def forward_then_relu(self, bottom, top):
        """Forward, then a ReLU (negative slope 0) in place on the top, with
        the bias add and the ReLU as one pass over the top instead of two
        (the same float operations: y + b, then y if y > 0 else 0). For a
        convolution run again in backward (caffeplus.memory.apply): at
        VGG-16 b256 conv1_1's map is 3.3 GB, 2.4 ms a pass. False (nothing
        run) where this path does not apply: then run the two layers."""
        if self.reverse or len(bottom) != 1 or not self.bias_term or self.compute_nhwc or \
                not self._ready(_kernels.flat(bottom[0]), _kernels.flat(self.blobs[0])):
            return False
        self._ensure_planned(self._manager())
        if self._sites['fwd'].choice.variant in (2, S2D_VARIANT):
            return False                # cuBLAS or space-to-depth: their own bias path
        self._forward_calls(bottom, top, bias=False)
        t = top[0].data
        _bias_relu()(self.blobs[1].data, numpy.int64(t[0, 0].size),
                     numpy.int64(t.shape[1]), t)
        return True

    def time_calls(self, ws_ptr, ws_bytes):
        """{kind: cuDNN's candidates timed with FindEx} for this layer's
        calls, as the timed search weighs them (batch slicings and the
        cuBLAS variant included), in a workspace of `ws_bytes`; without a
        plan (caffeplus.memory.calibration.measure_net: plan auto's search
        weighs measured algorithms)."""
        slices = self._batch_slices()
        cd = _ConvDescs(self, False, slices)
        gemm, chunked, s2d = self._timed_variants(cd, slices)
        return {kind: cd.timer(kind, self._geometry_key(), None, gemm, chunked, s2d)(ws_ptr,
                                                                                   ws_bytes)
                for kind in _workspace().KINDS}

    def _ensure_planned(self, mgr):
        """The manager's plan; with the auto search, FindEx times the sites
        (the arena times only under set_search('timed'))."""
        if getattr(self, '_auto_timed', False) and getattr(mgr, '_dirty', False):
            from caffeplus.memory import workspace
            previous = workspace.set_search('timed')
            try:
                mgr.ensure_planned()
            finally:
                workspace.set_search(previous)
        else:
            mgr.ensure_planned()

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self.activation_dtype = storage_dtype(bottom[0])
        self._dtypes_agree = _same_storage_dtype(bottom, top)
        nhwc_top = top[0].layout == 'NHWC'
        self.compute_nhwc = self.calls_channels_last(bottom[0].layout == 'NHWC', nhwc_top)
        self._bottom_relaid = (bottom[0].layout == 'NHWC') != self.compute_nhwc
        self._top_relaid = self.compute_nhwc and not nhwc_top
        self.padded_channels = self.image_padding(self.compute_nhwc, self._bottom_relaid)
        if self._gpu_mode() and self._cudnn_geometry_ok() and cudnn_available():
            self._build_cudnn()

    def _sixteen_bit(self):
        return self.activation_dtype.itemsize != 4

    def _sixteen_bit_params(self, reuse=False):
        """Device addresses of the 16-bit copies of the weights and bias (0
        without one) that cuDNN reads: refreshed from the FP32 masters, or
        (`reuse`, the backward) the forward's (sixteen_bit_copy)."""
        if self._weight_copies is None:
            self._weight_copies = {}
        dtype = self.activation_dtype
        if self.compute_nhwc:       # cuDNN's channels-last filter order
            w = sixteen_bit_copy(self._weight_copies, NHWC_WEIGHTS, self.blobs[0], dtype, reuse,
                                 channels_last=True, pad_channels=self.padded_channels)
        else:
            w = sixteen_bit_copy(self._weight_copies, 'w', self.blobs[0], dtype, reuse)
        if reuse or not self.bias_term:     # (the backward reads no bias)
            return int(w.data.ptr), 0
        b = sixteen_bit_copy(self._weight_copies, 'b', self.blobs[1], dtype)
        return int(w.data.ptr), int(b.data.ptr)

    def _ready(self, *arrays):
        # (`arrays`: the blobs' storage, kernels.flat: a view of each, made
        # only to ask its type, cost the host ~2 us a blob every call.)
        if not self._cudnn_geometry_ok() or not self._cudnn_usable(*arrays):
            return False
        self._build_cudnn()
        return True

    def workspace_bytes(self):
        """Arena need: the largest workspace of this layer's chosen algorithms."""
        if self._cd is None or not self._sites:
            return super().workspace_bytes()
        self._ensure_planned(self._manager())
        return self.chosen_workspace_bytes()

    def chosen_workspace_bytes(self):
        """workspace_bytes() of the algorithms chosen so far, without
        choosing (a plan made to be applied: the memory plan's own manager
        chooses later; planning now would time the candidates with the
        net's default arena, what the whole GPU spares)."""
        if self._cd is None or not self._sites:
            return super().workspace_bytes()
        return max([s.choice.memory for s in self._sites.values() if s.choice is not None] + [0])

    def stock_workspace_bytes(self):
        """What Caffe 1.0 allocates for this layer: per-group descriptors,
        first _v7 algorithm within 8 MiB per kind, max * group * 3."""
        if self._cd is None:
            return 0
        from caffeplus.memory import workspace
        # (Sliced, too large for one call, Caffe 1.0 could not run it: as sliced.)
        cd = self._cd if self._cd.batch_chunks > 1 or self._cd.loops == self.group \
            else _ConvDescs(self, True)
        choices = [workspace.choose_stock(cd.candidates(k),
                                          what=workspace.call_site_name(self, k))
                   for k in workspace.KINDS]
        return workspace.stock_bytes(choices, self.group)

    def algorithms(self):
        """{kind: chosen AlgoChoice} (for logs and tests)."""
        if self._cd is not None:
            self._ensure_planned(self._manager())
        return {k: s.choice for k, s in self._sites.items()}

    # -- the math -----------------------------------------------------------
    # Each group of cuDNN calls goes through its descriptors' Replays, keyed
    # by every value the calls read: replayed as a CUDA graph from the
    # second iteration on (caffeplus.cudnn.api).
    def _forward(self, bottom, top):
        if not self._ready(_kernels.flat(bottom[0], any_dtype=True), _kernels.flat(self.blobs[0])):
            return super()._forward(bottom, top)
        self._forward_calls(bottom, top)

    def _forward_calls(self, bottom, top, bias=True):
        """The forward's cuDNN (or cuBLAS) calls; `bias` False leaves the
        bias out (forward_then_relu adds it)."""
        mgr = self._manager()
        self._ensure_planned(mgr)
        kind = 'bwd_data' if self.reverse else 'fwd'
        c = self._sites[kind].choice
        cd = self._descs_for(c)
        conv = cd.conv_for(c.math)
        if self._sixteen_bit():
            w, b = self._sixteen_bit_params()
            b = b if bias else 0
        else:
            w = _dptr(self.blobs[0])
            b = _dptr(self.blobs[1]) if self.bias_term and bias else 0
        gemm = self._gemm if c.variant == 2 else None
        s2d = self._s2d if c.variant == S2D_VARIANT else None
        # (space-to-depth and im2row read it as it is)
        own = (s2d is not None or (gemm is not None and gemm.rows)) and self._bottom_relaid
        # The in-place ReLU after it, in the bias pass (fused_chain's
        # _ConvReLUChain, active when nothing looks at the top between them).
        ch = self._chain
        relu = bool(b) and cd.nhwc and _BIAS_NHWC.ok and ch is not None and \
            ch.fwd_active and not ch.relu.masked and not self._top_relaid
        for bb, tt in zip(bottom, top):
            ys = relaid_top(tt, False) if self._top_relaid else None
            x = _dptr(bb) if own else self._bottom_ptr(bb)
            y = _dptr(tt) if ys is None else int(ys.data.ptr)
            if gemm is not None or s2d is not None:
                with mgr.checkout(self, kind) as (ws, nbytes):
                    self._check_variant_workspace(c, ws, nbytes)
                    if gemm is not None:
                        gemm.forward(x, gemm.row_weights(self.blobs[0].data) if gemm.rows
                                     else w, y, ws)
                    else:
                        s2d.forward(x, w, y, ws, nbytes, c, own)
                if b:
                    cd.replays.run(('bias', x, y, b, relu), functools.partial(
                        _bias_add_calls, cd, b, y, relu))
            else:
                with mgr.checkout(self, kind) as (ws, nbytes):
                    cd.replays.run((kind, x, w, y, b, ws, nbytes, c.algo, c.math, c.variant,
                                    relu),
                                   functools.partial(_conv_forward_calls, cd, conv, c.algo,
                                                     self.reverse, x, w, y, b, ws, nbytes, relu))
            if ys is not None:
                top_from_relaid(tt, ys, False)
        if relu and _BIAS_NHWC.ok:
            ch.fwd_done = True          # the ReLU's forward has nothing left to do

    def _backward(self, top, propagate_down, bottom):
        if not self._ready(_kernels.flat(top[0], True, any_dtype=True), _kernels.flat(self.blobs[0])):
            return super()._backward(top, propagate_down, bottom)
        mgr = self._manager()
        self._ensure_planned(mgr)
        wblob = self.blobs[0]
        w = _dptr(wblob)
        dw = _dptr(wblob, True) if self.param_needs_backward(0) else 0
        db = _dptr(self.blobs[1], True) if self.bias_term and self.param_needs_backward(1) else 0
        # A 16-bit layer: cuDNN reads the 16-bit weights and writes the filter
        # gradient 16-bit, as its maps, into a scratch copy (beta 0) that
        # cp_accumulate adds to the FP32 master's (cuDNN has no 16-bit-input,
        # float32-output call); the cuBLAS variant adds its float32 sums to
        # the master's itself. The bias gradient's channel sums read the
        # 16-bit top diff into the FP32 bias gradient.
        fc = self._sites['bwd_filter'].choice
        gemm_filter = fc.variant == 2 and self._gemm is not None
        s2d_filter = fc.variant == S2D_VARIANT and self._s2d is not None
        # (space-to-depth and im2row read it as it is)
        own = (s2d_filter or (gemm_filter and self._gemm.rows)) and self._bottom_relaid
        dw16, beta, dtype = None, 1.0, self.activation_dtype
        bias16 = False          # summed by CuPy, without the channel-sum kernels
        if self._sixteen_bit():
            w, _ = self._sixteen_bit_params(reuse=True)
            if dw and not (gemm_filter or s2d_filter):
                dw16 = backend.device_scratch(
                    'filter gradient', padded_count(wblob, self.padded_channels), dtype)
                dw, beta = int(dw16.data.ptr), 0.0
            if db and not _CHANNEL_SUMS.ok:
                bias16, db = True, 0
        fcd = self._descs_for(fc)
        dkind = 'fwd' if self.reverse else 'bwd_data'
        dc = self._sites[dkind].choice
        dcd = self._descs_for(dc)
        for i, (bb, tt) in enumerate(zip(bottom, top)):
            dys = relaid_top(tt, False, diff=True) if self._top_relaid else None
            dtop = _dptr(tt, True) if dys is None else int(dys.data.ptr)
            if dw and (gemm_filter or s2d_filter):
                x = _dptr(bb) if own else self._bottom_ptr(bb)
                if db:
                    self._cd.replays.run(('bias', dtop, db), functools.partial(
                        _conv_params_calls, self._cd, None, 0, self.reverse, 0, dtop, 0, db, 0, 0,
                        beta, dtype))
                with mgr.checkout(self, 'bwd_filter') as (ws, nbytes):
                    self._check_variant_workspace(fc, ws, nbytes)
                    if gemm_filter:
                        self._gemm.backward_filter(x, dtop, dw, ws)
                    else:
                        self._s2d.backward_filter(x, dtop, dw, ws, nbytes, fc, own)
            elif dw:
                x = self._bottom_ptr(bb)
                with mgr.checkout(self, 'bwd_filter') as (ws, nbytes):
                    fcd.replays.run(('bwd_filter', x, dtop, dw, db, ws, nbytes, fc.algo, fc.math,
                                     fc.variant, beta),
                                    functools.partial(_conv_params_calls, fcd,
                                                      fcd.conv_for(fc.math), fc.algo,
                                                      self.reverse, x, dtop, dw, db, ws, nbytes,
                                                      beta, dtype))
            elif db:
                self._cd.replays.run(('bias', dtop, db), functools.partial(
                    _conv_params_calls, self._cd, None, 0, self.reverse, 0, dtop, 0, db, 0, 0,
                    beta, dtype))
            if dw16 is not None and self.compute_nhwc:
                k, c = wblob.shape[:2]
                rs = wblob.count // (k * c)
                if self.padded_channels:        # (the padding's taps dropped)
                    import cupy
                    dw16 = cupy.ascontiguousarray(
                        dw16.reshape(k, rs, self.padded_channels)[:, :, :c])
                _kernels.accumulate_krsc(dw16, _dptr(wblob, True), k, c, rs, dtype)
            elif dw16 is not None:
                _kernels.accumulate(dw16, _dptr(wblob, True), wblob.count, dtype)
            if bias16:
                g = tt.diff if dys is None else dys
                c = tt.shape[1]
                sums = g.reshape(-1, c).sum(axis=0, dtype=numpy.float32) if self.compute_nhwc \
                    else g.reshape(g.shape[0], c, -1).sum(axis=2, dtype=numpy.float32).sum(axis=0)
                self.blobs[1].diff += sums
            if propagate_down[i] and dc.variant == 2 and self._gemm is not None:
                self._gemm.backward_data(dtop, w, _dptr(bb, True))
            elif propagate_down[i]:
                scratch_dx = self._relaid_scratch(bb, True) if self._bottom_relaid else None
                dx = int(scratch_dx.data.ptr) if scratch_dx is not None else _dptr(bb, True)
                with mgr.checkout(self, dkind) as (ws, nbytes):
                    dcd.replays.run((dkind, dtop, w, dx, ws, nbytes, dc.algo, dc.math,
                                     dc.variant),
                                    functools.partial(_conv_data_calls, dcd,
                                                      dcd.conv_for(dc.math), dc.algo,
                                                      self.reverse, dtop, w, dx, ws, nbytes))
                if scratch_dx is not None:      # into the bottom's own layout
                    self._relaid(bb, True, into=scratch_dx)

@register_engine('CUDNN')
class CuDNNConvolutionLayer(_CudnnConvolutionMixin, ConvolutionLayer):
    """Convolution through cuDNN (groups by cudnnSetConvolutionGroupCount,
    dilation, 1-3 spatial axes through Nd descriptors)."""


@register_engine('CUDNN')
class CuDNNDeconvolutionLayer(_CudnnConvolutionMixin, DeconvolutionLayer):
    """Deconvolution through cuDNN: forward is backward-data, backward is
    forward and backward-filter."""
