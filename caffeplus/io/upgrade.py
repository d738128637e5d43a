"""Upgrades of old Caffe formats to the current one, as stock Caffe does them.

Stock Caffe (util/upgrade_proto) applies these steps, in this order, when it
reads a net; caffeplus applies the same ones with the same results and the
same log lines:

  1. V0 -> V1   `layers { layer { type: "conv" ... } }`: V0 padding layers are
                folded into the convolution (or pooling) that reads them, V0
                type strings become V1 enums and the flat V0 fields move into
                the per-type *_param messages (transform fields into
                transform_param).
  2. data       scale / mean_file / crop_size / mirror written inside
                data_param, image_data_param or window_data_param of DATA,
                IMAGE_DATA and WINDOW_DATA layers move to transform_param.
  3. V1 -> V2   `layers { type: CONVOLUTION }` becomes `layer { type:
                "Convolution" }`; blobs_lr, weight_decay, the `param` sharing
                names and blob_share_mode become `param { ... }` specs.
  4. input      the net's `input` / `input_dim` / `input_shape` fields become
                an Input layer named "input" at the start of the net.
  5. BatchNorm  a BatchNorm layer with exactly three `param` specs (the old
                way to freeze its statistics) gets lr_mult 0 and decay_mult 0
                on all three; names and share modes stay.

Solvers: the `solver_type` enum becomes the `type` string.

Where stock Caffe aborts (unknown V0 layer type, a padding layer feeding a
layer other than a convolution or pooling, ...) or logs an error and drops
information (a V0 field that means nothing for the layer's type, `layer`
and `layers` in one net, ...), caffeplus raises FormatError naming the
file, the layer and the field. `strict=False` instead logs Caffe's error
lines and carries on exactly as Caffe does (this is what `caffeplus upgrade
--keep-going` uses).

`message_to_text` prints a message the way Caffe's C++ TextFormat does
(`lr_mult: 1`, not Python's `lr_mult: 1.0`), so upgraded files match the
ones Caffe's upgrade_net_proto_text writes byte for byte.
"""
import math
import struct

from google.protobuf import descriptor
from google.protobuf import text_encoding

from caffeplus import log
from caffeplus.errors import FormatError
from caffeplus.proto import caffe_pb2

V1 = caffe_pb2.V1LayerParameter
V0 = caffe_pb2.V0LayerParameter

# V0 type strings and the V1 enum each becomes.
V0_LAYER_TYPES = {
    'accuracy': V1.ACCURACY,
    'bnll': V1.BNLL,
    'concat': V1.CONCAT,
    'conv': V1.CONVOLUTION,
    'data': V1.DATA,
    'dropout': V1.DROPOUT,
    'euclidean_loss': V1.EUCLIDEAN_LOSS,
    'flatten': V1.FLATTEN,
    'hdf5_data': V1.HDF5_DATA,
    'hdf5_output': V1.HDF5_OUTPUT,
    'im2col': V1.IM2COL,
    'images': V1.IMAGE_DATA,
    'infogain_loss': V1.INFOGAIN_LOSS,
    'innerproduct': V1.INNER_PRODUCT,
    'lrn': V1.LRN,
    'multinomial_logistic_loss': V1.MULTINOMIAL_LOGISTIC_LOSS,
    'pool': V1.POOLING,
    'relu': V1.RELU,
    'sigmoid': V1.SIGMOID,
    'softmax': V1.SOFTMAX,
    'softmax_loss': V1.SOFTMAX_LOSS,
    'split': V1.SPLIT,
    'tanh': V1.TANH,
    'window_data': V1.WINDOW_DATA,
}

# V1 enums and the V2 type string each becomes.
V1_LAYER_TYPES = {
    V1.NONE: '',
    V1.ABSVAL: 'AbsVal',
    V1.ACCURACY: 'Accuracy',
    V1.ARGMAX: 'ArgMax',
    V1.BNLL: 'BNLL',
    V1.CONCAT: 'Concat',
    V1.CONTRASTIVE_LOSS: 'ContrastiveLoss',
    V1.CONVOLUTION: 'Convolution',
    V1.DECONVOLUTION: 'Deconvolution',
    V1.DATA: 'Data',
    V1.DROPOUT: 'Dropout',
    V1.DUMMY_DATA: 'DummyData',
    V1.EUCLIDEAN_LOSS: 'EuclideanLoss',
    V1.ELTWISE: 'Eltwise',
    V1.EXP: 'Exp',
    V1.FLATTEN: 'Flatten',
    V1.HDF5_DATA: 'HDF5Data',
    V1.HDF5_OUTPUT: 'HDF5Output',
    V1.HINGE_LOSS: 'HingeLoss',
    V1.IM2COL: 'Im2col',
    V1.IMAGE_DATA: 'ImageData',
    V1.INFOGAIN_LOSS: 'InfogainLoss',
    V1.INNER_PRODUCT: 'InnerProduct',
    V1.LRN: 'LRN',
    V1.MEMORY_DATA: 'MemoryData',
    V1.MULTINOMIAL_LOGISTIC_LOSS: 'MultinomialLogisticLoss',
    V1.MVN: 'MVN',
    V1.POOLING: 'Pooling',
    V1.POWER: 'Power',
    V1.RELU: 'ReLU',
    V1.SIGMOID: 'Sigmoid',
    V1.SIGMOID_CROSS_ENTROPY_LOSS: 'SigmoidCrossEntropyLoss',
    V1.SILENCE: 'Silence',
    V1.SOFTMAX: 'Softmax',
    V1.SOFTMAX_LOSS: 'SoftmaxWithLoss',
    V1.SPLIT: 'Split',
    V1.SLICE: 'Slice',
    V1.TANH: 'TanH',
    V1.WINDOW_DATA: 'WindowData',
    V1.THRESHOLD: 'Threshold',
}

# The per-type messages a V1 layer carries over unchanged to V2 (same names
# in V1LayerParameter and LayerParameter).
V1_PARAM_MESSAGES = (
    'accuracy_param', 'argmax_param', 'concat_param', 'contrastive_loss_param',
    'convolution_param', 'data_param', 'dropout_param', 'dummy_data_param',
    'eltwise_param', 'exp_param', 'hdf5_data_param', 'hdf5_output_param',
    'hinge_loss_param', 'image_data_param', 'infogain_loss_param',
    'inner_product_param', 'lrn_param', 'memory_data_param', 'mvn_param',
    'pooling_param', 'power_param', 'relu_param', 'sigmoid_param',
    'softmax_param', 'slice_param', 'tanh_param', 'threshold_param',
    'window_data_param', 'transform_param', 'loss_param',
)

# Old solver_type enum values and the type strings they became.
SOLVER_TYPES = {
    caffe_pb2.SolverParameter.SGD: 'SGD',
    caffe_pb2.SolverParameter.NESTEROV: 'Nesterov',
    caffe_pb2.SolverParameter.ADAGRAD: 'AdaGrad',
    caffe_pb2.SolverParameter.RMSPROP: 'RMSProp',
    caffe_pb2.SolverParameter.ADADELTA: 'AdaDelta',
    caffe_pb2.SolverParameter.ADAM: 'Adam',
}

# V1 layer types whose *_param still may hold the legacy transform fields.
_DATA_UPGRADE_PARAMS = (
    (V1.DATA, 'data_param'),
    (V1.IMAGE_DATA, 'image_data_param'),
    (V1.WINDOW_DATA, 'window_data_param'),
)
_TRANSFORM_FIELDS = ('scale', 'mean_file', 'crop_size', 'mirror')


class _Problems:
    """Collects what Caffe would log as an error while upgrading.

    strict: raise FormatError at the first one; otherwise log Caffe's line
    and remember that the upgrade was not fully compatible.
    """

    def __init__(self, source, strict):
        self.source = source or '<net>'
        self.strict = strict
        self.ok = True

    def report(self, detail, caffe_line):
        if self.strict:
            raise FormatError('%s: %s' % (self.source, detail))
        log.error('%s', caffe_line)
        self.ok = False

    def fatal(self, detail):
        # Stock Caffe aborts here (LOG(FATAL) / CHECK); no way to go on.
        raise FormatError('%s: %s' % (self.source, detail))


def _layer_label(index, name):
    if name:
        return "layer '%s'" % name
    return 'layer #%d (unnamed)' % index


# ---------------------------------------------------------------------------
# What needs upgrading

def net_needs_v0_upgrade(param):
    return any(lp.HasField('layer') for lp in param.layers)


def net_needs_v1_upgrade(param):
    return len(param.layers) > 0


def net_needs_data_upgrade(param):
    for lp in param.layers:
        for v1_type, field in _DATA_UPGRADE_PARAMS:
            if lp.type == v1_type:
                sub = getattr(lp, field)
                if any(sub.HasField(f) for f in _TRANSFORM_FIELDS):
                    return True
    return False


def net_needs_input_upgrade(param):
    return len(param.input) > 0


def net_needs_batchnorm_upgrade(param):
    return any(lp.type == 'BatchNorm' and len(lp.param) == 3 for lp in param.layer)


def net_needs_upgrade(param):
    """True when the net is not in the current format (any step applies)."""
    return (net_needs_v0_upgrade(param) or net_needs_v1_upgrade(param)
            or net_needs_data_upgrade(param) or net_needs_input_upgrade(param)
            or net_needs_batchnorm_upgrade(param))


def solver_needs_upgrade(param):
    return param.HasField('solver_type')


# ---------------------------------------------------------------------------
# V0 -> V1

def upgrade_v0_padding_layers(param, problems=None):
    """A copy of the V0 net without "padding" layers: each one's pad moves to
    the convolution or pooling layer that reads its top, which then reads the
    padding layer's bottom instead."""
    problems = problems or _Problems('', True)
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    del out.layers[:]
    last_producer = {name: -1 for name in param.input}
    for i, conn in enumerate(param.layers):
        v0 = conn.layer
        if v0.type != 'padding':
            out.layers.add().CopyFrom(conn)
        for j, blob in enumerate(conn.bottom):
            if blob not in last_producer:
                problems.fatal("%s: unknown bottom blob '%s' (bottom %d): no earlier layer or "
                               "net input produces it"
                               % (_layer_label(i, v0.name), blob, j))
            src_idx = last_producer[blob]
            if src_idx == -1:
                continue
            src = param.layers[src_idx]
            if src.layer.type != 'padding':
                continue
            where = _layer_label(i, v0.name)
            if v0.type not in ('conv', 'pool'):
                problems.fatal("%s: field bottom: the padding layer '%s' feeds a layer of V0 type "
                               "'%s'; only 'conv' and 'pool' layers can take a padding layer's "
                               "output" % (where, src.layer.name, v0.type))
            if len(conn.bottom) != 1:
                problems.fatal('%s: field bottom: a layer fed by a padding layer must have '
                               'exactly one bottom, not %d' % (where, len(conn.bottom)))
            if len(src.bottom) != 1 or len(src.top) != 1:
                problems.fatal("layer '%s': a padding layer must have exactly one bottom and one "
                               "top (has %d and %d)"
                               % (src.layer.name, len(src.bottom), len(src.top)))
            target = out.layers[len(out.layers) - 1]
            target.layer.pad = src.layer.pad
            target.bottom[j] = src.bottom[0]
        for blob in conn.top:
            last_producer[blob] = i
    return out


def _v0_field_targets(v0_type):
    """{V0 field: (V1 sub-message, field in it, how)} valid for this V0 type.

    how: 'set' (scalar), 'add' (repeated), 'copy' (message)."""
    t = {}
    if v0_type == 'conv':
        t.update(num_output=('convolution_param', 'num_output', 'set'),
                 biasterm=('convolution_param', 'bias_term', 'set'),
                 weight_filler=('convolution_param', 'weight_filler', 'copy'),
                 bias_filler=('convolution_param', 'bias_filler', 'copy'),
                 pad=('convolution_param', 'pad', 'add'),
                 kernelsize=('convolution_param', 'kernel_size', 'add'),
                 group=('convolution_param', 'group', 'set'),
                 stride=('convolution_param', 'stride', 'add'))
    elif v0_type == 'innerproduct':
        t.update(num_output=('inner_product_param', 'num_output', 'set'),
                 biasterm=('inner_product_param', 'bias_term', 'set'),
                 weight_filler=('inner_product_param', 'weight_filler', 'copy'),
                 bias_filler=('inner_product_param', 'bias_filler', 'copy'))
    elif v0_type == 'pool':
        t.update(pad=('pooling_param', 'pad', 'set'),
                 kernelsize=('pooling_param', 'kernel_size', 'set'),
                 stride=('pooling_param', 'stride', 'set'),
                 pool=('pooling_param', 'pool', 'set'))
    elif v0_type == 'dropout':
        t.update(dropout_ratio=('dropout_param', 'dropout_ratio', 'set'))
    elif v0_type == 'lrn':
        t.update(local_size=('lrn_param', 'local_size', 'set'),
                 alpha=('lrn_param', 'alpha', 'set'),
                 beta=('lrn_param', 'beta', 'set'),
                 k=('lrn_param', 'k', 'set'))
    elif v0_type == 'data':
        t.update(source=('data_param', 'source', 'set'),
                 batchsize=('data_param', 'batch_size', 'set'),
                 rand_skip=('data_param', 'rand_skip', 'set'))
    elif v0_type == 'hdf5_data':
        t.update(source=('hdf5_data_param', 'source', 'set'),
                 batchsize=('hdf5_data_param', 'batch_size', 'set'))
    elif v0_type == 'images':
        t.update(source=('image_data_param', 'source', 'set'),
                 batchsize=('image_data_param', 'batch_size', 'set'),
                 rand_skip=('image_data_param', 'rand_skip', 'set'),
                 shuffle_images=('image_data_param', 'shuffle', 'set'),
                 new_height=('image_data_param', 'new_height', 'set'),
                 new_width=('image_data_param', 'new_width', 'set'))
    elif v0_type == 'window_data':
        t.update(source=('window_data_param', 'source', 'set'),
                 batchsize=('window_data_param', 'batch_size', 'set'),
                 det_fg_threshold=('window_data_param', 'fg_threshold', 'set'),
                 det_bg_threshold=('window_data_param', 'bg_threshold', 'set'),
                 det_fg_fraction=('window_data_param', 'fg_fraction', 'set'),
                 det_context_pad=('window_data_param', 'context_pad', 'set'),
                 det_crop_mode=('window_data_param', 'crop_mode', 'set'))
    elif v0_type == 'infogain_loss':
        t.update(source=('infogain_loss_param', 'source', 'set'))
    elif v0_type == 'concat':
        t.update(concat_dim=('concat_param', 'concat_dim', 'set'))
    elif v0_type == 'hdf5_output':
        t.update(hdf5_output_param=(None, 'hdf5_output_param', 'copy'))
    return t


# V0 fields in the order Caffe converts them (it logs problems in this order).
_V0_TYPED_FIELDS = (
    'num_output', 'biasterm', 'weight_filler', 'bias_filler', 'pad', 'kernelsize', 'group',
    'stride', 'pool', 'dropout_ratio', 'local_size', 'alpha', 'beta', 'k', 'source',
    'scale', 'meanfile', 'batchsize', 'cropsize', 'mirror', 'rand_skip', 'shuffle_images',
    'new_height', 'new_width', 'concat_dim', 'det_fg_threshold', 'det_bg_threshold',
    'det_fg_fraction', 'det_context_pad', 'det_crop_mode', 'hdf5_output_param',
)
# Transform fields that any V0 layer type may carry.
_V0_TRANSFORM = {'scale': 'scale', 'meanfile': 'mean_file', 'cropsize': 'crop_size',
                 'mirror': 'mirror'}
# Caffe's name for a field in its "Unknown parameter X" line (one differs).
_CAFFE_FIELD_WORD = {'shuffle_images': 'shuffle'}


def upgrade_v0_layer(conn, out, problems=None, index=0):
    """Fill V1LayerParameter `out` from the V0 layer connection `conn`."""
    problems = problems or _Problems('', True)
    out.Clear()
    out.bottom.extend(conn.bottom)
    out.top.extend(conn.top)
    if not conn.HasField('layer'):
        problems.report(
            '%s: a V1-style layer in a V0 net; only its bottoms and tops would survive the '
            'upgrade (write it as a V0 `layer { ... }` or upgrade the whole file to V1 first)'
            % _layer_label(index, conn.name),
            'Layer #%d has no V0 layer parameter; keeping only its bottoms and tops' % index)
        return out
    v0 = conn.layer
    where = _layer_label(index, v0.name)
    if v0.HasField('name'):
        out.name = v0.name
    v0_type = v0.type
    if v0.HasField('type'):
        if v0_type not in V0_LAYER_TYPES:
            problems.fatal("%s: field type: unknown V0 layer type '%s' (known: %s)"
                           % (where, v0_type, ', '.join(sorted(V0_LAYER_TYPES))))
        out.type = V0_LAYER_TYPES[v0_type]
    for blob in v0.blobs:
        out.blobs.add().CopyFrom(blob)
    out.blobs_lr.extend(v0.blobs_lr)
    out.weight_decay.extend(v0.weight_decay)
    targets = _v0_field_targets(v0_type)
    for field in _V0_TYPED_FIELDS:
        if not v0.HasField(field):
            continue
        value = getattr(v0, field)
        if field in _V0_TRANSFORM:
            setattr(out.transform_param, _V0_TRANSFORM[field], value)
            continue
        if field not in targets:
            problems.report(
                "%s: V0 field '%s' has no meaning for V0 layer type '%s'; stock Caffe drops it"
                % (where, field, v0_type),
                'Unknown parameter %s for layer type %s'
                % (_CAFFE_FIELD_WORD.get(field, field), v0_type))
            continue
        sub_name, name, how = targets[field]
        sub = getattr(out, sub_name) if sub_name else out
        if how == 'copy':
            getattr(sub, name).CopyFrom(value)
        elif how == 'add':
            getattr(sub, name).append(value)
        else:
            if field == 'pool':
                # Same numbers in both enums (MAX, AVE, STOCHASTIC).
                value = caffe_pb2.PoolingParameter.PoolMethod.Value(V0.PoolMethod.Name(value))
            setattr(sub, name, value)
    return out


def upgrade_v0_net(param, problems=None):
    """A V1 NetParameter (in `layers`) from a V0 one."""
    problems = problems or _Problems('', True)
    # Caffe keeps only name, layers, input, input_dim and force_backward of a
    # V0 net; say so where that silently loses a net's content.
    for field in ('layer', 'input_shape'):
        if len(getattr(param, field)):
            problems.report("net field %s: a V0 net cannot also use '%s'; stock Caffe's V0 "
                            "upgrade drops it" % (field, field),
                            "V0 net also specifies '%s'; it is dropped by the V0 upgrade"
                            % field)
    padded = upgrade_v0_padding_layers(param, problems)
    out = caffe_pb2.NetParameter()
    if padded.HasField('name'):
        out.name = padded.name
    for i, conn in enumerate(padded.layers):
        upgrade_v0_layer(conn, out.layers.add(), problems, i)
    out.input.extend(padded.input)
    out.input_dim.extend(padded.input_dim)
    if padded.HasField('force_backward'):
        out.force_backward = padded.force_backward
    return out


# ---------------------------------------------------------------------------
# Data transformation fields

def upgrade_net_data_transformation(param):
    """Move legacy transform fields of V1 data layers into transform_param."""
    for lp in param.layers:
        for v1_type, field in _DATA_UPGRADE_PARAMS:
            if lp.type != v1_type:
                continue
            sub = getattr(lp, field)
            for name in _TRANSFORM_FIELDS:
                if sub.HasField(name):
                    setattr(lp.transform_param, name, getattr(sub, name))
                    sub.ClearField(name)
    return param


# ---------------------------------------------------------------------------
# V1 -> V2

def upgrade_v1_layer_type(v1_type, where='layer'):
    try:
        return V1_LAYER_TYPES[v1_type]
    except KeyError:
        raise FormatError('%s: field type: unknown V1 layer type enum value %d'
                          % (where, v1_type))


def upgrade_v1_layer(v1, out, problems=None, index=0):
    """Fill LayerParameter `out` from V1LayerParameter `v1`."""
    problems = problems or _Problems('', True)
    where = _layer_label(index, v1.name)
    out.Clear()
    out.bottom.extend(v1.bottom)
    out.top.extend(v1.top)
    if v1.HasField('name'):
        out.name = v1.name
    for rule in v1.include:
        out.include.add().CopyFrom(rule)
    for rule in v1.exclude:
        out.exclude.add().CopyFrom(rule)
    if v1.HasField('type'):
        out.type = upgrade_v1_layer_type(v1.type, '%s: %s' % (problems.source, where))
    for blob in v1.blobs:
        out.blobs.add().CopyFrom(blob)

    def spec(i):
        while len(out.param) <= i:
            out.param.add()
        return out.param[i]

    for i, name in enumerate(v1.param):
        spec(i).name = name
    for i, mode in enumerate(v1.blob_share_mode):
        if mode not in (V1.STRICT, V1.PERMISSIVE):
            problems.fatal('%s: field blob_share_mode: unknown value %d' % (where, mode))
        spec(i).share_mode = caffe_pb2.ParamSpec.DimCheckMode.Value(V1.DimCheckMode.Name(mode))
    for i, lr in enumerate(v1.blobs_lr):
        spec(i).lr_mult = lr
    for i, decay in enumerate(v1.weight_decay):
        spec(i).decay_mult = decay
    out.loss_weight.extend(v1.loss_weight)
    for name in V1_PARAM_MESSAGES:
        if v1.HasField(name):
            getattr(out, name).CopyFrom(getattr(v1, name))
    if v1.HasField('layer'):
        problems.report('%s: field layer: a V0 layer inside a V1 net; it is ignored' % where,
                        'Input NetParameter has V0 layer -- ignoring.')
    return out


def upgrade_v1_net(param, problems=None):
    """A NetParameter with `layer` from one with V1 `layers`."""
    problems = problems or _Problems('', True)
    if len(param.layer) > 0:
        problems.report(
            "the net has both 'layer' (current) and 'layers' (V1) entries; stock Caffe's "
            "upgrade drops the %d 'layer' entries (first: '%s'); write all layers in one format"
            % (len(param.layer), param.layer[0].name),
            "Input NetParameter to be upgraded already specifies 'layer' fields; these will "
            "be ignored for the upgrade.")
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    del out.layers[:]
    del out.layer[:]
    for i, v1 in enumerate(param.layers):
        before = problems.ok
        upgrade_v1_layer(v1, out.layer.add(), problems, i)
        if before and not problems.ok:
            log.error('Upgrade of input layer %d failed.', i)
    return out


# ---------------------------------------------------------------------------
# input fields -> Input layer

def upgrade_net_input(param, problems=None):
    """Turn the net's input fields into an Input layer named "input" placed
    first; inputs without any shape (old caffemodels) are simply dropped."""
    problems = problems or _Problems('', True)
    has_shape = len(param.input_shape) > 0
    has_dim = len(param.input_dim) > 0
    if has_shape or has_dim:
        n = len(param.input)
        if has_shape and len(param.input_shape) < n:
            problems.fatal('net field input_shape: %d input(s) but only %d input_shape(s)'
                           % (n, len(param.input_shape)))
        if not has_shape and len(param.input_dim) < 4 * n:
            problems.fatal('net field input_dim: %d input(s) need %d input_dim values (4 '
                           'each), found %d' % (n, 4 * n, len(param.input_dim)))
        layer = caffe_pb2.LayerParameter(name='input', type='Input')
        for i, name in enumerate(param.input):
            layer.top.append(name)
            shape = layer.input_param.shape.add()
            if has_shape:
                shape.CopyFrom(param.input_shape[i])
            else:
                shape.dim.extend(param.input_dim[4 * i:4 * i + 4])
        layers = [caffe_pb2.LayerParameter() for _ in param.layer]
        for copy, lp in zip(layers, param.layer):
            copy.CopyFrom(lp)
        del param.layer[:]
        param.layer.add().CopyFrom(layer)
        for lp in layers:
            param.layer.add().CopyFrom(lp)
    param.ClearField('input')
    param.ClearField('input_shape')
    param.ClearField('input_dim')
    return param


# ---------------------------------------------------------------------------
# BatchNorm

def upgrade_net_batchnorm(param):
    for lp in param.layer:
        if lp.type == 'BatchNorm' and len(lp.param) == 3:
            for spec in lp.param:
                spec.lr_mult = 0.0
                spec.decay_mult = 0.0
    return param


# ---------------------------------------------------------------------------
# The whole net

def _replace(param, new):
    if new is not param:
        param.Clear()
        param.CopyFrom(new)


def upgrade_net(param, source='', strict=True):
    """Upgrade `param` in place; returns True when nothing was lost (always
    True with strict=True, which raises FormatError instead)."""
    problems = _Problems(source, strict)
    if net_needs_v0_upgrade(param):
        log.info('Attempting to upgrade input file specified using deprecated '
                 'V0LayerParameter: %s', source)
        before = problems.ok
        problems.ok = True
        _replace(param, upgrade_v0_net(param, problems))
        if problems.ok:
            log.info('Successfully upgraded file specified using deprecated V0LayerParameter')
        else:
            log.error('Warning: had one or more problems upgrading V0NetParameter to '
                      'NetParameter (see above); continuing anyway.')
        problems.ok = problems.ok and before
        # Caffe's note names its own tools; here the one command that does both.
        log.warning('Note that future Caffe releases will not support V0NetParameter; use '
                    '`caffeplus upgrade OLD NEW` (prototxt nets and .caffemodel weights) to '
                    'upgrade this and any other net protos to the new format.')
    if net_needs_data_upgrade(param):
        log.info('Attempting to upgrade input file specified using deprecated '
                 'transformation parameters: %s', source)
        upgrade_net_data_transformation(param)
        log.info('Successfully upgraded file specified using deprecated data transformation '
                 'parameters.')
        log.warning('Note that future Caffe releases will only support transform_param '
                    'messages for transformation fields.')
    if net_needs_v1_upgrade(param):
        log.info('Attempting to upgrade input file specified using deprecated '
                 'V1LayerParameter: %s', source)
        before = problems.ok
        problems.ok = True
        _replace(param, upgrade_v1_net(param, problems))
        if problems.ok:
            log.info('Successfully upgraded file specified using deprecated V1LayerParameter')
        else:
            log.error('Warning: had one or more problems upgrading V1LayerParameter (see '
                      'above); continuing anyway.')
        problems.ok = problems.ok and before
    if net_needs_input_upgrade(param):
        log.info('Attempting to upgrade input file specified using deprecated input fields: '
                 '%s', source)
        upgrade_net_input(param, problems)
        log.info('Successfully upgraded file specified using deprecated input fields.')
        log.warning('Note that future Caffe releases will only support input layers and not '
                    'input fields.')
    if net_needs_batchnorm_upgrade(param):
        log.info('Attempting to upgrade batch norm layers using deprecated params: %s', source)
        upgrade_net_batchnorm(param)
        log.info('Successfully upgraded batch norm layers using deprecated params.')
    return problems.ok


def upgrade_net_as_needed(param, source='', strict=True):
    """Upgrade a NetParameter in place to the current format and return it."""
    upgrade_net(param, source, strict)
    return param


# ---------------------------------------------------------------------------
# Solvers

def upgrade_solver_type(param, source=''):
    """solver_type enum -> type string. Returns False if nothing to do."""
    if not param.HasField('solver_type'):
        log.error('Warning: solver type already up to date. ')
        return False
    if param.HasField('type'):
        raise FormatError(
            "%s: the solver sets both the old field solver_type (%s) and the new field type "
            "('%s'); keep only `type`"
            % (source or '<solver>', caffe_pb2.SolverParameter.SolverType.Name(param.solver_type),
               param.type))
    try:
        new = SOLVER_TYPES[param.solver_type]
    except KeyError:
        raise FormatError('%s: field solver_type: unknown value %d'
                          % (source or '<solver>', param.solver_type))
    param.type = new
    param.ClearField('solver_type')
    return True


def upgrade_solver(param, source=''):
    """Upgrade a SolverParameter in place; True if it went well."""
    ok = True
    if solver_needs_upgrade(param):
        log.info("Attempting to upgrade input file specified using deprecated 'solver_type' "
                 "field (enum)': %s", source)
        if not upgrade_solver_type(param, source):
            ok = False
            log.error('Warning: had one or more problems upgrading SolverType (see above).')
        else:
            log.info("Successfully upgraded file specified using deprecated 'solver_type' "
                     "field (enum) to 'type' field (string).")
            log.warning("Note that future Caffe releases will only support 'type' field "
                        "(string) for a solver's type.")
    return ok


def upgrade_solver_as_needed(param, source=''):
    upgrade_solver(param, source)
    return param


# ---------------------------------------------------------------------------
# Text output as Caffe's C++ TextFormat writes it

def _float_text(value, digits, pack):
    if math.isnan(value):
        return 'nan'
    if math.isinf(value):
        return 'inf' if value > 0 else '-inf'
    text = '%.*g' % (digits, value)
    if pack(float(text)) != pack(value):
        text = '%.*g' % (digits + 3, value)
    return text


def _pack_float(v):
    try:
        return struct.pack('<f', v)
    except OverflowError:
        return None


def _pack_double(v):
    return struct.pack('<d', v)


def _scalar_text(field, value):
    fd = descriptor.FieldDescriptor
    ct = field.cpp_type
    if ct == fd.CPPTYPE_STRING:
        if field.type == fd.TYPE_BYTES or isinstance(value, bytes):
            # (protobuf hands a proto2 string field that is not valid UTF-8,
            # as read from a binary file, back as bytes)
            return '"%s"' % text_encoding.CEscape(value, as_utf8=False)
        return '"%s"' % text_encoding.CEscape(value.encode('utf-8'), as_utf8=False)
    if ct == fd.CPPTYPE_BOOL:
        return 'true' if value else 'false'
    if ct == fd.CPPTYPE_ENUM:
        ev = field.enum_type.values_by_number.get(value)
        return ev.name if ev is not None else str(value)
    if ct == fd.CPPTYPE_FLOAT:
        return _float_text(value, 6, _pack_float)
    if ct == fd.CPPTYPE_DOUBLE:
        return _float_text(value, 15, _pack_double)
    return str(value)


def _is_repeated(field):
    flag = getattr(field, 'is_repeated', None)
    if flag is None:  # protobuf < 5.29 has only `label`
        return field.label == field.LABEL_REPEATED
    return flag


# field descriptor -> (repeated, is a message); printing a net's text is in
# every build's log, and asking the descriptor each time was half its cost.
_FIELD_KIND = {}


def _field_kind(field):
    kind = _FIELD_KIND.get(field)
    if kind is None:
        kind = _FIELD_KIND[field] = (_is_repeated(field),
                                     field.cpp_type == field.CPPTYPE_MESSAGE)
    return kind


def _print_message(message, indent, lines):
    pad = '  ' * indent
    for field, value in message.ListFields():
        repeated, is_message = _field_kind(field)
        name = field.name
        for v in (value if repeated else (value,)):
            if is_message:
                lines.append('%s%s {' % (pad, name))
                _print_message(v, indent + 1, lines)
                lines.append(pad + '}')
            elif type(v) is str and field.type != field.TYPE_BYTES and v.isascii() \
                    and v.isprintable() and '"' not in v and '\\' not in v \
                    and "'" not in v:
                lines.append('%s%s: "%s"' % (pad, name, v))      # nothing to escape
            else:
                lines.append('%s%s: %s' % (pad, name, _scalar_text(field, v)))


def message_to_text(message):
    """Text format as Caffe's WriteProtoToTextFile writes it."""
    lines = []
    _print_message(message, 0, lines)
    return ''.join(line + '\n' for line in lines)
