"""Detector: score image windows with a classification net, R-CNN style
(pycaffe's caffe.Detector).

    det = caffeplus.Detector('deploy.prototxt', 'weights.caffemodel',
                             mean=numpy.array([104, 117, 123]), raw_scale=255,
                             channel_swap=(2, 1, 0), context_pad=16)
    dets = det.detect_windows([('img.jpg', numpy.array([[0, 0, 100, 120]]))])
    # [{'window': ..., 'prediction': scores, 'filename': 'img.jpg'}, ...]

Windows are (ymin, xmin, ymax, xmax) in pixels. With context_pad, each
window is enlarged so that, warped to the net's input size, it carries
context_pad pixels of surrounding image on each side; the parts outside the
image are filled with the mean (as R-CNN does).
"""
import numpy

from caffeplus import io as caffe_io
from caffeplus.errors import CaffeplusError
from caffeplus.net import TEST, Net


class Detector(Net):
    def __init__(self, model_file, pretrained_file, mean=None, input_scale=None,
                 raw_scale=None, channel_swap=None, context_pad=None):
        Net.__init__(self, model_file, pretrained_file, TEST)
        from caffeplus.io.pycaffe_io import input_transformer
        self.transformer = input_transformer(self, 'Detector', mean, input_scale, raw_scale,
                                             channel_swap)
        self.configure_crop(context_pad)

    def detect_windows(self, images_windows):
        """Scores for each window of each image: a list of dicts with the
        window, its prediction and the image file name, in input order."""
        images_windows = [(fname, numpy.asarray(windows)) for fname, windows in images_windows]
        window_inputs = []
        for image_fname, windows in images_windows:
            image = caffe_io.load_image(image_fname).astype(numpy.float32)
            for window in windows:
                window_inputs.append(self.crop(image, window))
        if not window_inputs:
            return []
        in_ = self.inputs[0]
        caffe_in = numpy.zeros((len(window_inputs), window_inputs[0].shape[2]) +
                               tuple(self.blobs[in_].data.shape[2:]), dtype=numpy.float32)
        for ix, window_in in enumerate(window_inputs):
            caffe_in[ix] = self.transformer.preprocess(in_, window_in)
        out = self.forward_all(**{in_: caffe_in})
        predictions = out[self.outputs[0]]
        if predictions.ndim == 4 and predictions.shape[2:] == (1, 1):
            predictions = predictions[:, :, 0, 0]
        detections = []
        ix = 0
        for image_fname, windows in images_windows:
            for window in windows:
                detections.append({'window': window, 'prediction': predictions[ix],
                                   'filename': image_fname})
                ix += 1
        return detections

    def detect_selective_search(self, image_fnames):
        raise CaffeplusError('detect_selective_search needs the selective_search_ijcv_with_python '
                             'package, which caffeplus does not bundle; compute the windows '
                             'yourself and call detect_windows')

    def crop(self, im, window):
        """The window of `im` (H x W x K), with context padding if configured."""
        window = numpy.asarray(window)
        crop = im[int(window[0]):int(window[2]), int(window[1]):int(window[3])]
        if not self.context_pad:
            return crop
        box = window.astype(numpy.float64)
        crop_size = self.blobs[self.inputs[0]].width   # square inputs, as R-CNN
        scale = crop_size / (1.0 * crop_size - self.context_pad * 2)
        half_h = (box[2] - box[0] + 1) / 2.0
        half_w = (box[3] - box[1] + 1) / 2.0
        centre = (box[0] + half_h, box[1] + half_w)
        scaled = scale * numpy.array((-half_h, -half_w, half_h, half_w))
        box = numpy.round(numpy.tile(centre, 2) + scaled)
        full_h = box[2] - box[0] + 1
        full_w = box[3] - box[1] + 1
        scale_h = crop_size / full_h
        scale_w = crop_size / full_w
        pad_y = int(round(max(0, -box[0]) * scale_h))
        pad_x = int(round(max(0, -box[1]) * scale_w))
        im_h, im_w = im.shape[:2]
        box = numpy.clip(box, 0.0, [im_h, im_w, im_h, im_w])
        clip_h = box[2] - box[0] + 1
        clip_w = box[3] - box[1] + 1
        if clip_h <= 0 or clip_w <= 0:
            raise CaffeplusError('window %s lies outside the %d x %d image'
                                 % (tuple(window), im_h, im_w))
        crop_h = int(round(clip_h * scale_h))
        crop_w = int(round(clip_w * scale_w))
        crop_h = min(crop_h, crop_size - pad_y)
        crop_w = min(crop_w, crop_size - pad_x)
        box = box.astype(int)
        context_crop = im[box[0]:box[2], box[1]:box[3]]
        context_crop = caffe_io.resize_image(context_crop, (crop_h, crop_w))
        out = numpy.ones(self.crop_dims, dtype=numpy.float32) * self.crop_mean
        out[pad_y:pad_y + crop_h, pad_x:pad_x + crop_w] = context_crop
        return out

    def configure_crop(self, context_pad):
        """Crop dimensions and, for context padding, the mean in image space."""
        in_ = self.inputs[0]
        transpose = self.transformer.transpose[in_]
        inverse = numpy.argsort(transpose)
        self.crop_dims = numpy.array(self.blobs[in_].data.shape[1:])[inverse]
        self.context_pad = context_pad
        if not self.context_pad:
            return
        channel_order = self.transformer.channel_swap.get(in_)
        raw_scale = self.transformer.raw_scale.get(in_)
        mean = self.transformer.mean.get(in_)
        if mean is None:
            self.crop_mean = numpy.zeros(self.crop_dims, dtype=numpy.float32)
            return
        crop_mean = numpy.array(mean, dtype=numpy.float32)
        if crop_mean.shape[1:] == (1, 1):
            crop_mean = numpy.broadcast_to(crop_mean, self.blobs[in_].data.shape[1:])
        crop_mean = numpy.array(crop_mean.transpose(inverse))
        if channel_order is not None:
            crop_mean = crop_mean[:, :, numpy.argsort(channel_order)]
        if raw_scale is not None:
            crop_mean /= raw_scale
        self.crop_mean = crop_mean
