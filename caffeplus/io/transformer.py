"""Caffe's DataTransformer: TransformationParameter applied to one image.

For an input of C x H x W pixels (uint8 or float), in Caffe's order:
  1. mirror: decided per image by Rand(2) when `mirror` is set (in either
     phase, as Caffe does);
  2. crop: with crop_size, offsets Rand(H - crop + 1), Rand(W - crop + 1) in
     TRAIN, the centre ((H - crop) / 2, (W - crop) / 2, integer division) in
     TEST;
  3. each output value is (pixel - mean) * scale in float32, where mean is the
     mean image at the same *uncropped* position (mean_file: C x H x W, must
     match the input) or the channel's mean_value (one value, or one per
     channel); without a mean, pixel * scale.
The random draws come in exactly that order (mirror first, then the crop
offsets) from the transformer's own generator, which `init_rand()` seeds from
caffeplus.rng when the transformer needs randomness (mirror, or a TRAIN crop),
as Caffe's InitRand seeds the transformer from the global stream. A layer that
runs its transformer in a prefetch thread therefore gets the same images in
the same order however the threads interleave; `get_state`/`set_state`
save and restore the generator for resuming.

force_color / force_gray apply to encoded datums only (Caffe logs an error and
ignores them for raw datums).
"""
import os

import numpy

from caffeplus import log, rng
from caffeplus.errors import CaffeplusError, NetError
from caffeplus.io import datum as datum_io
from caffeplus.io.batch_transform import TransformPlan, apply_plan
from caffeplus.proto import caffe_pb2

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


def _shape_str(shape):
    return ' x '.join(str(int(d)) for d in shape)


class DataTransformer:
    def __init__(self, param=None, phase=TRAIN, name=''):
        self.param = caffe_pb2.TransformationParameter()
        if param is not None:
            self.param.CopyFrom(param)
        self.phase = phase
        self.name = name
        p = self.param
        self.scale = numpy.float32(p.scale)
        self.crop_size = int(p.crop_size)
        self.mirror = bool(p.mirror)
        if p.force_color and p.force_gray:
            raise NetError('%scannot set both force_color and force_gray' % self._who())
        self.mean = None
        self.mean_file = p.mean_file if p.HasField('mean_file') else None
        if self.mean_file is not None:
            if len(p.mean_value):
                raise NetError('%sCannot specify mean_file and mean_value at the same time'
                               % self._who())
            from caffeplus.io.blobproto import read_mean
            log.info('Loading mean file from: %s', self.mean_file)
            if not os.path.exists(self.mean_file):
                # One line with the path once, and where relative paths start
                # (as the LMDB source's error says).
                raise CaffeplusError('%smean file not found: %s (no such file or directory; '
                                     'paths are relative to the current directory %s)'
                                     % (self._who(), self.mean_file, os.getcwd()))
            try:
                mean = read_mean(self.mean_file)
            except CaffeplusError as exc:   # names the file already
                raise CaffeplusError('%scannot read the mean file: %s' % (self._who(), exc))
            self.mean_shape = tuple(mean.shape)
            if mean.ndim > 3:
                lead = int(numpy.prod(mean.shape[:-3]))
                if lead != 1:
                    raise CaffeplusError('%smean file %s holds %s values (%d images); it must '
                                         'hold one C x H x W mean image'
                                         % (self._who(), self.mean_file,
                                            _shape_str(mean.shape), lead))
                mean = mean.reshape(mean.shape[-3:])
            elif mean.ndim < 3:
                mean = mean.reshape((1,) * (3 - mean.ndim) + mean.shape)
            self.mean = numpy.ascontiguousarray(mean, dtype=numpy.float32)
        self.mean_values = [numpy.float32(v) for v in p.mean_value]
        self._rng = None

    def _who(self):
        return 'layer %s: ' % self.name if self.name else ''

    # -- randomness ------------------------------------------------------------
    @property
    def needs_rand(self):
        return self.mirror or (self.phase == TRAIN and self.crop_size > 0)

    def init_rand(self):
        """Seed this transformer's generator from caffeplus.rng (if it needs one)."""
        if self.needs_rand:
            seed = int(rng.get().integers(0, 2 ** 32, dtype=numpy.uint64))
            self._rng = numpy.random.Generator(numpy.random.PCG64(seed))
        else:
            self._rng = None

    def _generator(self):
        if self._rng is None:  # init_rand() was not called: seed now
            self._rng = numpy.random.Generator(numpy.random.PCG64(
                int(rng.get().integers(0, 2 ** 32, dtype=numpy.uint64))))
        return self._rng

    def rand(self, n):
        """Caffe's Rand(n): a draw from the generator modulo n."""
        return int(self._generator().integers(0, 2 ** 32, dtype=numpy.uint64)) % int(n)

    def get_state(self):
        return None if self._rng is None else self._rng.bit_generator.state

    def set_state(self, state):
        if state is None:
            self._rng = None
            return
        if self._rng is None:
            self._rng = numpy.random.Generator(numpy.random.PCG64())
        self._rng.bit_generator.state = state

    # -- shapes ----------------------------------------------------------------
    def check_input(self, shape, what='the data'):
        """Validate a C x H x W input shape against crop and mean settings."""
        c, h, w = (int(d) for d in shape)
        if self.crop_size and (h < self.crop_size or w < self.crop_size):
            raise CaffeplusError('%scrop_size %d is larger than %s (%s)'
                                 % (self._who(), self.crop_size, what, _shape_str(shape)))
        if self.mean is not None and self.mean.shape != (c, h, w):
            raise CaffeplusError(
                '%sthe mean file %s has shape %s but %s has shape %s (channels x height x '
                'width); the mean must match the uncropped input'
                % (self._who(), self.mean_file, _shape_str(self.mean_shape), what,
                   _shape_str((c, h, w))))
        if self.mean_values and len(self.mean_values) not in (1, c):
            raise CaffeplusError('%sSpecify either 1 mean_value or as many as channels: %d '
                                 '(%d mean_value given)' % (self._who(), c,
                                                            len(self.mean_values)))

    def infer_shape(self, shape, what='the data'):
        """The C x h x w a C x H x W input becomes (Caffe's InferBlobShape)."""
        self.check_input(shape, what)
        c, h, w = (int(d) for d in shape)
        if self.crop_size:
            return (c, self.crop_size, self.crop_size)
        return (c, h, w)

    # -- datums ----------------------------------------------------------------
    def datum_array(self, datum, key=None, what=None, contiguous=True):
        """The C x H x W pixels of a datum (encoded ones decoded per force_*);
        errors name `what` (default: the datum's key); contiguous as
        caffeplus.io.datum.datum_to_array's."""
        if datum.encoded:
            if self.param.force_color:
                mode = datum_io.COLOR
            elif self.param.force_gray:
                mode = datum_io.GRAY
            else:
                mode = datum_io.UNCHANGED
            return datum_io.datum_to_array(datum, key, mode, what=what, contiguous=contiguous)
        return datum_io.datum_to_array(datum, key, what=what)

    def transform_datum(self, datum, out=None, key=None):
        arr = self.datum_array(datum, key)
        return self.transform(arr, out, what='datum %s' % _key_str(key) if key else 'the datum')

    # -- the transformation ----------------------------------------------------
    def draw(self, shape):
        """The random decisions for one input, in Caffe's order: (mirror, h_off, w_off)."""
        _, h, w = shape
        do_mirror = bool(self.mirror and self.rand(2))
        h_off = w_off = 0
        if self.crop_size:
            if self.phase == TRAIN:
                h_off = self.rand(h - self.crop_size + 1)
                w_off = self.rand(w - self.crop_size + 1)
            else:
                h_off = (h - self.crop_size) // 2
                w_off = (w - self.crop_size) // 2
        return do_mirror, h_off, w_off

    def plan(self, draws, shape):
        """The TransformPlan of inputs of one C x H x W shape, given their draws."""
        c, h, w = (int(d) for d in shape)
        ch, cw = (self.crop_size, self.crop_size) if self.crop_size else (h, w)
        mean_values = None
        if self.mean is None and self.mean_values:
            mv = self.mean_values * c if len(self.mean_values) == 1 else self.mean_values
            mean_values = numpy.asarray(mv, dtype=numpy.float32)
        return TransformPlan([d[1] for d in draws], [d[2] for d in draws],
                             [d[0] for d in draws], ch, cw, self.mean, mean_values, self.scale)

    def transform(self, arr, out=None, what='the data'):
        """Transform one C x H x W array; returns float32 C x h x w (into `out`)."""
        arr = self._checked(arr, what)
        draw = self.draw(arr.shape)
        return self._apply_one(arr, draw, out)

    def _checked(self, arr, what):
        arr = numpy.asarray(arr)
        if arr.ndim != 3:
            raise CaffeplusError('%sexpected a C x H x W input, got shape %s'
                                 % (self._who(), arr.shape))
        self.check_input(arr.shape, what)
        return arr

    def _apply_one(self, arr, draw, out=None):
        plan = self.plan([draw], arr.shape)
        result_shape = (arr.shape[0], plan.crop_h, plan.crop_w)
        if out is not None and tuple(out.shape) != result_shape:
            raise CaffeplusError('%san input of shape %s transforms to %s, but the batch holds '
                                 '%s (all inputs of a batch must have the same shape: resize '
                                 'them (new_height/new_width), crop them (crop_size), or for '
                                 'encoded datums set force_color/force_gray)'
                                 % (self._who(), _shape_str(arr.shape),
                                    _shape_str(result_shape), _shape_str(out.shape)))
        result = apply_plan(numpy, arr[None], plan,
                            None if out is None else out.reshape((1,) + result_shape))
        return result[0] if out is None else out

    def draw_batch(self, arrays, whats=None):
        """Check the inputs and draw their decisions image by image, in order:
        (arrays, [(mirror, h_off, w_off)], uniform: whether all share a shape)."""
        if not len(arrays):
            raise CaffeplusError('%sempty batch' % self._who())
        arrays = [self._checked(a, whats[i] if whats else 'the data')
                  for i, a in enumerate(arrays)]
        draws = [self.draw(a.shape) for a in arrays]
        uniform = all(a.shape == arrays[0].shape for a in arrays)
        return arrays, draws, uniform

    def prepare_batch(self, arrays, whats=None):
        """(raw, plan) of inputs that share one shape: raw is their N x C x H
        x W stack (uint8 for uint8 inputs), plan the batch's TransformPlan
        with the decisions drawn in order. A device path copies raw and
        applies the plan there (caffeplus.io.batch_transform)."""
        arrays, draws, uniform = self.draw_batch(arrays, whats)
        if not uniform:
            raise CaffeplusError('%sthe inputs of the batch differ in shape' % self._who())
        return numpy.stack(arrays), self.plan(draws, arrays[0].shape)

    def plan_stacked(self, shape, what='the data'):
        """The TransformPlan of a stacked N x C x H x W batch of `shape`: the
        input checked once, the decisions drawn image by image, in order.
        A device path transfers the uint8 batch and applies this plan there."""
        self.check_input(shape[1:], what)
        return self.plan(self.draw_many(shape[0], shape[1:]), shape[1:])

    def draw_many(self, n, shape):
        """draw(shape) for n inputs of one shape, from one call to the
        generator: every input takes the same number of draws, and the
        generator gives a vector the values it gives one scalar call after
        another, so the decisions equal n draw() calls'. (The prefetch
        thread holds the GIL while it draws; one call a batch leaves it
        to the thread that launches the GPU's work.)"""
        _, h, w = shape
        random_crop = bool(self.crop_size) and self.phase == TRAIN
        per_input = int(bool(self.mirror)) + 2 * int(random_crop)
        if per_input == 0 or n == 0:
            return [self.draw(shape) for _ in range(n)]
        values = self._generator().integers(0, 2 ** 32, size=n * per_input,
                                    dtype=numpy.uint64).reshape(n, per_input)
        column = 0
        mirror = numpy.zeros(n, dtype=bool)
        if self.mirror:
            mirror = values[:, 0] % 2 == 1
            column = 1
        if random_crop:
            h_off = values[:, column] % (h - self.crop_size + 1)
            w_off = values[:, column + 1] % (w - self.crop_size + 1)
        else:
            h_off = numpy.full(n, (h - self.crop_size) // 2 if self.crop_size else 0)
            w_off = numpy.full(n, (w - self.crop_size) // 2 if self.crop_size else 0)
        return list(zip(mirror.tolist(), h_off.tolist(), w_off.tolist()))

    def transform_stacked(self, raw, out=None, what='the data', pool=None):
        """transform_batch of inputs already stacked in one N x C x H x W array
        (`what` names the first, for errors)."""
        raw = numpy.asarray(raw)
        plan = self.plan_stacked(raw.shape, what)
        if out is None:
            out = numpy.empty(plan.output_shape(raw.shape[1]), dtype=numpy.float32)
        return apply_batch(raw, plan, out, pool)

    def transform_batch(self, arrays, out=None, whats=None, pool=None):
        """Transform a list of C x H x W arrays into one N x C x h x w float32 batch.

        The random draws are made image by image in order, exactly as
        transforming them one at a time would; the pixels are transformed
        for the whole batch at once (caffeplus.io.batch_transform), split
        over `pool`'s workers (a caffeplus.io.workers.WorkerPool) if given,
        each stacking and transforming its share.
        """
        arrays, draws, uniform = self.draw_batch(arrays, whats)
        first = self.infer_shape(arrays[0].shape)
        n = len(arrays)
        if out is None:
            out = numpy.empty((n,) + first, dtype=numpy.float32)
        if not uniform:
            for i, a in enumerate(arrays):
                self._apply_one(a, draws[i], out[i])
            return out
        plan = self.plan(draws, arrays[0].shape)

        def run(bounds):
            lo, hi = bounds
            apply_plan(numpy, numpy.stack(arrays[lo:hi]), plan.slice(lo, hi), out[lo:hi])
        if pool is None or pool.count == 1:
            run((0, n))
        else:
            pool.map(run, pool.chunks(n))
        return out


def apply_batch(raw, plan, out, pool=None):
    """apply_plan on the host, the batch split over the pool's workers."""
    if pool is None or pool.count == 1 or len(plan) == 1:
        return apply_plan(numpy, raw, plan, out)

    def run(bounds):
        lo, hi = bounds
        apply_plan(numpy, raw[lo:hi], plan.slice(lo, hi), out[lo:hi])
    pool.map(run, pool.chunks(len(plan)))
    return out


def _key_str(key):
    if isinstance(key, bytes):
        return key.decode('utf-8', 'replace')
    return str(key)


def from_layer_param(layer_param, legacy=None):
    """The TransformationParameter of a layer, folding in legacy fields.

    Caffe's upgrader moves scale/mean_file/crop_size/mirror of data_param and
    image_data_param into transform_param; this does the same for a
    NetParameter that was built in code and never upgraded.
    """
    tp = caffe_pb2.TransformationParameter()
    tp.CopyFrom(layer_param.transform_param)
    if legacy is not None:
        for field in ('scale', 'mean_file', 'crop_size', 'mirror'):
            if legacy.HasField(field) and not tp.HasField(field):
                setattr(tp, field, getattr(legacy, field))
        if getattr(legacy, 'force_encoded_color', False) and not tp.HasField('force_color'):
            tp.force_color = True
    return tp
