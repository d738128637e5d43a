"""Fused CUDA kernels for the layers that dominate deep nets on the GPU:
BatchNorm, Scale, ReLU, Eltwise SUM and Split, and the BatchNorm -> Scale
-> ReLU chain of residual nets as one forward and one backward kernel.

Written as the generic layers compute, with stock Caffe's semantics, one
launch per layer and direction instead of the ten to twenty CuPy operations
(and their Python) of the generic code:

  cp_bn_fwd     one block per channel: the channel's mean and variance (one
                pass, shifted sums in double), Caffe's three statistics
                blobs updated (moving average, m/(m-1) variance correction,
                scale factor), then y = (x - mean) / std and the layer's copy
                of it; optionally y = relu(y * scale + bias) (the chain).
  cp_bn_bwd     one block per channel: sum(dy) and sum(dy * y_norm), then
                dx; with the chain, ReLU's mask and Scale's parameter
                gradients in the same two passes.
  cp_scale_fwd  y = x * s (+ b), keeping the bottom when in place.
  cp_scale_bwd  one block per channel: Scale's parameter gradients, dx = dy * s.
  cp_relu_fwd / cp_relu_bwd, cp_axpby (Eltwise SUM forward, Split backward),
  cp_scale2 (Eltwise SUM backward), cp_sum_scale2 (Split, then Eltwise SUM, backward).

Rounding follows the CPU layers: products and sums are written with
__fmul_rn / __fadd_rn where the CPU code rounds each step (no FMA
contraction), divisions are IEEE; reductions run in double, so they are at
least as accurate as NumPy's float32 pairwise sums.

Pointers reach the kernels as CuPy arrays (each storage's flat array, no
views are made per call); sizes as unsigned 32-bit ints: the layers use
these kernels only for blobs of fewer than 2**31 values.

The same source compiles on the host for tests (dev/kernel_emu.py runs
it with one thread per CUDA thread), so the layers' GPU code paths can be
checked against the CPU layers on a machine without a GPU.
"""
import collections
import contextlib
import re

import numpy

from caffeplus import backend as _backend
from caffeplus.blob import HEAD_DEVICE as _HEAD_DEVICE
from caffeplus.kernel_sources import COMMON, CORE, CUDA_SIXTEEN_BIT_TYPES
from caffeplus.kernel_sources_extra import EXTRA
from caffeplus.kernel_sources_nhwc import CHANNELS_LAST_BATCHNORM

# The modules compiled on the device (one failing to build leaves the other);
# the emulator builds them together.
# 'core16'/'extra16' and 'corebf16'/'extrabf16': the kernels again with
# __half or __nv_bfloat16 maps (CP_A), for the maps of FLOAT16 and BFLOAT16
# nets; MAP_KERNELS take them (their other pointers stay float32).
SIXTEEN_BIT_BUILDS = {'float16': '16', 'bfloat16': 'bf16'}     # dtype name -> module suffix
SOURCES = {'core': COMMON + CORE, 'extra': COMMON + EXTRA,
           'nhwc': COMMON + EXTRA + CHANNELS_LAST_BATCHNORM}
for _name, _suffix in SIXTEEN_BIT_BUILDS.items():
    _type, _header = CUDA_SIXTEEN_BIT_TYPES[_name]
    _head = '#include <%s>\n#define CP_A %s\n' % (_header, _type)
    SOURCES['core' + _suffix] = _head + COMMON + CORE
    SOURCES['extra' + _suffix] = _head + COMMON + EXTRA
    SOURCES['nhwc' + _suffix] = _head + COMMON + EXTRA + CHANNELS_LAST_BATCHNORM
MAP_KERNELS = frozenset(('cp_bn_fwd', 'cp_bn_bwd', 'cp_relu_fwd', 'cp_relu_bwd', 'cp_axpby',
                         'cp_scale2', 'cp_sum_scale2', 'cp_bn_stats_part', 'cp_bn_fwd_apply',
                         'cp_bn_bwd_part', 'cp_bn_bwd_apply', 'cp_pool_fwd', 'cp_pool_bwd',
                         'cp_softmax_loss_rows', 'cp_softmax_loss_bwd', 'cp_channel_sum_part',
                         'cp_accumulate', 'cp_cast_many', 'cp_cast_many_krsc', 'cp_mpool_fwd',
                         'cp_mpool_bwd', 'cp_mpool_bwd_tiled', 'cp_relu_bits_fwd',
                         'cp_relu_bits_bwd', 'cp_scale_fwd', 'cp_scale_bwd', 'cp_lrn_fwd',
                         'cp_lrn_bwd', 'cp_im2col', 'cp_im2row', 'cp_channel_sum_part_nhwc',
                         'cp_accumulate_krsc', 'cp_mpool_fwd_nhwc', 'cp_mpool_bwd_nhwc',
                         'cp_mpool_bwd_tiled_nhwc', 'cp_bn_stats_part_nhwc', 'cp_bn_apply_nhwc',
                         'cp_bn_bwd_part_nhwc', 'cp_bn_dx_nhwc', 'cp_bn_stats_part_nhwc_vec',
                         'cp_bn_apply_nhwc_vec', 'cp_bn_apply_add_nhwc_vec',
                         'cp_bn_bwd_part_nhwc_vec', 'cp_bn_dx_nhwc_vec', 'cp_bias_nhwc',
                         'cp_dropout_fwd', 'cp_dropout_bwd', 'cp_lrn_fwd_nhwc',
                         'cp_lrn_bwd_nhwc', 'cp_space_to_depth', 'cp_s2d_filter',
                         'cp_s2d_filter_grad'))
SOURCE = COMMON + CORE + EXTRA + CHANNELS_LAST_BATCHNORM

# Flags of cp_bn_fwd / cp_bn_bwd.
BN_BATCH, BN_KEEP, BN_SCALE, BN_BIAS, BN_RELU = 1, 2, 4, 8, 16
BN_DSCALE, BN_DBIAS, BN_DX = 32, 64, 128
# Flags of cp_scale_fwd / cp_scale_bwd.
SC_KEEP, SC_BIAS = 1, 2
SC_DSCALE, SC_DSCALE_ACC, SC_DBIAS, SC_DX = 1, 2, 4, 8

_SIG = re.compile(r'extern "C" __global__ void (\w+)\(')
MAX_COUNT = 2 ** 31 - 1     # the kernels index with unsigned 32-bit ints
ELEMENTWISE_THREADS = 256
MAX_BLOCKS = 132 * 32       # grid-stride loops: enough blocks to fill the device

u32 = numpy.uint32
i32 = numpy.int32
f32 = numpy.float32

# Whether the GPU layers use these kernels at first (set_enabled changes it).
ENABLED = True
_state = {'module': None, 'kernels': {}, 'enabled': ENABLED,
          'emulator': None, 'failures': [], 'ndarray': None, 'planner': None, 'broken': None,
          'forward_passes': 0, 'pass_hooks': [], 'held_tables': None}


# -- switches -------------------------------------------------------------------
def enabled():
    """Whether the GPU layers use these kernels (set_enabled(False) turns them off)."""
    return _state['enabled']


def set_enabled(on):
    previous = _state['enabled']
    _state['enabled'] = bool(on)
    return previous


def failures():
    """(kernel or layer, message) for every fused path that failed and fell back."""
    return list(_state['failures'])


def note_failure(what, exc):
    from caffeplus import log
    _state['failures'].append((what, '%s: %s' % (type(exc).__name__, exc)))
    if len(_state['failures']) <= 5:
        log.warning('fused GPU kernel path of %s failed (%s: %s); the generic code runs',
                    what, type(exc).__name__, exc)


def set_emulator(emu):
    """Tests: run the kernels on the host (dev/kernel_emu.py) with NumPy
    arrays standing in for device arrays. None: back to CuPy."""
    previous = _state['emulator']
    _state['emulator'] = emu
    _state['ndarray'] = None
    return previous


def emulating():
    return _state['emulator'] is not None


# -- arrays ---------------------------------------------------------------------
class _NoArray:
    """Stands for the device array type where CuPy is missing."""


def _ndarray_type():
    t = _state['ndarray']
    if t is None:
        if _state['emulator'] is not None:
            t = numpy.ndarray
        else:
            try:
                import cupy
                t = cupy.ndarray
            except ImportError:
                t = _NoArray
        _state['ndarray'] = t
    return t


def active():
    """Whether layers should take their fused paths now: enabled, and in GPU
    mode (or emulating)."""
    if not _state['enabled']:
        return False
    if _state['emulator'] is not None:
        return True
    return _backend.mode() == _backend.GPU      # (asked ~180 times an iteration)


def is_device(array):
    """Whether `array` is one the kernels take (CuPy, or NumPy when emulating)."""
    return type(array) is _ndarray_type()


_F32 = numpy.dtype(numpy.float32)


def flat(blob, diff=False, any_dtype=False):
    """The blob's storage array (flat, at least blob.count values) on the
    device, without making views; through the Blob's own accessor (which
    allocates, copies a newer host mirror over, refuses released memory)
    when it is not plainly there. None if the storage is not a device array,
    or (unless `any_dtype`: cuDNN's calls, whose descriptors carry the type)
    not float32: the kernels here read float32, so a 16-bit blob takes its
    layer's other path."""
    st = blob._diff if diff else blob._data
    a = st.array
    nd = _ndarray_type()
    if type(a) is nd and st.head is _HEAD_DEVICE and st.released_reason is None and \
            a.size >= blob._count:
        return a if any_dtype or a.dtype == _F32 else None
    blob.diff if diff else blob.data        # noqa: B018 -- Storage.ensure()
    a = st.array
    return a if type(a) is nd and (any_dtype or a.dtype == _F32) else None


def array_module():
    """The module of the kernels' arrays: CuPy, or NumPy when emulating."""
    if _state['emulator'] is not None:
        return numpy
    import cupy
    return cupy


def empty(count, dtype=numpy.float32):
    """A scratch array of `count` values (float32, or `dtype`) on the device."""
    if _state['emulator'] is not None:
        return numpy.empty(max(int(count), 1), dtype=dtype)
    import cupy
    return cupy.empty(max(int(count), 1), dtype=dtype)


_EMULATED_SCRATCH = {}


def scratch(slot, count, dtype):
    """`count` values of `dtype` from one buffer per slot (grown to the largest
    asked for; caffeplus.backend.device_scratch), for kernels of different
    layers that take turns with it on one stream: a buffer each would hold
    bytes every layer needs only for the moment of its own call."""
    if _state['emulator'] is None:
        from caffeplus import backend
        return backend.device_scratch(slot, count, dtype)
    key = (slot, numpy.dtype(dtype))
    buf = _EMULATED_SCRATCH.get(key)
    if buf is None or buf.size < count:
        buf = _EMULATED_SCRATCH[key] = numpy.empty(max(int(count), 1), dtype=dtype)
    return buf[:count]


# -- compiling and launching ------------------------------------------------------
# NVRTC compiles in JIT mode, where a function without an execution space is
# host code and refused; the channel loops' lambdas have none (NVRTC 13 asks
# for it), and every function of these sources runs on the device.
COMPILE_OPTIONS = ('--std=c++14', '-default-device')


def compile_units():
    """(label, CUDA source, NVRTC options) of each module this file builds:
    tests/test_kernel_compile.py compiles them all without a GPU."""
    return [('kernels.' + group, source, COMPILE_OPTIONS) for group, source in SOURCES.items()]


def _module(group):
    m = _state['module'].get(group) if _state['module'] else None
    if m is None:
        broken = (_state['broken'] or {}).get(group)
        if broken is not None:
            raise broken
        import cupy
        source = SOURCES[group]
        try:
            m = cupy.RawModule(code=source, options=COMPILE_OPTIONS)
            m.get_function(_SIG.search(source, source.index(COMMON) + len(COMMON)).group(1))
        except Exception as exc:
            # A module that does not build: its fused paths fall back for good
            # (all of them if it is the core one).
            _state['broken'] = dict(_state['broken'] or {}, **{group: exc})
            if group == 'core':
                _state['enabled'] = False       # (core16: the 16-bit maps' generic code runs)
            raise
        _state['module'] = dict(_state['module'] or {}, **{group: m})
    return m


def _group(name):
    if ('void %s(' % name) in CORE:
        return 'core'
    return 'nhwc' if ('void %s(' % name) in CHANNELS_LAST_BATCHNORM else 'extra'


_BUILD_OF = {}


def _build_of(dtype):
    """The 16-bit build's suffix for maps of `dtype` (a dtype or a type),
    None for float32. Cached: a dtype's name is a Python property of a few
    microseconds, and a ResNet-50 iteration asks for hundreds of kernels."""
    try:
        return _BUILD_OF[dtype]
    except KeyError:
        build = _BUILD_OF[dtype] = SIXTEEN_BIT_BUILDS.get(numpy.dtype(dtype).name)
        return build


def kernel(name, dtype=None):
    """The compiled kernel `name` (each module is compiled once per process;
    CuPy caches the binary on disk); with `dtype` float16 or bfloat16, its
    build for those maps (MAP_KERNELS only)."""
    build = None if dtype is None else _build_of(dtype)
    key = (name, build) if build else name
    k = _state['kernels'].get(key)
    if k is None:
        emu = _state['emulator']
        if build:
            if emu is not None or name not in MAP_KERNELS:
                raise TypeError('no 16-bit build of kernel %s here' % name)
            k = _module(_group(name) + build).get_function(name)
        else:
            k = emu.kernel(name) if emu is not None else _module(_group(name)).get_function(name)
        _state['kernels'][key] = k
    return k


def maps(*blob_diffs):
    """The device arrays of (blob, diff) pairs for a MAP_KERNELS launch and
    their type: all float32, or all float16 or all bfloat16 on the device;
    (None, None) otherwise (the caller runs its other code)."""
    arrays = [flat(b, d, any_dtype=True) for b, d in blob_diffs]
    if any(a is None for a in arrays):
        return None, None
    dtype = arrays[0].dtype
    if any(a.dtype != dtype for a in arrays) or (
            dtype != _F32 and (_build_of(dtype) is None or emulating())):
        return None, None
    return arrays, dtype


def reset_kernels():
    _state['kernels'] = {}
    _state['module'] = None
    _state['broken'] = None


# -- the net's passes (fused chains of layers) ------------------------------------
def set_chain_planner(fn):
    """fn(net, start, end, backward), called by begin_pass (layers/fused_chain.py)."""
    _state['planner'] = fn


def set_chain_heads(fn):
    """fn(net) -> {layer index: index of the chain member whose backward runs
    the whole chain's} (layers/fused_chain.py)."""
    _state['heads'] = fn


def chain_heads(net):
    """{layer index: the layer whose backward step runs its backward} for
    the layers of fused chains (empty when the fused kernels are off): a
    chain's backward writes its members' bottom diffs at its head's step,
    earlier than their own, which the memory planner must know."""
    fn = _state.get('heads')
    if fn is None or not active():
        return {}
    return fn(net)


def add_pass_hook(fn):
    """fn(net, start, end, backward), called by begin_pass after the chain
    planner (layers/cudnn_common.py: the 16-bit weight copies)."""
    if fn not in _state['pass_hooks']:
        _state['pass_hooks'].append(fn)


def begin_pass(net, start, end, backward=False):
    """Called by Net.forward_from_to / backward_from_to before their layers
    run: lets chains of layers (BatchNorm -> Scale -> ReLU in place) know
    whether this pass runs them whole, so they may run as one kernel, and
    the pass hooks prepare what the layers read."""
    if not backward:
        _state['forward_passes'] += 1
    planner = _state['planner']
    if planner is not None:
        planner(net, start, end, backward)
    for fn in _state['pass_hooks']:
        fn(net, start, end, backward)


def forward_passes():
    """How many forward passes nets have begun: a backward reuses what its
    layers made in the forward before it while this stays the same (the
    16-bit weight copies, layers/cudnn_common.sixteen_bit_copy)."""
    return _state['forward_passes']


UNROLL = 4                  # CP_U: values per thread per loop step


def elementwise_grid(n):
    per_block = ELEMENTWISE_THREADS * UNROLL
    return (max(1, min((int(n) + per_block - 1) // per_block, MAX_BLOCKS)),)


# BatchNorm with fewer channels than SPLIT_CHANNELS (two blocks per SM of an
# H100) splits each channel over several blocks, each with at least
# SPLIT_MIN_VALUES values (cp_bn_stats_part / cp_bn_fwd_apply ...).
SPLIT_CHANNELS = 264
SPLIT_MIN_VALUES = 8192


def blocks_per_channel(c, m):
    if c >= SPLIT_CHANNELS or m < 2 * SPLIT_MIN_VALUES:
        return 1
    return max(1, min(SPLIT_CHANNELS // c, m // SPLIT_MIN_VALUES))


# Blocks of cp_channel_sum_part: about two per SM in all, each at least
# SUM_MIN_VALUES values of its channel.
SUM_BLOCKS = 264
SUM_MIN_VALUES = 4096
SUM_THREADS = 256


def sum_blocks_per_channel(c, m):
    """P of cp_channel_sum_part for c channels of m values each."""
    return int(max(1, min(-(-SUM_BLOCKS // max(c, 1)), m // SUM_MIN_VALUES)))


def _arg(a):
    return numpy.uint64(a) if isinstance(a, int) else a


def channel_sums(dy, part, db, n, c, s, p, dtype=None):
    """db[:c] += dy (n, c, s) summed over n and s (float32; double partials
    in `part`, at least c * p of them); dy of `dtype` (float32 unless given).
    dy, part, db: device arrays, or device addresses (ints)."""
    kernel('cp_channel_sum_part', dtype)((c * p,), (SUM_THREADS,),
                                         (_arg(dy), _arg(part), u32(n), u32(c), u32(s), u32(p)))
    kernel('cp_channel_sum_apply')(((c + 127) // 128,), (128,),
                                   (_arg(part), _arg(db), u32(c), u32(p)))


# cp_channel_sum_part_nhwc's blocks: each thread adds about NHWC_SUM_ROWS
# rows (enough blocks to fill the device for 7 x 7 maps), at most
# NHWC_SUM_BLOCKS blocks and NHWC_SUM_PARTIALS partials in all (the shared
# scratch they are written to; the estimate counts it).
NHWC_SUM_ROWS = 16
NHWC_SUM_BLOCKS = 4096
NHWC_SUM_PARTIALS = 2 ** 19
NHWC_SUM_SLOT = 'convolution bias partial sums'


def nhwc_sum_blocks(m, c):
    """P of cp_channel_sum_part_nhwc for m rows of c channels (SUM_THREADS
    threads a block, R = SUM_THREADS // min(c, SUM_THREADS) of them a row)."""
    rows = SUM_THREADS // max(1, min(c, SUM_THREADS))
    return int(max(1, min(NHWC_SUM_BLOCKS, m // (NHWC_SUM_ROWS * rows),
                          NHWC_SUM_PARTIALS // max(c, 1))))


def nhwc_sum_scratch_bytes(m, c):
    """Bytes of the double partials channel_sums_nhwc writes into NHWC_SUM_SLOT."""
    return 8 * c * nhwc_sum_blocks(m, c)


APPLY_WARPS = 32        # cp_channel_sum_apply_rows's warps a block (at most 32)


def channel_sums_nhwc(dy, db, m, c, dtype=None):
    """db[:c] += dy (m rows of c, channels-last maps) summed over the rows
    (float32; double partials in the shared scratch NHWC_SUM_SLOT)."""
    p = nhwc_sum_blocks(m, c)
    part = scratch(NHWC_SUM_SLOT, c * p, numpy.float64)
    kernel('cp_channel_sum_part_nhwc', dtype)((p,), (SUM_THREADS,),
                                              (_arg(dy), part, u32(m), u32(c), u32(p)))
    kernel('cp_channel_sum_apply_rows')(((c + 31) // 32,), (32 * APPLY_WARPS,),
                                        (part, _arg(db), u32(c), u32(p)))


def channels_grid(count, c, dtype=None):
    """The grid of a channels-last kernel over `count` values of c channels
    whose threads take 16 bytes of channels where that divides c (a value a
    thread otherwise, and where the maps are misaligned, striding)."""
    width = 16 // numpy.dtype(dtype or numpy.float32).itemsize
    return elementwise_grid(count // width if c % width == 0 else count)


def bias_nhwc(y, b, m, c, dtype=None, relu=False):
    """y (m rows of c, channels-last maps) += b[channel] in place; b of the
    maps' type. `relu`: then max(y, 0), the in-place ReLU after it."""
    kernel('cp_bias_nhwc', dtype)(channels_grid(m * c, c, dtype), (ELEMENTWISE_THREADS,),
                                  (_arg(y), _arg(b), numpy.uint64(m), u32(c), u32(bool(relu))))


TRANSPOSE_THREADS = 256     # cp_transpose2/4: a 32 x 32 tile, 8 rows of threads
NARROW_ROWS = 8             # dst rows up to this many values: cp_transpose_narrow2/4


def transpose(src, dst, n, a, b, lds=None, ldd=None, pad=False):
    """dst[i][j][k] = src[i][k][j] for i < n, k < a, j < b: src n blocks of a
    rows lds values apart (b by default), dst n blocks of b rows ldd apart
    (a by default), both flat arrays of 2- or 4-byte values (moved as bits);
    `pad`: dst's values past a in each row (up to ldd) written 0."""
    lds, ldd = lds or b, ldd or a
    size = numpy.dtype(src.dtype).itemsize
    if size not in (2, 4) or numpy.dtype(dst.dtype).itemsize != size:
        raise TypeError('transpose moves 2- or 4-byte values, not %s into %s'
                        % (src.dtype, dst.dtype))
    cols = ldd if pad else a
    if ldd <= NARROW_ROWS:
        total = n * b
        if total:
            kernel('cp_transpose_narrow%d' % size)(elementwise_grid(total), (ELEMENTWISE_THREADS,), (
                src, dst, u32(a), u32(b), u32(lds), u32(ldd), u32(bool(pad)), numpy.uint64(total)))
        return
    blocks = n * (-(-cols // 32)) * (-(-b // 32))
    if blocks:
        kernel('cp_transpose%d' % size)((blocks,), (TRANSPOSE_THREADS,), (
            src, dst, u32(a), u32(b), u32(lds), u32(ldd), u32(bool(pad))))


COPY_ROWS_BYTES = 2 ** 32 - 1      # cp_copy_rows counts in 32 bits


def copy_rows(src, src_off, src_pitch, dst, dst_off, dst_pitch, width, rows):
    """`rows` rows of `width` bytes from the array src, `src_off` bytes in
    (rows `src_pitch` bytes apart), to dst from `dst_off` (`dst_pitch` apart);
    in launches of at most COPY_ROWS_BYTES bytes."""
    if not (rows and width):
        return
    per_launch = max(1, COPY_ROWS_BYTES // width)
    for r in range(0, rows, per_launch):
        n = min(per_launch, rows - r)
        kernel('cp_copy_rows')(elementwise_grid(n * width // 16 or 1), (ELEMENTWISE_THREADS,), (
            src, numpy.uint64(src_off + r * src_pitch), numpy.uint64(src_pitch), dst,
            numpy.uint64(dst_off + r * dst_pitch), numpy.uint64(dst_pitch), numpy.uint64(width),
            u32(n)))


def accumulate_krsc(g, acc, k, c, rs, dtype=None):
    """acc (k, c, rs) += g (k, rs, c) in float32 (a channels-last filter gradient)."""
    kernel('cp_accumulate_krsc', dtype)(elementwise_grid(k * c * rs), (ELEMENTWISE_THREADS,),
                                        (_arg(g), _arg(acc), u32(k), u32(c), u32(rs)))


def accumulate(g, acc, n, dtype=None):
    """acc[:n] += g[:n] in float32, g of `dtype` (float32 unless given);
    device arrays or addresses."""
    kernel('cp_accumulate', dtype)(elementwise_grid(n), (ELEMENTWISE_THREADS,),
                                   (_arg(g), _arg(acc), u32(n)))


def channel_block(m):
    """Threads per block of the one-block-per-channel kernels for `m` values a channel."""
    if m >= 65536:
        return 1024
    if m >= 8192:
        return 512
    if m >= 1024:
        return 256
    return 64


# -- zeroing many arrays (parameter diffs) ----------------------------------------
def zero_diffs(blobs, also=()):
    """diff[...] = 0 for every blob, and every array of `also` (contiguous,
    a whole number of 32-bit words: a guard, flags), in one kernel launch
    (zero_many). Returns False (and does nothing) if a diff is not a device
    array, so the caller can take the generic path."""
    arrays = []
    for b in blobs:
        a = flat(b, diff=True)
        if a is None:
            return False
        if b._count:
            arrays.append((_address(a), b._count * a.itemsize // 4))
    for a in also:
        arrays.append((_address(a), a.nbytes // 4))
    zero_many(arrays)
    return True


def _address(a):
    return a.ctypes.data if isinstance(a, numpy.ndarray) else a.data.ptr


_TABLES = collections.OrderedDict()     # key -> device tables, the latest few
# (A ResNet-50 pass zeroes the gradients of each update-in-backward group
# with a table of its own.)
MAX_TABLES = 64


@contextlib.contextmanager
def holding_tables():
    """Yields a list that collects every device table the launches inside
    use: a CUDA graph captured meanwhile reads them on each replay, so its
    owner keeps them (the cache may drop them, and their memory go to
    other arrays)."""
    held, _state['held_tables'] = _state['held_tables'], []
    try:
        yield _state['held_tables']
    finally:
        _state['held_tables'] = held


def _tables(kind, pointer_lists, sizes):
    """(one device table per list of addresses, offsets, n, total) for the
    multi-array kernels: kept on the device until an address or size
    changes (a re-layout, a reshape)."""
    xp = array_module()
    key = (kind, xp.__name__, tuple(map(tuple, pointer_lists)), tuple(sizes))
    tables = _TABLES.get(key)
    if tables is None:
        offsets = numpy.zeros(len(sizes) + 1, dtype=numpy.int64)
        numpy.cumsum(sizes, out=offsets[1:])
        tables = _TABLES[key] = tuple(
            xp.asarray(numpy.array(ptrs, dtype=numpy.uint64)) for ptrs in pointer_lists) + (
            xp.asarray(offsets), i32(len(sizes)), numpy.int64(offsets[-1]))
        while len(_TABLES) > MAX_TABLES:
            _TABLES.popitem(last=False)
    else:
        _TABLES.move_to_end(key)
    if _state['held_tables'] is not None:
        _state['held_tables'].append(tables)
    return tables


def _many_grid(total):
    return (max(min((int(total) + ELEMENTWISE_THREADS - 1) // ELEMENTWISE_THREADS,
                    MAX_BLOCKS), 1),)


def zero_many(arrays):
    """Zero the 32-bit words of every (device address, words) of `arrays`
    in one launch of cp_zero_many."""
    arrays = [(p, w) for p, w in arrays if w]
    if not arrays:
        return
    tables = _tables('zero', [[p for p, _ in arrays]], [w for _, w in arrays])
    kernel('cp_zero_many')(_many_grid(tables[-1]), (ELEMENTWISE_THREADS,), tables)


def cast_many(arrays, dtype):
    """dst = src rounded to `dtype` (float16, bfloat16) for every (src address of
    float32 values, dst address, count) of `arrays`, in one launch of
    cp_cast_many."""
    arrays = [a for a in arrays if a[2]]
    if not arrays:
        return
    tables = _tables('cast', [[a[0] for a in arrays], [a[1] for a in arrays]],
                     [a[2] for a in arrays])
    kernel('cp_cast_many', dtype)(_many_grid(tables[-1]), (ELEMENTWISE_THREADS,), tables)


KRSC_LIMITS = (1 << 24, 1 << 20, 1 << 20)    # C, kh kw, P in cp_cast_many_krsc's packing


def cast_many_krsc(arrays, dtype):
    """cast_many into cuDNN's channels-last filter order, for every (src
    address of (K, C, kh, kw) float32 values, dst address of (K, kh, kw, P)
    values, dst count, C, kh kw, P) of `arrays` (P >= C, the channels past C
    zeroed), in one launch of cp_cast_many_krsc. C below 2**24, P and kh kw
    below 2**20 (KRSC_LIMITS)."""
    arrays = [a for a in arrays if a[2]]
    if not arrays:
        return
    tables = _tables('cast_krsc', [[a[0] for a in arrays], [a[1] for a in arrays],
                                   [(a[3] << 40) | (a[5] << 20) | a[4] for a in arrays]],
                     [a[2] for a in arrays])
    kernel('cp_cast_many_krsc', dtype)(_many_grid(tables[-1]), (ELEMENTWISE_THREADS,), tables)
