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

from caffeplus import rng
from caffeplus.errors import NetError


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


def fill_array(param, shape):
    """A float32 array of `shape` filled as FillerParameter `param` says."""
    from caffeplus.blob import check_count
    shape = tuple(int(d) for d in shape)
    kind = param.type
    if any(d < 0 for d in shape):
        raise NetError('%s filler: negative dimension in shape %s' % (kind, shape))
    check_count(shape, '%s filler' % kind)      # before allocating or drawing
    _check_param(param)
    if kind not in _KINDS:
        raise NetError("Unknown filler name: '%s'" % kind)
    if 0 in shape:
        return numpy.zeros(shape, dtype=numpy.float32)      # nothing to draw
    g = rng.get()
    if kind == 'constant':
        out = numpy.full(shape, param.value, dtype=numpy.float32)
    elif kind == 'uniform':
        out = g.uniform(param.min, param.max, size=shape)
    elif kind == 'gaussian':
        # Drawn in float32 directly: half the cost of float64 draws.
        out = g.standard_normal(size=shape, dtype=numpy.float32) * numpy.float32(param.std) \
            + numpy.float32(param.mean)
        if param.sparse >= 0:
            if len(shape) < 1:
                raise NetError('sparse gaussian filler needs a blob with at least one axis '
                               '(FillerParameter.sparse)')
            num_outputs = shape[0]
            prob = param.sparse / float(num_outputs)
            out = out * (g.random(size=shape) < prob)
    elif kind == 'positive_unitball':
        out = g.uniform(0, 1, size=shape)
        num = shape[0] if shape else 1
        flat = out.reshape(num, -1)
        flat /= flat.sum(axis=1, keepdims=True)
        out = flat.reshape(shape)
    elif kind == 'xavier':
        scale = math.sqrt(3.0 / _variance_n(param, shape))
        out = g.uniform(-scale, scale, size=shape)
    elif kind == 'msra':
        std = math.sqrt(2.0 / _variance_n(param, shape))
        out = g.standard_normal(size=shape, dtype=numpy.float32) * numpy.float32(std)
    elif kind == 'bilinear':
        if len(shape) != 4 or shape[2] != shape[3]:
            raise NetError('bilinear filler needs a 4-D blob with square kernels, got %s'
                           % (shape,))
        width = shape[3]
        f = math.ceil(width / 2.0)
        c = (2 * f - 1 - f % 2) / (2.0 * f)
        idx = numpy.arange(int(numpy.prod(shape)))
        x = idx % width
        y = (idx // width) % shape[2]
        out = ((1 - numpy.abs(x / f - c)) * (1 - numpy.abs(y / f - c))).reshape(shape)
    else:
        raise NetError("Unknown filler name: '%s'" % kind)
    return numpy.asarray(out, dtype=numpy.float32)


_KINDS = ('constant', 'uniform', 'gaussian', 'positive_unitball', 'xavier', 'msra', 'bilinear')


def fill(blob, param):
    """Fill a Blob's data in place."""
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


def fill_device(recipe, out):
    """Fill the CuPy array `out` in place as `recipe` (device_recipe) says;
    False when this cannot be done on the device (no recipe, an array that
    is not contiguous, no cuRAND): the caller then fills on the host."""
    if recipe is None or not type(out).__module__.startswith('cupy') or \
            out.dtype != numpy.float32 or not out.flags.c_contiguous or out.data.ptr % 16:
        return False
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
