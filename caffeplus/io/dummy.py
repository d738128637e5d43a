"""Replace a net's data layers by DummyData layers of the same shapes.

    from caffeplus.io.dummy import swap_data_layers
    param = swap_data_layers(read_net_param('train_val.prototxt'), batch_size=2)
    net = caffeplus.Net(param, caffeplus.TRAIN)

Builds, timings and memory estimates then need no database: every Data,
ImageData, HDF5Data, WindowData and MemoryData layer becomes a DummyData
layer with the same name, tops, phase and include/exclude rules, whose tops
have the shapes the data layer would give them: the data top (batch, C, H,
W), other tops (labels) (batch,). Data is Gaussian (std 1), labels constant
0, so losses and accuracies can run.

Shapes come from, in this order:
  1. `shapes`: {top name or layer name: shape}. A shape under a top name is
     that top's full shape; under a layer name it is the data top's shape
     (the other tops then get (batch,) with batch = shape[0]).
  2. what the layer says: MemoryData's channels/height/width; crop_size
     (H = W = crop), else ImageData's new_height/new_width; is_color false
     or transform_param force_gray give 1 channel, force_color 3.
  3. the dataset its source names: mnist 1x28x28 (mnist_siamese pairs
     2x28x28), cifar 3x32x32, imagenet / ilsvrc 3x256x256.
  4. channels default to 3; if H and W remain unknown, FormatError asks for
     `shapes`.
The batch is `batch_size` when given, else the layer's own batch size.
V0/V1 nets are upgraded first (on the copy).
"""
import os

from caffeplus.errors import FormatError
from caffeplus.proto import caffe_pb2

DATA_LAYER_TYPES = ('Data', 'ImageData', 'HDF5Data', 'WindowData', 'MemoryData')

# (substring of the source path, lower case; (C, H, W)), most specific first.
KNOWN_DATASETS = (
    ('mnist_siamese', (2, 28, 28)),
    ('mnist', (1, 28, 28)),
    ('cifar', (3, 32, 32)),
    ('ilsvrc', (3, 256, 256)),
    ('imagenet', (3, 256, 256)),
)

_PARAM_OF_TYPE = {
    'Data': 'data_param',
    'ImageData': 'image_data_param',
    'HDF5Data': 'hdf5_data_param',
    'WindowData': 'window_data_param',
    'MemoryData': 'memory_data_param',
}


def is_data_layer(layer_param):
    return layer_param.type in DATA_LAYER_TYPES


def _source(lp):
    field = _PARAM_OF_TYPE.get(lp.type)
    if field is None or lp.type == 'MemoryData':
        return ''
    return getattr(lp, field).source


def _layer_batch(lp):
    field = _PARAM_OF_TYPE.get(lp.type)
    if field is None:
        return 0
    sub = getattr(lp, field)
    return int(sub.batch_size) if sub.HasField('batch_size') or lp.type == 'ImageData' else 0


def _known_dataset(source):
    low = source.lower()
    for key, chw in KNOWN_DATASETS:
        if key in low:
            return chw
    return None


def _infer_chw(lp):
    """(C, H, W) of the data top, entries None where unknown."""
    if lp.type == 'MemoryData':
        m = lp.memory_data_param
        return int(m.channels), int(m.height), int(m.width)
    channels = height = width = None
    known = _known_dataset(_source(lp))
    tp = lp.transform_param
    crop = int(tp.crop_size)
    if lp.type == 'WindowData' and not crop:
        crop = int(lp.window_data_param.crop_size)
    if crop:
        height = width = crop
    elif lp.type == 'ImageData' and lp.image_data_param.new_height and \
            lp.image_data_param.new_width:
        height = int(lp.image_data_param.new_height)
        width = int(lp.image_data_param.new_width)
    if known is not None:
        channels = known[0]
        if height is None:
            height, width = known[1], known[2]
    if lp.type == 'ImageData' and not lp.image_data_param.is_color:
        channels = 1
    if tp.force_gray:
        channels = 1
    elif tp.force_color:
        channels = 3
    if channels is None:
        channels = 3
    return channels, height, width


def data_top_shapes(layer_param, shapes=None, batch_size=None):
    """The shape of each top of data layer `layer_param`, as a list of tuples."""
    lp = layer_param
    shapes = shapes or {}
    tops = list(lp.top)
    out = [None] * len(tops)
    for i, name in enumerate(tops):
        if name in shapes:
            out[i] = _as_shape(shapes[name], lp.name, name)
    if out and out[0] is None and lp.name in shapes:
        out[0] = _as_shape(shapes[lp.name], lp.name, tops[0])
    if out and out[0] is None:
        batch = int(batch_size) if batch_size else _layer_batch(lp)
        if batch <= 0:
            raise FormatError("data layer '%s': no batch size (the layer has none); pass "
                              "batch_size" % lp.name)
        c, h, w = _infer_chw(lp)
        if not h or not w or not c:
            raise FormatError(
                "data layer '%s' (%s, source '%s'): cannot tell the shape of top '%s'; pass "
                "shapes={'%s': (N, C, H, W)}" % (lp.name, lp.type, _source(lp), tops[0],
                                                 tops[0]))
        out[0] = (batch, c, h, w)
    for i in range(1, len(tops)):
        if out[i] is None:
            out[i] = (out[0][0],)
    return out


def _as_shape(value, layer, top):
    try:
        shape = tuple(int(d) for d in value)
    except (TypeError, ValueError):
        raise FormatError("data layer '%s': shape for top '%s' must be a sequence of ints, "
                          "not %r" % (layer, top, value))
    if not shape or any(d < 0 for d in shape):
        raise FormatError("data layer '%s': bad shape %r for top '%s'" % (layer, value, top))
    return shape


def dummy_layer(layer_param, top_shapes):
    """A DummyData LayerParameter standing in for data layer `layer_param`."""
    lp = layer_param
    dummy = caffe_pb2.LayerParameter(name=lp.name, type='DummyData')
    dummy.top.extend(lp.top)
    if lp.HasField('phase'):
        dummy.phase = lp.phase
    for rule in lp.include:
        dummy.include.add().CopyFrom(rule)
    for rule in lp.exclude:
        dummy.exclude.add().CopyFrom(rule)
    dp = dummy.dummy_data_param
    for i, shape in enumerate(top_shapes):
        filler = dp.data_filler.add()
        if i == 0:
            filler.type = 'gaussian'
            filler.std = 1.0
        else:
            filler.type = 'constant'
            filler.value = 0.0
        dp.shape.add().dim.extend(shape)
    return dummy


def swap_data_layers(net_param, shapes=None, batch_size=None):
    """A copy of `net_param` with every data layer replaced by DummyData.

    net_param: a NetParameter (any format version) or a prototxt path.
    shapes: {top or layer name: shape}; batch_size: the batch for inferred
    shapes (default: each layer's own batch size)."""
    from caffeplus.io import upgrade
    if isinstance(net_param, (str, os.PathLike)):
        from caffeplus.io.prototxt import read_net_param
        param = read_net_param(os.fspath(net_param))
    else:
        param = caffe_pb2.NetParameter()
        param.CopyFrom(net_param)
        if upgrade.net_needs_upgrade(param):
            upgrade.upgrade_net_as_needed(param)
    for i, lp in enumerate(param.layer):
        if is_data_layer(lp):
            new = dummy_layer(lp, data_top_shapes(lp, shapes, batch_size))
            param.layer[i].CopyFrom(new)
    return param
