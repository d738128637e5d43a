"""pycaffe's caffe.coord_map: how coordinates of one NetSpec top map to
another's, and crop(), the Crop layer that aligns them (FCN's net.py
builds its skip connections with it).

A map is (axis, scale, shift): output coordinate = scale * input
coordinate + shift, over the spatial axes from `axis` on (None: any axis,
a layer that does not move coordinates). Scales and shifts are NumPy
arrays, one value per spatial axis, or scalars where a layer gives one.
"""
import numpy

# Layers whose tops keep their bottoms' coordinates.
PASS_THROUGH_LAYERS = ['AbsVal', 'BatchNorm', 'Bias', 'BNLL', 'Dropout', 'Eltwise', 'ELU',
                       'Log', 'LRN', 'Exp', 'MVN', 'Power', 'ReLU', 'PReLU', 'Scale',
                       'Sigmoid', 'Split', 'TanH', 'Threshold']


class UndefinedMapException(Exception):
    """The layer has no coordinate map (an InnerProduct, a loss, ...)."""


class AxisMismatchException(Exception):
    """Two maps over different spatial axes cannot be composed."""


def _vector(value):
    return numpy.array(value, ndmin=1)


def conv_params(fn):
    """(axis, stride, extent of the dilated kernel, pad) of a Convolution,
    Deconvolution, Im2col (convolution_param) or Pooling (its own fields),
    from the layer function's parameters."""
    params = fn.params.get('convolution_param', fn.params)
    legacy = {'pad_h', 'pad_w', 'kernel_h', 'kernel_w', 'stride_h', 'stride_w'}
    if legacy & set(fn.params) or legacy & set(params):
        raise AssertionError('cropping does not support legacy _h/_w params')
    kernel = _vector(params['kernel_size'])
    dilation = _vector(params.get('dilation', 1))
    return (params.get('axis', 1), _vector(params.get('stride', 1)),
            (kernel - 1) * dilation + 1, _vector(params.get('pad', 0)))


def crop_params(fn):
    """(axis, offsets) of a Crop layer, with Caffe's defaults (axis 2)."""
    params = fn.params.get('crop_param', fn.params)
    return params.get('axis', 2), _vector(params.get('offset', 0))


def coord_map(fn):
    """The map from a layer function's bottom coordinates to its top's."""
    kind = fn.type_name
    if kind in ('Convolution', 'Pooling', 'Im2col'):
        axis, stride, extent, pad = conv_params(fn)
        # Output i sees the window centred on input i * stride - pad + (extent - 1) / 2.
        return axis, 1 / stride, (pad - (extent - 1) / 2) / stride
    if kind == 'Deconvolution':
        axis, stride, extent, pad = conv_params(fn)
        return axis, stride, (extent - 1) / 2 - pad
    if kind in PASS_THROUGH_LAYERS:
        return None, 1, 0
    if kind == 'Crop':
        axis, offset = crop_params(fn)
        # A map's axis counts from the last axis before the spatial ones.
        return axis - 1, 1, -offset
    raise UndefinedMapException(kind)


def compose(base_map, next_map):
    """`base_map` after `next_map`: the scales multiply, and the further
    shift is scaled by the base scale."""
    axis1, scale1, shift1 = base_map
    axis2, scale2, shift2 = next_map
    if axis1 is None:
        axis = axis2
    elif axis2 is None or axis1 == axis2:
        axis = axis1
    else:
        raise AxisMismatchException((axis1, axis2))
    return axis, scale1 * scale2, scale1 * shift2 + shift1


def inverse(coord_map):
    """The map back: coordinates of the top to those of the bottom."""
    axis, scale, shift = coord_map
    return axis, 1 / scale, -shift / scale


def _mappable_bottoms(top):
    """The bottoms whose coordinates map into `top`: all of them, but a
    Crop's second bottom (its reference size only)."""
    bottoms = top.fn.inputs
    return bottoms[:1] if top.fn.type_name == 'Crop' else bottoms


def _walk_back(start):
    """(top, map from its coordinates to `start`'s) for `start` and every
    top it maps back to, nearest first."""
    maps = {start: (None, 1, 0)}
    todo = [start]
    while todo:
        top = todo.pop()
        yield top, maps[top]
        try:
            step = coord_map(top.fn)
        except UndefinedMapException:
            continue
        for bottom in _mappable_bottoms(top):
            maps[bottom] = compose(maps[top], step)
            todo.append(bottom)


def coord_map_from_to(top_from, top_to):
    """The map from `top_from`'s coordinates to `top_to`'s, through a top
    both derive from."""
    from_maps = dict(_walk_back(top_from))
    for top, to_map in _walk_back(top_to):
        if top in from_maps:
            return compose(to_map, inverse(from_maps[top]))
    raise RuntimeError('Could not compute map between tops; are they connected by spatial '
                       'layers?')


def crop(top_from, top_to):
    """A Crop layer function that crops `top_from` to `top_to`'s size and
    place, its axis and offsets from the map between them."""
    from caffeplus.net_spec import layers as L
    axis, scale, shift = coord_map_from_to(top_from, top_to)
    if not numpy.all(numpy.asarray(scale) == 1):
        raise AssertionError('scale mismatch on crop (a = {})'.format(scale))
    if not numpy.all(numpy.asarray(shift) <= 0):
        raise AssertionError('cannot crop negative offset (b = {})'.format(shift))
    if not numpy.all(numpy.round(shift) == shift):
        raise AssertionError('cannot crop noninteger offset (b = {})'.format(shift))
    offsets = [int(v) for v in -numpy.round(_vector(shift))]
    return L.Crop(top_from, top_to, crop_param=dict(axis=axis + 1, offset=offsets))
