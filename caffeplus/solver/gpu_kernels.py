"""The solvers' update on the GPU: one kernel for all parameters.

On the CPU each rule is a handful of in-place NumPy operations per
parameter. On the GPU that would be several kernel launches per parameter
(hundreds per iteration for a deep net, each costing more in Python than
the arithmetic). Here one CUDA kernel walks every learnable parameter: for
each element it normalizes the gradient (1/iter_size), adds the weight decay
(L2, or L1 through sign(w)), applies the solver's rule (the formulas of
caffeplus.solver.sgd, in float32), leaves the update value in the diff as
Caffe does, and subtracts it from the data (Caffe's Net::Update).

The kernel reads the parameters through tables of device pointers that are
rebuilt whenever a parameter's storage changes (MultiTensorUpdate.prepare).
"""
import numpy

from caffeplus.kernel_sources import ARRAY_LOOKUP

KINDS = {'SGD': 0, 'Nesterov': 1, 'AdaGrad': 2, 'RMSProp': 3, 'AdaDelta': 4, 'Adam': 5}

# Which parameter element `idx` of the concatenated parameters falls in
# (offsets: each parameter's first element, then the total) is found by the
# fused kernels' lookups, ARRAY_LOOKUP (caffeplus.kernel_sources).
_SOURCE = ARRAY_LOOKUP + r'''
extern "C" __global__ void caffeplus_solver_update(
    const unsigned long long* w_ptr, const unsigned long long* g_ptr,
    const unsigned long long* h_ptr, const unsigned long long* h2_ptr,
    const long long* offsets, const float* lr_mult, const float* decay_mult,
    const int n_params, const long long total, const int kind,
    const float rate, const float norm, const float weight_decay, const int l1,
    const float a, const float b, const float c, const float d, const double* guard)
{
    /* An update in backward under the NaN check: none once a gradient so far
       was not finite (caffeplus.solver.update_in_backward). */
    if (!isfinite(*guard)) return;
    const long long stride = (long long)gridDim.x * blockDim.x;
    int lo = 0;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += stride) {
        lo = cp_array_next(offsets, n_params, idx, lo);
        const long long j = idx - offsets[lo];
        float* w = reinterpret_cast<float*>(w_ptr[lo]) + j;
        float* g = reinterpret_cast<float*>(g_ptr[lo]) + j;
        float* h = reinterpret_cast<float*>(h_ptr[lo]) + j;
        float* h2 = reinterpret_cast<float*>(h2_ptr[lo]) + j;
        const float lr = rate * lr_mult[lo];
        const float decay = weight_decay * decay_mult[lo];
        const float wv = *w;
        float gg = *g * norm;
        if (decay != 0.0f) {
            gg += decay * (l1 ? (float)((wv > 0.0f) - (wv < 0.0f)) : wv);
        }
        float hv = *h;
        float upd = 0.0f;
        switch (kind) {
        case 0:  /* SGD: a = momentum */
            hv = a * hv + lr * gg;
            upd = hv;
            break;
        case 1: {  /* Nesterov: a = momentum */
            const float old = hv;
            hv = a * hv + lr * gg;
            upd = (1.0f + a) * hv - a * old;
            break;
        }
        case 2:  /* AdaGrad: a = delta */
            hv += gg * gg;
            upd = lr * (gg / (sqrtf(hv) + a));
            break;
        case 3:  /* RMSProp: a = delta, b = rms_decay */
            hv = b * hv + (1.0f - b) * (gg * gg);
            upd = lr * (gg / (sqrtf(hv) + a));
            break;
        case 4: {  /* AdaDelta: a = delta, b = momentum */
            float h2v = *h2;
            hv = b * hv + (1.0f - b) * (gg * gg);
            const float u = gg * sqrtf((h2v + a) / (hv + a));
            h2v = b * h2v + (1.0f - b) * (u * u);
            *h2 = h2v;
            upd = lr * u;
            break;
        }
        case 5: {  /* Adam: a = delta, b = beta1, c = beta2, d = bias correction */
            float v = *h2;
            hv = b * hv + (1.0f - b) * gg;
            v = c * v + (1.0f - c) * (gg * gg);
            *h2 = v;
            upd = (lr * d) * (hv / (sqrtf(v) + a));
            break;
        }
        }
        *h = hv;
        *g = upd;
        *w = wv - upd;
    }
}
'''

# The NaN check of an update in backward: one pass over a group's gradients;
# a value that is not finite sets the guard to NaN (the update kernel then
# skips, for this group and every later one) and the group's flag.
_CHECK_SOURCE = r'''
extern "C" __global__ void caffeplus_gradient_check(
    const unsigned long long* g_ptr, const long long* offsets, const int n_params,
    const long long total, double* guard, int* flag)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    int lo = 0;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += stride) {
        lo = cp_array_next(offsets, n_params, idx, lo);
        const float g = reinterpret_cast<const float*>(g_ptr[lo])[idx - offsets[lo]];
        if (!isfinite(g)) {
            *guard = __longlong_as_double(0x7ff8000000000000LL);
            *flag = 1;
            return;
        }
    }
}
'''

# Loss scaling's step (caffeplus.precision.LossScaler): every gradient divided
# by the loss scale in one pass. A result that is not finite (an overflow the
# adaptive scale answers by skipping the step) sets the guard to +inf, which
# the update kernel skips on and the NaN check tells from its own NaN; with
# `zero_bad` the value is stored as 0, so the NaN check sees only finite
# gradients (the scale, not the net, is at fault).
_UNSCALE_SOURCE = r'''
extern "C" __global__ void caffeplus_gradient_unscale(
    const unsigned long long* g_ptr, const long long* offsets, const int n_params,
    const long long total, const float scale, const int zero_bad, double* guard)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    int lo = 0;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += stride) {
        lo = cp_array_next(offsets, n_params, idx, lo);
        float* g = reinterpret_cast<float*>(g_ptr[lo]) + (idx - offsets[lo]);
        float v = *g / scale;
        if (!isfinite(v)) {
            *guard = __longlong_as_double(0x7ff0000000000000LL);
            if (zero_bad) v = 0.0f;
        }
        *g = v;
    }
}
'''

# name -> source of each kernel here (built with CuPy's default options).
_SOURCES = {'caffeplus_solver_update': _SOURCE,
            'caffeplus_gradient_check': ARRAY_LOOKUP + _CHECK_SOURCE,
            'caffeplus_gradient_unscale': ARRAY_LOOKUP + _UNSCALE_SOURCE}
_kernel = {}


def compile_units():
    """(label, CUDA source, NVRTC options) of each kernel here, for
    tests/test_kernel_compile.py."""
    return [('solver.' + name, source, ()) for name, source in _SOURCES.items()]


def _raw_kernel(name):
    """CUDA kernel `name`, compiled once per process."""
    k = _kernel.get(name)
    if k is None:
        import cupy
        k = _kernel[name] = cupy.RawKernel(_SOURCES[name], name)
    return k


def _get_kernel():
    return _raw_kernel('caffeplus_solver_update')


def _get_check_kernel():
    return _raw_kernel('caffeplus_gradient_check')


def _get_unscale_kernel():
    return _raw_kernel('caffeplus_gradient_unscale')


def _finite_guard():
    g = _kernel.get('guard')
    if g is None:
        import cupy
        g = _kernel['guard'] = cupy.zeros((), dtype=numpy.float64)
    return g


class MultiTensorUpdate:
    """Pointer tables for one solver's parameters and history, on the GPU."""

    def __init__(self):
        self.key = None

    def prepare(self, params, history1, history2, lr_mult, decay_mult):
        """(Re)build the tables if any array moved; params etc. are lists of
        CuPy arrays (history2 None for one-history solvers)."""
        if self._key(params, history1, history2, lr_mult, decay_mult) == self.key:
            return
        import cupy
        w = [p.data for p in params]
        g = [p.diff for p in params]
        h = [b.data for b in history1]
        h2 = [b.data for b in history2] if history2 else h
        for a in w + g + h + h2:
            if not a.flags.c_contiguous:
                raise ValueError('solver update: a parameter array is not contiguous')
        ptr = lambda arrs: cupy.asarray(numpy.array([a.data.ptr for a in arrs],  # noqa: E731
                                                    dtype=numpy.uint64))
        sizes = [a.size for a in w]
        offsets = numpy.zeros(len(sizes) + 1, dtype=numpy.int64)
        numpy.cumsum(sizes, out=offsets[1:])
        self.tables = (ptr(w), ptr(g), ptr(h), ptr(h2), cupy.asarray(offsets),
                       cupy.asarray(numpy.asarray(lr_mult, dtype=numpy.float32)),
                       cupy.asarray(numpy.asarray(decay_mult, dtype=numpy.float32)))
        self.n_params = numpy.int32(len(sizes))
        self.total = numpy.int64(offsets[-1])
        # No reference to the arrays: a gradient placed in a memory plan's
        # arena is a view of it, and a held view would keep an old arena
        # allocated beside the new one after a re-layout. The key holds their
        # addresses, so the tables are rebuilt whenever one moves.
        self.key = self._key(params, history1, history2, lr_mult, decay_mult)

    @staticmethod
    def _key(params, history1, history2, lr_mult, decay_mult):
        """What the tables depend on: the arrays' device addresses and sizes."""
        def where(arrays):      # (None: not allocated yet; prepare's accessors will)
            return tuple(None if a is None else (a.data.ptr, a.size) for a in arrays)
        return (where(p.data_storage.array for p in params),
                where(p.diff_storage.array for p in params),
                where(b.data_storage.array for b in history1),
                where(b.data_storage.array for b in history2 or ()),
                tuple(lr_mult), tuple(decay_mult))

    def check(self, guard, flag):
        """Set `guard` (device float64) to NaN and `flag` (device int32) to 1
        if a gradient value of these parameters is not finite."""
        _launch_check(_get_check_kernel(), self.tables[1], self.tables[4], self.n_params,
                      self.total, guard, flag)

    def run(self, kind, rate, norm, weight_decay, l1, a=0.0, b=0.0, c=0.0, d=0.0, guard=None):
        """`guard`: a device float64 scalar; while it is not finite nothing
        is updated (None: always update)."""
        total = int(self.total)
        if total == 0:
            return
        if guard is None:
            guard = _finite_guard()
        threads = 256
        blocks = min((total + threads - 1) // threads, 8192)
        f = numpy.float32
        _get_kernel()((blocks,), (threads,),
                      self.tables + (self.n_params, self.total, numpy.int32(KINDS[kind]),
                                     f(rate), f(norm), f(weight_decay), numpy.int32(bool(l1)),
                                     f(a), f(b), f(c), f(d), guard))


def _launch_check(kernel, table, offsets, n, total, guard, flag):
    if int(total) == 0:
        return
    threads = 256
    blocks = min((int(total) + threads - 1) // threads, 4096)
    kernel((blocks,), (threads,), (table, offsets, n, total, guard, flag))


class MultiTensorCheck:
    """Whether float32 arrays (the loss, every gradient) hold only finite
    values, in one kernel over all of them (the NaN check's common case: one
    launch and one read of the guard, where a reduction per array costs a
    launch each). `kernel`: the check kernel (None: CuPy's; a host
    emulation over NumPy arrays in tests)."""

    def __init__(self, kernel=None):
        self.kernel = kernel
        self.key = None
        self.tables = None

    @staticmethod
    def _where(a):
        return (a.ctypes.data if isinstance(a, numpy.ndarray) else a.data.ptr), a.size

    def _prepare(self, arrays):
        """The pointer and offset tables of `arrays` (rebuilt when one moved)."""
        key = tuple(self._where(a) for a in arrays)
        if key != self.key:
            xp = numpy
            if self.kernel is None:
                import cupy as xp
            sizes = [size for _, size in key]
            offsets = numpy.zeros(len(sizes) + 1, dtype=numpy.int64)
            numpy.cumsum(sizes, out=offsets[1:])
            self.tables = (xp.asarray(numpy.array([ptr for ptr, _ in key], dtype=numpy.uint64)),
                           xp.asarray(offsets), numpy.int32(len(sizes)),
                           numpy.int64(offsets[-1]))
            self.key = key
        return self.tables

    def run(self, arrays, guard, flag):
        """Set `guard` to NaN and `flag` to 1 if a value of `arrays` (float32,
        C-contiguous) is not finite; both stay as they are otherwise. The
        tables hold addresses only (rebuilt when an array moves)."""
        _launch_check(self.kernel or _get_check_kernel(), *self._prepare(arrays), guard, flag)


class MultiTensorUnscale(MultiTensorCheck):
    """Loss scaling's step over float32 arrays (the weight gradients) in one
    kernel: each value divided by the scale; where a result is not finite
    the float64 `guard` becomes +inf (and the value 0 with `zero_bad`).
    `kernel`: None for CuPy's, a host emulation in tests."""

    def run(self, arrays, scale, guard, zero_bad=True):
        table, offsets, n, total = self._prepare(arrays)
        if int(total) == 0:
            return
        threads = 256
        blocks = min((int(total) + threads - 1) // threads, 4096)
        (self.kernel or _get_unscale_kernel())(
            (blocks,), (threads,), (table, offsets, n, total, numpy.float32(scale),
                                    numpy.int32(bool(zero_bad)), guard))
