"""Classifier: a TEST net that takes images and returns class scores
(pycaffe's caffe.Classifier).

    net = caffeplus.Classifier('deploy.prototxt', 'weights.caffemodel',
                               mean=numpy.array([104, 117, 123]), raw_scale=255,
                               channel_swap=(2, 1, 0), image_dims=(256, 256))
    scores = net.predict([caffeplus.io.load_image('cat.jpg')])   # N x classes

predict() resizes each image to image_dims, takes ten crops of the net's
input size (corners, centre and their mirrors; oversample=True, the
default) or the centre crop, preprocesses them with the Transformer and
averages the scores of the ten crops.
"""
import numpy

from caffeplus import io as caffe_io
from caffeplus.errors import CaffeplusError
from caffeplus.net import TEST, Net


class Classifier(Net):
    def __init__(self, model_file, pretrained_file, image_dims=None, mean=None,
                 input_scale=None, raw_scale=None, channel_swap=None):
        Net.__init__(self, model_file, pretrained_file, TEST)
        from caffeplus.io.pycaffe_io import input_transformer
        self.transformer = input_transformer(self, 'Classifier', mean, input_scale, raw_scale,
                                             channel_swap)
        in_ = self.inputs[0]
        self.crop_dims = numpy.array(self.blobs[in_].data.shape[2:])
        if image_dims is None or len(image_dims) == 0:
            image_dims = self.crop_dims
        self.image_dims = numpy.array(image_dims)

    def predict(self, inputs, oversample=True):
        """Class scores (N x classes) of a list of H x W x K images."""
        inputs = list(inputs)
        if not inputs:
            raise CaffeplusError('Classifier.predict needs at least one image')
        channels = numpy.asarray(inputs[0]).shape[2]
        input_ = numpy.zeros((len(inputs), int(self.image_dims[0]), int(self.image_dims[1]),
                              channels), dtype=numpy.float32)
        for ix, in_ in enumerate(inputs):
            input_[ix] = caffe_io.resize_image(in_, self.image_dims)
        if oversample:
            input_ = caffe_io.oversample(input_, self.crop_dims)
        else:
            centre = numpy.array(self.image_dims) / 2.0
            crop = numpy.tile(centre, (1, 2))[0] + numpy.concatenate(
                [-self.crop_dims / 2.0, self.crop_dims / 2.0])
            crop = crop.astype(int)
            input_ = input_[:, crop[0]:crop[2], crop[1]:crop[3], :]
        in_name = self.inputs[0]
        caffe_in = numpy.zeros(numpy.array(input_.shape)[[0, 3, 1, 2]], dtype=numpy.float32)
        for ix, in_ in enumerate(input_):
            caffe_in[ix] = self.transformer.preprocess(in_name, in_)
        out = self.forward_all(**{in_name: caffe_in})
        predictions = out[self.outputs[0]]
        if oversample:
            predictions = predictions.reshape((len(predictions) // 10, 10, -1)).mean(1)
        return predictions
