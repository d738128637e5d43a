"""A data layer's batch as raw pixels plus a plan, and the plan applied to it.

The prefetch coordinator of a data layer (layers/data.py) hands a batch on as
two parts:

  raw   uint8 (N, C, H, W): the records' pixels exactly as stored or decoded
        (float32 for Datums that hold float_data). Cheap to copy: a quarter of
        the float32 batch, which is what makes it worth sending to a device.
  plan  TransformPlan: every decision for the batch, drawn by the coordinator
        in record order from the layer's transformer generator (mirror flag,
        then crop offsets, image by image, Caffe's order), plus the constants
        (crop size, mean image or mean values, scale).

apply_plan(xp, raw, plan) computes the float32 (N, C, h, w) batch:

    out[n, c, i, j] = (raw[n, c, y, x] - mean[c, y, x]) * scale
        y = h_off[n] + i
        x = w_off[n] + j                  (mirror[n] False)
        x = w_off[n] + (w - 1 - j)        (mirror[n] True)

with mean[c, y, x] the mean image, or mean_values[c] broadcast, or 0. The
subtraction and the multiplication happen in float32 in that order, exactly
as DataTransformer.transform does one image at a time, so the two agree bit
for bit. Every operation here is array-module generic (`xp` is numpy or cupy:
as_strided, integer indexing, elementwise arithmetic), so a GPU path may call
apply_plan on device arrays as it is, or replace it with one kernel that
evaluates the formula above; `plan.to(xp)` moves the plan's arrays.
"""
import numpy

F32 = numpy.float32


class TransformPlan:
    """The decisions and constants of one batch's transformation.

    h_off, w_off: int64 (N,) crop offsets; mirror: bool (N,); crop_h, crop_w:
    the output height and width (the input's own without crop_size); mean:
    float32 (C, H, W) mean image, or None; mean_values: float32 (C,) or None
    (at most one of mean and mean_values); scale: float32.
    """
    __slots__ = ('h_off', 'w_off', 'mirror', 'crop_h', 'crop_w', 'mean', 'mean_values',
                 'scale')

    def __init__(self, h_off, w_off, mirror, crop_h, crop_w, mean=None, mean_values=None,
                 scale=1.0):
        self.h_off = numpy.asarray(h_off, dtype=numpy.int64)
        self.w_off = numpy.asarray(w_off, dtype=numpy.int64)
        self.mirror = numpy.asarray(mirror, dtype=bool)
        self.crop_h, self.crop_w = int(crop_h), int(crop_w)
        self.mean = mean
        self.mean_values = mean_values
        self.scale = F32(scale)

    def __len__(self):
        return int(self.h_off.shape[0])

    def slice(self, lo, hi):
        """The plan of images lo..hi-1 (same constants)."""
        return TransformPlan(self.h_off[lo:hi], self.w_off[lo:hi], self.mirror[lo:hi],
                             self.crop_h, self.crop_w, self.mean, self.mean_values, self.scale)

    def to(self, xp):
        """The same plan with its arrays in array module `xp`."""
        plan = TransformPlan(self.h_off, self.w_off, self.mirror, self.crop_h, self.crop_w,
                             self.mean, self.mean_values, self.scale)
        for field in ('h_off', 'w_off', 'mirror', 'mean', 'mean_values'):
            value = getattr(plan, field)
            if value is not None:
                setattr(plan, field, xp.asarray(value))
        return plan

    def output_shape(self, channels):
        return (len(self), int(channels), self.crop_h, self.crop_w)


def _windows_at(xp, images, h_off, w_off, crop_h, crop_w):
    """images[n, :, h_off[n]:+crop_h, w_off[n]:+crop_w] for every n, as one
    gather: a strided view of all crop windows, indexed by the offsets."""
    n, c, h, w = images.shape
    sn, sc, sh, sw = images.strides
    windows = xp.lib.stride_tricks.as_strided(
        images, shape=(n, c, h - crop_h + 1, w - crop_w + 1, crop_h, crop_w),
        strides=(sn, sc, sh, sw, sh, sw))
    # Integer indices on axes 0, 2, 3 around a slice: the indexed axis leads,
    # giving (N, C, crop_h, crop_w).
    return windows[xp.arange(h_off.shape[0]), :, h_off, w_off]


def _mean_windows(xp, mean, plan):
    """The mean image's crop windows at each image's offsets (N, C, h, w)."""
    batch = xp.lib.stride_tricks.as_strided(
        mean, shape=(len(plan),) + tuple(mean.shape), strides=(0,) + tuple(mean.strides))
    return _windows_at(xp, batch, plan.h_off, plan.w_off, plan.crop_h, plan.crop_w)


def check_plan(raw, plan):
    """Errors for a raw batch and a plan that do not fit together."""
    if raw.ndim != 4:
        raise ValueError('apply_plan needs an N x C x H x W batch, got shape %s'
                         % (tuple(raw.shape),))
    n, c, h, w = raw.shape
    if len(plan) != n:
        raise ValueError('the plan is for %d images, the batch holds %d' % (len(plan), n))
    if plan.crop_h > h or plan.crop_w > w:
        raise ValueError('crop %d x %d is larger than the images (%d x %d)'
                         % (plan.crop_h, plan.crop_w, h, w))
    if plan.mean is not None and tuple(plan.mean.shape) != (c, h, w):
        raise ValueError('the mean image has shape %s, the images %s'
                         % (tuple(plan.mean.shape), (c, h, w)))
    if plan.mean_values is not None and plan.mean_values.shape[0] != c:
        raise ValueError('%d mean values for %d channels' % (plan.mean_values.shape[0], c))


def _mirror(xp, batch, plan):
    """Flip the images the plan mirrors, in place (any dtype, N x C x h x w)."""
    flipped = xp.nonzero(plan.mirror)[0]
    if flipped.shape[0]:
        batch[flipped] = batch[flipped][..., ::-1]


def apply_plan(xp, raw, plan, out=None):
    """The float32 (N, C, crop_h, crop_w) batch of `raw` under `plan` (into `out`).

    Three passes over the batch: gather the crops at raw's own type (integer
    indexing copies, so `raw` is never written), flip the mirrored ones
    while they are still small, then convert and subtract the mean in one
    ufunc call (float32 operands: what astype-then-subtract gives), and
    multiply by the scale unless it is 1 (x * 1 is x exactly).
    """
    check_plan(raw, plan)
    n, c = raw.shape[:2]
    crops = _windows_at(xp, raw, plan.h_off, plan.w_off, plan.crop_h, plan.crop_w)
    _mirror(xp, crops, plan)
    shape = (n, c, plan.crop_h, plan.crop_w)
    if out is None:
        out = xp.empty(shape, dtype=F32)
    elif tuple(out.shape) != shape or out.dtype != F32:
        raise ValueError('out is %s %s, the batch transforms to float32 %s'
                         % (out.dtype, tuple(out.shape), shape))
    if plan.mean is not None:
        mean = _mean_windows(xp, plan.mean.astype(F32, copy=False), plan)
        _mirror(xp, mean, plan)
        xp.subtract(crops, mean, out=out, dtype=F32)
    elif plan.mean_values is not None:
        xp.subtract(crops, plan.mean_values.astype(F32).reshape(1, c, 1, 1), out=out,
                    dtype=F32)
    else:
        out[...] = crops
    if plan.scale != 1:
        xp.multiply(out, plan.scale, out=out)
    return out
