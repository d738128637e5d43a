"""NetSpec: write nets in Python, as pycaffe's caffe.net_spec.

    from caffeplus import layers as L, params as P
    n = caffeplus.NetSpec()
    n.data, n.label = L.Data(source='train_lmdb', backend=P.Data.LMDB, batch_size=64,
                             transform_param=dict(scale=1. / 255), ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20,
                            weight_filler=dict(type='xavier'))
    n.relu1 = L.ReLU(n.conv1, in_place=True)
    n.loss = L.SoftmaxWithLoss(n.conv1, n.label)
    text = str(n.to_proto())

pycaffe's rules, which this module keeps:
  * `L.<Type>(*bottoms, **params)` makes a layer of that type; it returns its
    top (one), a tuple of tops (`ntop=k`), or the layer itself (`ntop=0`).
    `in_place=True` makes the tops the bottoms.
  * Keyword arguments: a name ending in `param` is a field of
    LayerParameter (transform_param=dict(...), loss_param=...); other names
    are looked up in the type's own parameter message (Convolution ->
    convolution_param, InnerProduct -> inner_product_param), falling back to
    LayerParameter itself (include=..., loss_weight=..., param=[...]).
    Lists fill repeated fields (a list of dicts adds messages); a scalar
    given to a repeated field becomes a one-element list; dicts fill nested
    messages; enum fields take values (P.Pooling.MAX) or their names ('MAX').
  * Names: a top takes the NetSpec attribute name it was assigned to; a
    layer takes the name of its first top; anything unnamed is called
    <Type><n> (Convolution1, ...), counting per type.
`P.<Type>.<ENUM>` reads enum values of caffe_pb2.<Type>Parameter.
"""
import collections

import numpy
from google.protobuf import descriptor

from caffeplus.errors import CaffeplusError
from caffeplus.proto import caffe_pb2

_FD = descriptor.FieldDescriptor
# Types that take a parameter message named after another type.
_SHARED_PARAMS = {
    'Deconvolution': 'convolution',
    'Im2col': 'convolution',
    'SoftmaxWithLoss': 'softmax',
    'ImageData': 'image_data',
}


def param_name_dict():
    """Layer type name -> the prefix of its parameter field, from the schema:
    'InnerProduct' -> 'inner_product' (InnerProductParameter, inner_product_param)."""
    out = {}
    for field in caffe_pb2.LayerParameter.DESCRIPTOR.fields:
        if field.name.endswith('_param') and field.message_type is not None:
            type_name = field.message_type.name
            if type_name.endswith('Parameter'):
                out[type_name[:-len('Parameter')]] = field.name[:-len('_param')]
    return out


_param_names = param_name_dict()


class NetSpecError(CaffeplusError, AttributeError):
    """A NetSpec parameter that does not fit the schema."""


class NetSpecInputError(CaffeplusError, TypeError):
    """A layer function given a bottom that no layer function made."""


def _repeated(field):
    is_repeated = getattr(field, 'is_repeated', None)
    if is_repeated is not None:           # protobuf >= 5.29 (label is gone in 7)
        return bool(is_repeated)
    return field.label == _FD.LABEL_REPEATED


def assign_proto(proto, name, value):
    """Set field `name` of message `proto` from a Python value, pycaffe's way."""
    field = proto.DESCRIPTOR.fields_by_name.get(name)
    if field is None:
        raise NetSpecError("%s has no field '%s'" % (proto.DESCRIPTOR.name, name))
    if isinstance(value, numpy.ndarray):
        value = value.tolist()
    if _repeated(field) and not isinstance(value, (list, tuple)):
        value = [value]
    try:
        if isinstance(value, (list, tuple)):
            container = getattr(proto, name)
            if field.type == _FD.TYPE_MESSAGE:
                for item in value:
                    if isinstance(item, dict):
                        msg = container.add()
                        for k, v in item.items():
                            assign_proto(msg, k, v)
                    else:
                        container.add().CopyFrom(item)
            else:
                container.extend(_scalar(field, v) for v in value)
        elif isinstance(value, dict):
            if field.type != _FD.TYPE_MESSAGE:
                raise NetSpecError('%s.%s is not a message; it cannot take a dict'
                                   % (proto.DESCRIPTOR.name, name))
            msg = getattr(proto, name)
            msg.SetInParent()
            for k, v in value.items():
                assign_proto(msg, k, v)
        elif field.type == _FD.TYPE_MESSAGE:
            getattr(proto, name).CopyFrom(value)
        else:
            setattr(proto, name, _scalar(field, value))
    except NetSpecError:
        raise
    except (TypeError, ValueError) as exc:
        raise NetSpecError('cannot set %s.%s to %r: %s' % (proto.DESCRIPTOR.name, name,
                                                             value, exc))


def _scalar(field, value):
    if field.type == _FD.TYPE_ENUM and isinstance(value, str):
        enum = field.enum_type.values_by_name.get(value)
        if enum is None:
            raise NetSpecError("'%s' is not a value of %s (values: %s)"
                               % (value, field.enum_type.name,
                                  ', '.join(field.enum_type.values_by_name)))
        return enum.number
    if field.type in (_FD.TYPE_FLOAT, _FD.TYPE_DOUBLE):
        return float(value)
    if field.type in (_FD.TYPE_INT32, _FD.TYPE_INT64, _FD.TYPE_UINT32, _FD.TYPE_UINT64,
                      _FD.TYPE_SINT32, _FD.TYPE_SINT64, _FD.TYPE_FIXED32, _FD.TYPE_FIXED64,
                      _FD.TYPE_SFIXED32, _FD.TYPE_SFIXED64):
        if isinstance(value, float):
            if value != int(value):
                raise NetSpecError('%s needs an integer, got %r' % (field.name, value))
        return int(value)
    if field.type == _FD.TYPE_BOOL:
        return bool(value)
    if field.type == _FD.TYPE_BYTES and isinstance(value, str):
        return value.encode('utf-8')
    if field.type == _FD.TYPE_ENUM:
        return int(value)
    return value


class Top:
    """One output of a layer function: the thing layers take as bottoms."""

    def __init__(self, fn, n):
        self.fn = fn
        self.n = n

    def to_proto(self):
        """A NetParameter holding this top and everything it depends on."""
        return to_proto(self)

    def _update(self, params):
        self.fn._update(params)

    def _to_proto(self, layers, names, autonames):
        return self.fn._to_proto(layers, names, autonames)

    def __repr__(self):
        return '<Top %d of %s>' % (self.n, self.fn.type_name)


class Function:
    """A layer in the making: its type, its bottoms and its parameters."""

    def __init__(self, type_name, inputs, params):
        self.type_name = type_name
        for i, inp in enumerate(inputs):
            if not isinstance(inp, Top):
                # pycaffe's TypeError and message
                raise NetSpecInputError('%s input %d is not a Top (type is %s)'
                                        % (type_name, i, type(inp)))
        self.inputs = inputs
        self.params = dict(params)
        self.ntop = self.params.pop('ntop', 1)
        self.in_place = self.params.pop('in_place', False)
        self.tops = tuple(Top(self, n) for n in range(self.ntop))

    def _get_name(self, names, autonames):
        if self not in names and self.ntop > 0:
            names[self] = self._get_top_name(self.tops[0], names, autonames)
        elif self not in names:
            autonames[self.type_name] += 1
            names[self] = self.type_name + str(autonames[self.type_name])
        return names[self]

    def _get_top_name(self, top, names, autonames):
        if top not in names:
            autonames[top.fn.type_name] += 1
            names[top] = top.fn.type_name + str(autonames[top.fn.type_name])
        return names[top]

    def _update(self, params):
        self.params.update(params)

    def _to_proto(self, layers, names, autonames):
        if self in layers:
            return
        bottom_names = []
        for inp in self.inputs:
            inp._to_proto(layers, names, autonames)
            bottom_names.append(layers[inp.fn].top[inp.n])
        layer = caffe_pb2.LayerParameter()
        layer.type = self.type_name
        layer.bottom.extend(bottom_names)
        if self.in_place:
            layer.top.extend(layer.bottom)
        else:
            for top in self.tops:
                layer.top.append(self._get_top_name(top, names, autonames))
        layer.name = self._get_name(names, autonames)
        for key, value in self.params.items():
            self._assign(layer, key, value)
        layers[self] = layer

    def _assign(self, layer, key, value):
        if key.endswith('param'):
            assign_proto(layer, key, value)
            return
        prefixes = []
        if self.type_name in _param_names:
            prefixes.append(_param_names[self.type_name])
        if self.type_name in _SHARED_PARAMS:
            prefixes.append(_SHARED_PARAMS[self.type_name])
        if self.type_name in ('SoftmaxWithLoss',) or self.type_name.endswith('Loss'):
            prefixes.append('loss')
        for prefix in prefixes:
            msg = getattr(layer, prefix + '_param')
            if key in msg.DESCRIPTOR.fields_by_name:
                assign_proto(msg, key, value)
                return
        if key in layer.DESCRIPTOR.fields_by_name:
            assign_proto(layer, key, value)
            return
        where = ', '.join('%s_param' % p for p in prefixes) or 'no parameter message'
        raise NetSpecError("L.%s: unknown parameter '%s' (not a field of %s nor of "
                           "LayerParameter)" % (self.type_name, key, where))


class NetSpec:
    """Named tops, assigned as attributes (n.conv1 = L.Convolution(...)) or
    items (n['conv1'] = ...); to_proto() gives the NetParameter."""

    def __init__(self):
        super().__setattr__('tops', collections.OrderedDict())

    def __setattr__(self, name, value):
        self.tops[name] = value

    def __getattr__(self, name):
        try:
            return self.tops[name]
        except KeyError:
            raise AttributeError("NetSpec has no top named '%s'" % name)

    def __setitem__(self, key, value):
        self.__setattr__(key, value)

    def __getitem__(self, item):
        return self.__getattr__(item)

    def __delitem__(self, name):
        del self.tops[name]

    def __contains__(self, name):
        return name in self.tops

    def keys(self):
        return list(self.tops.keys())

    def vals(self):
        return list(self.tops.values())

    def to_proto(self):
        names = {v: k for k, v in self.tops.items()}
        autonames = collections.Counter()
        layers = collections.OrderedDict()
        for name, top in self.tops.items():
            top._to_proto(layers, names, autonames)
        net = caffe_pb2.NetParameter()
        net.layer.extend(layers.values())
        return net


def to_proto(*tops):
    """A NetParameter with the given tops and all the layers they need."""
    layers = collections.OrderedDict()
    autonames = collections.Counter()
    for top in tops:
        fn = top if isinstance(top, Function) else top.fn    # ntop=0 layers too
        fn._to_proto(layers, {}, autonames)
    net = caffe_pb2.NetParameter()
    net.layer.extend(layers.values())
    return net


class Layers:
    """`L.<Type>(...)`: a function that makes a layer of that type."""

    def __getattr__(self, name):
        if name.startswith('__'):
            raise AttributeError(name)

        def layer_fn(*args, **kwargs):
            fn = Function(name, args, kwargs)
            if fn.ntop == 0:
                return fn
            if fn.ntop == 1:
                return fn.tops[0]
            return fn.tops
        layer_fn.__name__ = name
        return layer_fn


class _EnumValues:
    def __init__(self, type_name):
        self._type_name = type_name

    def __getattr__(self, name):
        if name.startswith('__'):
            raise AttributeError(name)
        message = getattr(caffe_pb2, self._type_name + 'Parameter', None)
        if message is None:
            raise AttributeError('caffe_pb2 has no %sParameter' % self._type_name)
        try:
            return getattr(message, name)
        except AttributeError:
            raise AttributeError('%sParameter has no %s' % (self._type_name, name))


class Parameters:
    """`P.<Type>.<NAME>`: enum values of <Type>Parameter (P.Pooling.MAX)."""

    def __getattr__(self, name):
        if name.startswith('__'):
            raise AttributeError(name)
        return _EnumValues(name)


layers = Layers()
params = Parameters()
