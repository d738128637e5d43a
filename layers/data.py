"""Data layers: Input, DummyData (more join them here)."""
import numpy

from caffeplus.errors import NetError
from caffeplus.fillers import fill_array
from caffeplus.layer import Layer, register
from caffeplus.proto import caffe_pb2


@register
class InputLayer(Layer):
    """Net inputs: tops of fixed shape that the user fills."""
    type = 'Input'
    exact_num_bottom = 0
    min_num_top = 1
    has_backward = False

    def layer_setup(self, bottom, top):
        shapes = self.layer_param.input_param.shape
        if len(shapes) not in (1, len(top)):
            raise NetError('layer %s: input_param must give one shape, or one per top '
                           '(%d shapes for %d tops)' % (self.name, len(shapes), len(top)))
        for i, t in enumerate(top):
            t.reshape(tuple(shapes[0 if len(shapes) == 1 else i].dim))

    def reshape(self, bottom, top):
        pass

    def _forward(self, bottom, top):
        pass

    def _backward(self, top, propagate_down, bottom):
        pass


@register
class DummyDataLayer(Layer):
    """Tops filled by fillers; constant fillers are filled once (as Caffe)."""
    type = 'DummyData'
    exact_num_bottom = 0
    min_num_top = 1
    has_backward = False

    def layer_setup(self, bottom, top):
        p = self.layer_param.dummy_data_param
        num_top = len(top)
        legacy = len(p.num) or len(p.channels) or len(p.height) or len(p.width)
        if legacy:
            if len(p.shape):
                raise NetError('layer %s: both shape and num/channels/height/width given'
                               % self.name)
            for field in ('num', 'channels', 'height', 'width'):
                if len(getattr(p, field)) not in (1, num_top):
                    raise NetError('layer %s: dummy_data_param.%s must be given once or once '
                                   'per top' % (self.name, field))
            pick = lambda f, i: getattr(p, f)[0 if len(getattr(p, f)) == 1 else i]
            shapes = [(pick('num', i), pick('channels', i), pick('height', i), pick('width', i))
                      for i in range(num_top)]
        else:
            if len(p.shape) not in (1, num_top):
                raise NetError('layer %s: dummy_data_param.shape must be given once or once '
                               'per top (%d for %d tops)' % (self.name, len(p.shape), num_top))
            shapes = [tuple(p.shape[0 if len(p.shape) == 1 else i].dim) for i in range(num_top)]
        if len(p.data_filler) not in (0, 1, num_top):
            raise NetError('layer %s: dummy_data_param.data_filler must be given 0, 1 or once '
                           'per top times' % self.name)
        default = caffe_pb2.FillerParameter(type='constant', value=0)
        self.fillers = [p.data_filler[0 if len(p.data_filler) == 1 else i]
                        if len(p.data_filler) else default for i in range(num_top)]
        self.refill = [f.type != 'constant' for f in self.fillers]
        for t, shape, f in zip(top, shapes, self.fillers):
            t.reshape(shape)
            t.data = fill_array(f, shape)

    def reshape(self, bottom, top):
        pass

    def _forward(self, bottom, top):
        for t, f, refill in zip(top, self.fillers, self.refill):
            if refill:
                t.data = fill_array(f, t.shape)

    def _backward(self, top, propagate_down, bottom):
        pass
