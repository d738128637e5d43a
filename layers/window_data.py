"""WindowData: R-CNN's window files, sampled into fixed-size crops.

A window file lists images and, for each, candidate windows with the class
and the overlap of each window with a ground-truth box. Whitespace separates
the tokens (line breaks carry no meaning), repeated once per image:

    # <image index: 0, 1, ... in file order>
    <image path>            (window_data_param.root_folder is prepended as is)
    <channels> <height> <width>
    <number of windows>
    <class> <overlap> <x1> <y1> <x2> <y2>     (one per window, inclusive pixels)

Windows with overlap >= fg_threshold are foreground (their class, which must
be positive); those with overlap < bg_threshold are background (class 0);
the rest are not used. Each batch samples, with replacement and uniformly,
batch_size - int(batch_size * fg_fraction) background windows and then the
foreground ones, from the layer's own generator (seeded from caffeplus.rng
at setup); with mirror, each window also draws a coin for a horizontal flip,
in either phase, as Caffe does. A window is cut out of its image (decoded as
ImageData decodes: BGR, 3 channels), optionally enlarged so that after
warping `context_pad` pixels of context surround it (crop_mode 'square' also
makes it square first), clipped to the image, resized with OpenCV's bilinear
arithmetic and placed in a crop_size x crop_size output at the offset the
clipped-off part would have taken; the rest of the output stays 0. Each value
is (pixel - mean) * window_data_param.scale, the mean being the centre
crop_size x crop_size of the mean file at the output position, or the
channel's mean_value.

Where the settings come from is Caffe's choice: crop_size, mirror, mean_file
and mean_value from transform_param (a window_data_param.crop_size, mirror or
mean_file of a net never upgraded counts where transform_param lacks it), the
rest from window_data_param; transform_param.scale is not used.
"""
import collections
import copy
import math
import os

import numpy

from caffeplus import log
from caffeplus.errors import CaffeplusError, FormatError, NetError
from caffeplus.io import datum as datum_io
from caffeplus.io.prefetch import Batch
from caffeplus.layer import register
from caffeplus.layers.data import (BasePrefetchingDataLayer, _generator,
                                   _positive_batch_size, _seed_from_global)

F32 = numpy.float32
# cv::imread(IMREAD_COLOR), which Caffe uses, always gives 3 channels.
IMAGE_CHANNELS = 3
CROP_MODES = ('warp', 'square')

WindowImage = collections.namedtuple('WindowImage', 'path channels height width lineno')
Window = collections.namedtuple('Window', 'image label overlap x1 y1 x2 y2 lineno')
# Where a window's pixels come from (inclusive x1..x2, y1..y2 of the image),
# the size they are resized to, and where that lands in the output.
Region = collections.namedtuple('Region', 'x1 y1 x2 y2 out_h out_w pad_h pad_w')


# -- the window file -------------------------------------------------------------
class _Tokens:
    """The whitespace-separated tokens of a file, each with its line number."""

    def __init__(self, text, path, who):
        self.items = [(tok, lineno) for lineno, line in enumerate(text.splitlines(), 1)
                      for tok in line.split()]
        self.pos = 0
        self.path = path
        self.who = who

    def done(self):
        return self.pos >= len(self.items)

    def error(self, lineno, message):
        return FormatError('%sline %d of window file %s: %s'
                           % (self.who, lineno, self.path, message))

    def next(self, what):
        if self.done():
            last = self.items[-1][1] if self.items else 0
            raise FormatError('%swindow file %s ends after line %d where %s was expected'
                              % (self.who, self.path, last, what))
        tok, lineno = self.items[self.pos]
        self.pos += 1
        return tok, lineno

    def next_int(self, what):
        tok, lineno = self.next(what)
        try:
            return int(tok), lineno
        except ValueError:
            raise self.error(lineno, "expected %s (an integer), got '%s'" % (what, tok))

    def next_float(self, what):
        tok, lineno = self.next(what)
        try:
            value = float(tok)
        except ValueError:
            value = float('nan')
        if not math.isfinite(value):
            raise self.error(lineno, "expected %s (a number), got '%s'" % (what, tok))
        return F32(value), lineno


def _read_image_header(tokens, index, root_folder):
    tag, lineno = tokens.next("'#' (the start of an image)")
    if tag != '#':
        raise tokens.error(lineno, "expected '#' (the start of an image), got '%s'" % tag)
    number, lineno = tokens.next_int('the image index')
    if number != index:
        raise tokens.error(lineno, 'image index %d where %d was expected (windows refer to '
                                   'images by their position in the file, counted from 0)'
                           % (number, index))
    path, path_line = tokens.next('the image path')
    channels, lineno = tokens.next_int('the image channels')
    if channels != IMAGE_CHANNELS:
        raise tokens.error(lineno, 'image channels %d: WindowData reads images in colour '
                                   '(%d channels), as Caffe does' % (channels, IMAGE_CHANNELS))
    sizes = [channels]
    for what in ('height', 'width'):
        value, lineno = tokens.next_int('the image %s' % what)
        if value <= 0:
            raise tokens.error(lineno, 'image %s must be positive (got %d)' % (what, value))
        sizes.append(value)
    return WindowImage(root_folder + path, sizes[0], sizes[1], sizes[2], path_line)


def _read_window(tokens, index):
    label, lineno = tokens.next_int('a window class')
    overlap, _ = tokens.next_float('a window overlap')
    coords = [tokens.next_int('window coordinate %s' % name)[0]
              for name in ('x1', 'y1', 'x2', 'y2')]
    x1, y1, x2, y2 = coords
    if x2 < x1 or y2 < y1:
        raise tokens.error(lineno, 'window %d %d %d %d is empty (x1 <= x2 and y1 <= y2 are '
                                   'needed)' % (x1, y1, x2, y2))
    return Window(index, label, overlap, x1, y1, x2, y2, lineno)


def read_window_file(path, root_folder='', layer_name=''):
    """([WindowImage], [Window]) of a window file, every window as written."""
    who = 'layer %s: ' % layer_name if layer_name else ''
    try:
        with open(path, 'r', encoding='utf-8', errors='surrogateescape') as f:
            text = f.read()
    except FileNotFoundError:
        raise CaffeplusError('%swindow file not found: %s' % (who, path))
    except OSError as exc:
        raise CaffeplusError('%scannot read window file %s: %s'
                             % (who, path, exc.strerror or exc))
    tokens = _Tokens(text, path, who)
    if tokens.done():
        raise FormatError('%sWindow file is empty: %s' % (who, path))
    images, windows = [], []
    while not tokens.done():
        image = _read_image_header(tokens, len(images), root_folder)
        count, lineno = tokens.next_int('the number of windows')
        if count < 0:
            raise tokens.error(lineno, 'the number of windows is negative (%d)' % count)
        windows.extend(_read_window(tokens, len(images)) for _ in range(count))
        images.append(image)
    return images, windows


def split_windows(windows, fg_threshold, bg_threshold, path, who=''):
    """(foreground, background) windows; background ones get class and overlap 0."""
    fg_threshold, bg_threshold = F32(fg_threshold), F32(bg_threshold)
    fg, bg = [], []
    for w in windows:
        if w.overlap >= fg_threshold:
            if w.label <= 0:
                raise FormatError('%sline %d of window file %s: a foreground window (overlap '
                                  '%g >= fg_threshold %g) needs a positive class, got %d'
                                  % (who, w.lineno, path, w.overlap, fg_threshold, w.label))
            fg.append(w)
        elif w.overlap < bg_threshold:
            bg.append(w._replace(label=0, overlap=F32(0)))
    return fg, bg


# -- cutting a window out --------------------------------------------------------
def _c_round(x):
    """C's round(): halves away from zero."""
    x = float(x)
    return int(math.copysign(math.floor(abs(x) + 0.5), x))


def context_region(window, crop_size, context_pad, square, image_h, image_w, mirror):
    """The Region of a window enlarged by its context (Caffe's arithmetic, in float32)."""
    crop = F32(crop_size)
    context_scale = crop / F32(crop_size - 2 * context_pad)
    half_h = F32(window.y2 - window.y1 + 1) / F32(2)
    half_w = F32(window.x2 - window.x1 + 1) / F32(2)
    center_x = F32(window.x1) + half_w
    center_y = F32(window.y1) + half_h
    if square:
        half_h = half_w = max(half_h, half_w)
    x1 = _c_round(center_x - half_w * context_scale)
    x2 = _c_round(center_x + half_w * context_scale)
    y1 = _c_round(center_y - half_h * context_scale)
    y2 = _c_round(center_y + half_h * context_scale)
    unclipped_h, unclipped_w = y2 - y1 + 1, x2 - x1 + 1
    pad_x1, pad_y1 = max(0, -x1), max(0, -y1)
    pad_x2, pad_y2 = max(0, x2 - image_w + 1), max(0, y2 - image_h + 1)
    x1, x2, y1, y2 = x1 + pad_x1, x2 - pad_x2, y1 + pad_y1, y2 - pad_y2
    # The factors that would warp the unclipped region onto the output.
    scale_x, scale_y = crop / F32(unclipped_w), crop / F32(unclipped_h)
    out_w = _c_round(F32(x2 - x1 + 1) * scale_x)
    out_h = _c_round(F32(y2 - y1 + 1) * scale_y)
    pad_h = _c_round(F32(pad_y1) * scale_y)
    # A mirrored crop keeps its context on the mirrored side.
    pad_w = _c_round(F32(pad_x2 if mirror else pad_x1) * scale_x)
    # Rounding may push the warped part past the output's edge: trim it.
    out_h = min(out_h, crop_size - pad_h)
    out_w = min(out_w, crop_size - pad_w)
    return Region(x1, y1, x2, y2, out_h, out_w, pad_h, pad_w)


def window_region(window, crop_size, context_pad, square, image_h, image_w, mirror):
    """The Region a window's pixels are taken from and placed at."""
    if context_pad > 0 or square:
        return context_region(window, crop_size, context_pad, square, image_h, image_w,
                              mirror)
    return Region(window.x1, window.y1, window.x2, window.y2, crop_size, crop_size, 0, 0)


def _check_region(region, image_h, image_w):
    """Why a region cannot be cut from an image of that size (None if it can)."""
    r = region
    if r.x1 < 0 or r.y1 < 0 or r.x2 >= image_w or r.y2 >= image_h or \
            r.x2 < r.x1 or r.y2 < r.y1:
        return 'the region x %d..%d, y %d..%d is not inside the image (%d x %d pixels)' \
            % (r.x1, r.x2, r.y1, r.y2, image_w, image_h)
    if r.out_h <= 0 or r.out_w <= 0:
        return 'the region x %d..%d, y %d..%d warps to %d x %d pixels' \
            % (r.x1, r.x2, r.y1, r.y2, r.out_w, r.out_h)
    return None


def cut_window(image, region, mirror):
    """The H x W x C uint8 pixels of a region, resized (and flipped when mirrored)."""
    pixels = image[region.y1:region.y2 + 1, region.x1:region.x2 + 1]
    warped = datum_io.resize_linear(pixels, region.out_h, region.out_w)
    return warped[:, ::-1] if mirror else warped


# -- batches -----------------------------------------------------------------------
class _Settings:
    """What load_batch needs, fixed at setup."""

    def __init__(self, batch_size, num_fg, crop_size, context_pad, square, mirror, scale,
                 mean_crop, mean_values):
        self.batch_size, self.num_fg = batch_size, num_fg
        self.crop_size, self.context_pad, self.square = crop_size, context_pad, square
        self.mirror, self.scale = mirror, scale
        self.mean_crop, self.mean_values = mean_crop, mean_values


class _WindowSource:
    def __init__(self, name, path, images, fg, bg, settings, seed, cached):
        self.name, self.path = name, path
        self.images, self.fg, self.bg = images, fg, bg
        self.s = settings
        self._rng = _generator(seed)
        self.cached = cached        # encoded bytes per image, or None
        self.shard = (0, 1)         # (rank, world): see BasePrefetchingDataLayer.set_shard

    def _draw(self):
        return int(self._rng.integers(0, 2 ** 32, dtype=numpy.uint64))

    def sample_plan(self):
        """[(window, mirror)] for one batch: background windows, then foreground."""
        s = self.s
        plan = []
        for pool, count in ((self.bg, s.batch_size - s.num_fg), (self.fg, s.num_fg)):
            for _ in range(count):
                window = pool[self._draw() % len(pool)]
                plan.append((window, s.mirror and self._draw() % 2 == 1))
        return plan

    def _what(self, image):
        return "image '%s' (line %d of window file %s)" % (image.path, image.lineno, self.path)

    def decode(self, index):
        image = self.images[index]
        what = self._what(image)
        try:
            if self.cached is not None:
                return datum_io.decode_image_hwc(self.cached[index], datum_io.COLOR, what)
            return datum_io.read_image_hwc(image.path, datum_io.COLOR, what=what)
        except FormatError as exc:
            raise CaffeplusError('layer %s: %s' % (self.name, exc)) from exc

    def _place(self, out, window, mirror, image):
        s = self.s
        h, w = image.shape[:2]
        region = window_region(window, s.crop_size, s.context_pad, s.square, h, w, mirror)
        problem = _check_region(region, h, w)
        if problem:
            raise CaffeplusError('layer %s: window %d %d %d %d at line %d of window file %s '
                                 '(%s): %s' % (self.name, window.x1, window.y1, window.x2,
                                               window.y2, window.lineno, self.path,
                                               self.images[window.image].path, problem))
        pixels = cut_window(image, region, mirror).transpose(2, 0, 1).astype(F32)
        rows = slice(region.pad_h, region.pad_h + region.out_h)
        cols = slice(region.pad_w, region.pad_w + region.out_w)
        if s.mean_crop is not None:
            pixels -= s.mean_crop[:, rows, cols]
        elif s.mean_values is not None:
            pixels -= s.mean_values[:, None, None]
        out[:, rows, cols] = pixels * s.scale

    def load_batch(self):
        s = self.s
        rank, world = self.shard
        for _ in range(rank):
            self.sample_plan()
        plan = self.sample_plan()
        for _ in range(world - 1 - rank):
            self.sample_plan()
        data = numpy.zeros((s.batch_size, IMAGE_CHANNELS, s.crop_size, s.crop_size), F32)
        label = numpy.empty((s.batch_size,), F32)
        decoded = {}    # an image sampled twice in a batch is decoded once
        for i, (window, mirror) in enumerate(plan):
            if window.image not in decoded:
                decoded[window.image] = self.decode(window.image)
            self._place(data[i], window, mirror, decoded[window.image])
            label[i] = window.label
        return Batch(data, label, self.state())

    def state(self):
        return {'rng': copy.deepcopy(self._rng.bit_generator.state)}

    def restore(self, state):
        self._rng.bit_generator.state = copy.deepcopy(state['rng'])

    def close(self):
        pass


def _read_images(layer, path, images, cache):
    """The encoded bytes of every image (cache), after checking that each exists."""
    cached = [] if cache else None
    for image in images:
        what = "image '%s' (line %d of window file %s)" % (image.path, image.lineno, path)
        if not os.path.isfile(image.path):
            hint = ''
            root = layer.layer_param.window_data_param.root_folder
            if root and not root.endswith('/'):
                hint = " [root_folder '%s' is prepended as is, as Caffe does: end it with " \
                       "'/']" % root
            raise CaffeplusError('layer %s: %s: image file not found%s'
                                 % (layer.name, what, hint))
        if cache:
            try:
                with open(image.path, 'rb') as f:
                    cached.append(f.read())
            except OSError as exc:
                raise CaffeplusError('layer %s: %s: cannot read (%s)'
                                     % (layer.name, what, exc.strerror or exc))
    return cached


@register
class WindowDataLayer(BasePrefetchingDataLayer):
    """R-CNN fine-tuning input: foreground and background windows of images."""
    type = 'WindowData'
    exact_num_top = 2
    min_num_top = -1
    max_num_top = -1
    legacy_transform_field = 'window_data_param'

    def _field_error(self, field, message):
        return NetError('layer %s (WindowData): %s %s' % (self.name, field, message))

    def _log_settings(self, p):
        log.info('Window data layer:\n'
                 '  foreground (object) overlap threshold: %g\n'
                 '  background (non-object) overlap threshold: %g\n'
                 '  foreground sampling fraction: %g\n'
                 '  cache_images: %d\n'
                 '  root_folder: %s', p.fg_threshold, p.bg_threshold, p.fg_fraction,
                 p.cache_images, p.root_folder)

    def _checked_params(self, p):
        batch_size = _positive_batch_size(self, p.batch_size, 'window_data_param.batch_size')
        if not p.source:
            raise self._field_error('window_data_param.source', 'is not set')
        if p.crop_mode not in CROP_MODES:
            raise self._field_error('window_data_param.crop_mode', "is '%s'; it must be one "
                                    "of %s" % (p.crop_mode, ', '.join(CROP_MODES)))
        crop_size = self.transformer.crop_size
        if crop_size <= 0:
            raise self._field_error('transform_param.crop_size', 'must be positive (WindowData '
                                    'warps every window to crop_size x crop_size)')
        if 2 * p.context_pad >= crop_size:
            raise self._field_error('window_data_param.context_pad', '%d leaves no room for '
                                    'the window in crop_size %d' % (p.context_pad, crop_size))
        if not 0 <= p.fg_fraction <= 1:
            raise self._field_error('window_data_param.fg_fraction', 'must lie in [0, 1] '
                                    '(got %g)' % p.fg_fraction)
        if self.layer_param.transform_param.HasField('scale'):
            log.warning('layer %s: WindowData scales by window_data_param.scale (%g), as Caffe '
                        'does; transform_param.scale (%g) is not used', self.name, p.scale,
                        self.layer_param.transform_param.scale)
        # Caffe's int(float(batch_size) * fg_fraction), in float32.
        num_fg = int(F32(batch_size) * F32(p.fg_fraction))
        return batch_size, crop_size, num_fg

    def _mean(self, crop_size):
        """(centre crop of the mean file, per-channel mean values): one or neither."""
        t = self.transformer
        if t.mean is not None:
            c, h, w = t.mean.shape
            # Caffe offsets both axes by the width's margin.
            off = (w - crop_size) // 2
            if c != IMAGE_CHANNELS or off < 0 or off + crop_size > h:
                raise self._field_error('transform_param.mean_file', '%s holds a %d x %d x %d '
                                        'mean; WindowData needs %d channels and its centre '
                                        '%d x %d (offset (width - crop_size) / 2 on both axes)'
                                        % (t.mean_file, c, h, w, IMAGE_CHANNELS, crop_size,
                                           crop_size))
            return numpy.ascontiguousarray(t.mean[:, off:off + crop_size,
                                                  off:off + crop_size]), None
        if t.mean_values:
            if len(t.mean_values) not in (1, IMAGE_CHANNELS):
                raise self._field_error('transform_param.mean_value', 'must be given once or '
                                        'once per channel (%d); got %d values'
                                        % (IMAGE_CHANNELS, len(t.mean_values)))
            values = t.mean_values * IMAGE_CHANNELS if len(t.mean_values) == 1 \
                else t.mean_values
            return None, numpy.asarray(values, dtype=F32)
        return None, None

    def _windows(self, p, path):
        images, windows = read_window_file(path, p.root_folder, self.name)
        fg, bg = split_windows(windows, p.fg_threshold, p.bg_threshold, path,
                               'layer %s: ' % self.name)
        for image_index, image in enumerate(images):
            if image_index % 100 == 0:
                count = sum(1 for w in windows if w.image == image_index)
                log.info('num: %d %s %d %d %d windows to process: %d', image_index,
                         image.path, image.channels, image.height, image.width, count)
        log.info('Number of images: %d', len(images))
        histogram = collections.Counter({0: 0})
        histogram.update(w.label for w in fg + bg)
        for label in sorted(histogram):
            log.info('class %d has %d samples', label, histogram[label])
        return images, fg, bg

    def _check_pools(self, path, p, fg, bg, batch_size, num_fg):
        for pool, count, name, rule in ((fg, num_fg, 'foreground', 'overlap >= fg_threshold %g'
                                         % p.fg_threshold),
                                        (bg, batch_size - num_fg, 'background',
                                         'overlap < bg_threshold %g' % p.bg_threshold)):
            if count and not pool:
                raise CaffeplusError('layer %s: window file %s has no %s windows (%s), but '
                                     'fg_fraction %g of batch_size %d asks for %d'
                                     % (self.name, path, name, rule, p.fg_fraction, batch_size,
                                        count))

    def make_source(self, top):
        p = self.layer_param.window_data_param
        self._log_settings(p)
        batch_size, crop_size, num_fg = self._checked_params(p)
        mean_crop, mean_values = self._mean(crop_size)
        # As Caffe, the sampling generator's seed is drawn before the file is read.
        seed = _seed_from_global()
        images, fg, bg = self._windows(p, p.source)
        self._check_pools(p.source, p, fg, bg, batch_size, num_fg)
        log.info('Amount of context padding: %d', p.context_pad)
        log.info('Crop mode: %s', p.crop_mode)
        cached = _read_images(self, p.source, images, p.cache_images)
        settings = _Settings(batch_size, num_fg, crop_size, int(p.context_pad),
                             p.crop_mode == 'square', self.transformer.mirror, F32(p.scale),
                             mean_crop, mean_values)
        top[0].reshape((batch_size, IMAGE_CHANNELS, crop_size, crop_size))
        log.info('output data size: %d,%d,%d,%d', batch_size, IMAGE_CHANNELS, crop_size,
                 crop_size)
        top[1].reshape((batch_size,))
        return _WindowSource(self.name, p.source, images, fg, bg, settings, seed, cached)
