"""Caffe's weight fillers (FillerParameter): constant, uniform, gaussian
(with sparse), positive_unitball, xavier, msra, bilinear.

Values come from caffeplus.rng, so a seeded net is repeatable; they are not
Caffe's own random numbers (boost's generators are not reproduced).

A filler's fields are checked before drawing (a negative or non-finite std,
min > max, a sparse count below -1 are NetErrors naming the field), and the
shape against caffeplus.blob.check_count before anything is allocated for
it (a layer may fill an array before any Blob of that shape exists).

On the GPU, DummyData refills its tops every forward; device_recipe and
fill_device draw those values on the device, into the top's own array
(no host round trip, no allocation), from a cuRAND generator per device
that is seeded from caffeplus.rng (see device_random). Sparse gaussian and
bilinear fillers have no device form and stay on the host.
"""
import math

import numpy

from caffeplus import backend, rng
from caffeplus.blob import is_virtual, virtual_allocation, virtual_array
from caffeplus.errors import NetError
from caffeplus.kernel_sources import CUDA_SIXTEEN_BIT_TYPES


def _count(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _fans(shape):
    count = int(numpy.prod(shape)) if len(shape) else 1
    fan_in = count // shape[0] if len(shape) >= 1 and shape[0] else count
    fan_out = count // shape[1] if len(shape) > 1 and shape[1] else count
    return fan_in, fan_out


def _variance_n(param, shape):
    from caffeplus.proto import caffe_pb2
    fan_in, fan_out = _fans(shape)
    if param.variance_norm == caffe_pb2.FillerParameter.AVERAGE:
        return (fan_in + fan_out) / 2.0
    if param.variance_norm == caffe_pb2.FillerParameter.FAN_OUT:
        return fan_out
    return fan_in


def _bad(kind, field, value, rule):
    return NetError("%s filler: %s is %s; %s (FillerParameter.%s)"
                    % (kind, field, value, rule, field))


def _check_param(param):
    """Caffe's CHECKs on a filler's fields, as NetErrors naming the field."""
    kind = param.type
    if kind == 'uniform':
        for field in ('min', 'max'):
            if not math.isfinite(getattr(param, field)):
                raise _bad(kind, field, getattr(param, field), 'it must be a finite number')
        if param.min > param.max:
            raise _bad(kind, 'min', param.min, 'it must not exceed max (%g)' % param.max)
    elif kind == 'gaussian':
        if not math.isfinite(param.std) or param.std < 0:
            raise _bad(kind, 'std', param.std, 'it must be a finite number >= 0')
        if not math.isfinite(param.mean):
            raise _bad(kind, 'mean', param.mean, 'it must be a finite number')
        if param.sparse < -1:
            raise _bad(kind, 'sparse', param.sparse, 'it must be -1 (dense) or >= 0')


def _checked_shape(param, shape):
    """`shape` as a tuple of ints, and the filler's fields, checked before
    anything is allocated or drawn for them."""
    from caffeplus.blob import check_count
    shape = tuple(int(d) for d in shape)
    kind = param.type
    if any(d < 0 for d in shape):
        raise NetError('%s filler: negative dimension in shape %s' % (kind, shape))
    check_count(shape, '%s filler' % kind)
    _check_param(param)
    if kind not in _KINDS:
        raise NetError("Unknown filler name: '%s'" % kind)
    if kind == 'gaussian' and param.sparse >= 0 and len(shape) < 1:
        raise NetError('sparse gaussian filler needs a blob with at least one axis '
                       '(FillerParameter.sparse)')
    if kind == 'bilinear' and (len(shape) != 4 or shape[2] != shape[3]):
        raise NetError('bilinear filler needs a 4-D blob with square kernels, got %s'
                       % (shape,))
    return shape


def fill_array(param, shape):
    """A float32 array of `shape` filled as FillerParameter `param` says."""
    shape = _checked_shape(param, shape)
    if virtual_allocation() and param.type not in ('constant', 'bilinear'):
        # A shape-only build (caffeplus.memory.shapes): random values there
        # are never read, so none are drawn and no memory is taken.
        return virtual_array(_count(shape))[:_count(shape)].reshape(shape)
    out = numpy.empty(shape, dtype=numpy.float32)
    _draw(param, out)
    return out


def fill_into(param, out):
    """Fill the float32 NumPy array `out` in place as `param` says: the
    values fill_array would return for out's shape, with no array of their
    own (VGG-16's fc6 alone is 400 MB)."""
    _checked_shape(param, out.shape)
    if out.dtype != numpy.float32 or not out.flags.c_contiguous:
        out[...] = fill_array(param, out.shape)
        return
    _draw(param, out)


def _standard_normal(g, out):
    # Drawn in float32: half the cost of float64 draws. A stand-in generator
    # (shape-only builds, tests) may return its values instead of writing out.
    drawn = g.standard_normal(dtype=numpy.float32, out=out)
    if drawn is not out:
        out[...] = drawn


def _uniform01(g, out):
    """Uniform [0, 1) float32 values into `out` (24 random bits each)."""
    drawn = g.random(dtype=numpy.float32, out=out)
    if drawn is not out:
        out[...] = drawn


def _uniform(g, out, low, high):
    """Uniform values in [low, high] (as float32s) into `out`."""
    _uniform01(g, out)
    low32, high32 = numpy.float32(low), numpy.float32(high)
    width32 = numpy.float32(high - low)
    _to_range(out, low32, high32, width32)
    # Rounding may carry u * (high - low) + low one step past high. Float32
    # rounding is monotonic, so the largest u drawn gives the largest value:
    # clamp (a pass that costs a fifth of the draw) only when it overshoots.
    largest = numpy.array([_LARGEST_UNIT], dtype=numpy.float32)
    _to_range(largest, low32, high32, width32)
    if largest[0] > high32:
        numpy.minimum(out, high32, out=out)


_LARGEST_UNIT = numpy.float32(1) - numpy.float32(2.0 ** -24)   # Generator.random's float32 max


def _to_range(u, low32, high32, width32):
    """[0, 1) draws `u` (a float32 array, in place) made u * (high - low) +
    low, skipping the operations that would not change a value."""
    if high32 - low32 != 1:
        u *= width32
    if low32 != 0:
        u += low32


def _normal(g, out, mean, std):
    _standard_normal(g, out)
    if numpy.float32(std) != 1:
        out *= numpy.float32(std)
    if numpy.float32(mean) != 0:
        out += numpy.float32(mean)


def _draw(param, out):
    """Write `param`'s values into the float32 C-contiguous array `out`
    (shape and fields already checked)."""
    if out.size == 0:
        return                          # nothing to draw
    kind = param.type
    shape = out.shape
    if kind == 'constant':
        out.fill(param.value)
        return
    if kind == 'bilinear':
        out[...] = _bilinear_kernel(shape[3])
        return
    g = rng.get()
    if kind == 'uniform':
        _uniform(g, out, param.min, param.max)
    elif kind == 'gaussian':
        _normal(g, out, param.mean, param.std)
        if param.sparse >= 0:
            # Each weight is kept with probability sparse / num_outputs.
            prob = param.sparse / float(shape[0])
            out *= g.random(size=shape) < prob
    elif kind == 'positive_unitball':
        _uniform01(g, out)
        rows = out.reshape(shape[0] if shape else 1, -1)
        rows /= rows.sum(axis=1, keepdims=True)
    elif kind == 'xavier':
        scale = math.sqrt(3.0 / _variance_n(param, shape))
        _uniform(g, out, -scale, scale)
    elif kind == 'msra':
        _normal(g, out, 0.0, math.sqrt(2.0 / _variance_n(param, shape)))
    else:
        raise NetError("Unknown filler name: '%s'" % kind)


def _bilinear_kernel(width):
    """The width x width upsampling kernel every channel of a bilinear
    filler gets (computed in float64, stored as float32)."""
    f = math.ceil(width / 2.0)
    c = (2 * f - 1 - f % 2) / (2.0 * f)
    ramp = 1 - numpy.abs(numpy.arange(width) / f - c)
    return numpy.outer(ramp, ramp)


_KINDS = ('constant', 'uniform', 'gaussian', 'positive_unitball', 'xavier', 'msra', 'bilinear')


def fill(blob, param):
    """Fill a Blob's data in place (Caffe's Filler::Fill). On the CPU the
    values are drawn straight into the blob's storage; a device blob gets
    them drawn on the host and copied once. A new blob's storage is made, as
    zeros, when it is first used, so a constant 0 filler (every absent
    filler) neither writes nor allocates."""
    _checked_shape(param, blob.shape)
    if blob.data_storage.array is None and param.type == 'constant' and param.value == 0:
        return      # allocated (as zeros) when first read or written
    view = blob.data
    if is_virtual(view):
        return              # a shape-only build: its values are never read
    if isinstance(view, numpy.ndarray) and view.flags.c_contiguous:   # a Storage view
        _draw(param, view)
    else:
        blob.data = fill_array(param, blob.shape)


# -- drawing into device arrays in place ------------------------------------------
def device_recipe(param, shape):
    """How fill_device draws `param` for `shape`, as a small tuple:
    ('constant', value), ('normal', mean, std), ('uniform', low, high) or
    ('unitball', rows); None when the filler has no device form (sparse
    gaussian, bilinear). The values' distribution is fill_array's; the
    numbers themselves come from the device generator."""
    shape = tuple(int(d) for d in shape)
    kind = param.type
    if 0 in shape:
        return ('constant', 0.0)
    if kind == 'constant':
        return ('constant', float(numpy.float32(param.value)))
    if kind == 'uniform':
        return ('uniform', float(param.min), float(param.max))
    if kind == 'gaussian' and param.sparse < 0:
        return ('normal', float(numpy.float32(param.mean)), float(numpy.float32(param.std)))
    if kind == 'xavier':
        scale = math.sqrt(3.0 / _variance_n(param, shape))
        return ('uniform', -scale, scale)
    if kind == 'msra':
        return ('normal', 0.0, float(numpy.float32(math.sqrt(2.0 / _variance_n(param, shape)))))
    if kind == 'positive_unitball':
        return ('unitball', shape[0] if shape else 1)
    return None


def draw_into(recipe, out, gen):
    """Write `recipe`'s values into `out` in place, drawing from `gen` (an
    object with normal_(out, mean, std) and uniform_(out, low, high) that
    fill a contiguous array in place: DeviceRandom on the GPU)."""
    if out.size == 0:
        return
    kind = recipe[0]
    if kind == 'constant':
        out.fill(recipe[1])
    elif kind == 'normal':
        gen.normal_(out, recipe[1], recipe[2])
    elif kind == 'uniform':
        gen.uniform_(out, recipe[1], recipe[2])
    elif kind == 'unitball':
        gen.uniform_(out, 0.0, 1.0)
        rows = out.reshape(recipe[1], -1)
        rows /= rows.sum(axis=1, keepdims=True)
    else:
        raise ValueError('unknown device filler recipe %r' % (recipe,))


def rounds_on_device(dtype):
    """Whether a draw in float32 rounds into an array of `dtype` on the
    device: CUDA's 16-bit map types, float16 and ml_dtypes' bfloat16 (NumPy
    kind 'V', not 'f'; a BFLOAT16 DummyData top drawn on the host instead
    cost 0.2-0.4 s an iteration on the bench nets)."""
    return numpy.dtype(dtype).name in CUDA_SIXTEEN_BIT_TYPES


def fill_device(recipe, out, staging=None):
    """Fill the CuPy array `out` in place as `recipe` (device_recipe) says;
    False when this cannot be done on the device (no recipe, an array that
    is not contiguous, no cuRAND): the caller then fills on the host.
    `staging`: float32 values at least out's count, for a 16-bit `out`'s
    draw (else a scratch buffer shared by all, backend.device_scratch)."""
    if recipe is None or not type(out).__module__.startswith('cupy') or \
            not out.flags.c_contiguous or out.data.ptr % 16:
        return False
    if out.dtype != numpy.float32:
        # A 16-bit top: the same float32 values, drawn into a scratch array
        # of its own and rounded into the top.
        if not rounds_on_device(out.dtype):
            return False
        staged = staging[:out.size] if staging is not None and staging.size >= out.size \
            else backend.device_scratch('fill staging', out.size, numpy.float32)
        if not fill_device(recipe, staged):
            return False
        out.ravel()[...] = staged
        return True
    if recipe[0] == 'constant':
        draw_into(recipe, out, None)
        return True
    gen = _DEVICE_RANDOM.get()
    if gen is None:
        return False
    # Each fill starts from a seed drawn from caffeplus.rng, whose state
    # snapshots keep: a resumed run draws the same device numbers.
    gen.reseed(_DEVICE_RANDOM.seed_for(rng.get()))
    draw_into(recipe, out, gen)
    return True


class DeviceRandom:
    """cuRAND's Philox4x32-10 generator (host API) on the current device.
    It writes straight into the caller's float32 array on the current CuPy
    stream; cupy.random's RandomState and Generator.random would allocate
    an output of their own and copy it."""

    def __init__(self, seed):
        import cupy
        from cupy.cuda import curand
        self._cupy, self._curand = cupy, curand
        self._handle = curand.createGenerator(curand.CURAND_RNG_PSEUDO_PHILOX4_32_10)
        curand.setPseudoRandomGeneratorSeed(self._handle, int(seed))
        # cuRAND draws normals in pairs: an odd count takes its last one here.
        self._pair = cupy.empty(2, dtype=numpy.float32)

    def reseed(self, seed):
        """Restart the stream at `seed` (Philox: cheap, no state to rebuild)."""
        self._curand.setPseudoRandomGeneratorSeed(self._handle, int(seed))
        self._curand.setGeneratorOffset(self._handle, 0)

    def __del__(self):
        handle = getattr(self, '_handle', None)
        if handle:
            try:
                self._curand.destroyGenerator(handle)
            except Exception:       # interpreter shutdown, CUDA context gone
                pass

    def _flat(self, out):
        if out.dtype != numpy.float32 or not out.flags.c_contiguous:
            raise ValueError('DeviceRandom fills contiguous float32 arrays only')
        # The generator follows the caller's stream (not only the null stream).
        self._curand.setStream(self._handle, self._cupy.cuda.get_current_stream().ptr)
        return out.reshape(-1)

    def normal_(self, out, mean, std):
        flat = self._flat(out)
        n = flat.size
        even = n - n % 2
        if even:
            self._curand.generateNormal(self._handle, flat.data.ptr, even, mean, std)
        if n % 2:
            self._curand.generateNormal(self._handle, self._pair.data.ptr, 2, mean, std)
            flat[even:] = self._pair[:1]

    def uniform_(self, out, low, high):
        flat = self._flat(out)
        if flat.size:
            self._curand.generateUniform(self._handle, flat.data.ptr, flat.size)  # (0, 1]
        if (low, high) != (0.0, 1.0):
            flat *= numpy.float32(high - low)
            flat += numpy.float32(low)


class DeviceRandomRegistry:
    """One device generator per GPU, made on first use (drawing nothing);
    every fill reseeds
    it with a number drawn from caffeplus.rng (fill_device), so a seeded run
    draws the same device numbers again, every rank its own (the solver's
    random_seed + rank), and a run resumed from a snapshot (which keeps
    caffeplus.rng's state) those of the uninterrupted run. Nothing is drawn
    from caffeplus.rng in CPU mode."""

    def __init__(self, factory, device_id=None):
        self.factory = factory
        self.device_id = device_id or _current_device
        self._source = None
        self._gens = {}
        self._failed = False

    def seed_for(self, source):
        return int(source.integers(0, 2 ** 63 - 1))

    def get(self):
        if self._failed:
            return None
        source = rng.get()
        if self._source is not source:
            self._source, self._gens = source, {}
        device = self.device_id()
        gen = self._gens.get(device)
        if gen is None:
            try:
                # Seeded by every fill (fill_device); made without a draw, so
                # that a resumed run's stream of draws is the first run's.
                gen = self.factory(0)
            except Exception as exc:    # no cuRAND library: the host path it is
                from caffeplus import log
                log.warning('cannot make a cuRAND generator (%s); DummyData fills on the '
                            'host', exc)
                self._failed = True
                return None
            self._gens[device] = gen
        return gen


def _current_device():
    import cupy
    return cupy.cuda.Device().id


_DEVICE_RANDOM = DeviceRandomRegistry(DeviceRandom)
