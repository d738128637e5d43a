"""pycaffe's caffe.io: images in, network inputs out, and the proto helpers.

    im = caffeplus.io.load_image('cat.jpg')            # H x W x 3 RGB float32 in [0, 1]
    t = caffeplus.io.Transformer({'data': net.blobs['data'].data.shape})
    t.set_transpose('data', (2, 0, 1))                  # H x W x C -> C x H x W
    t.set_channel_swap('data', (2, 1, 0))               # RGB -> BGR
    t.set_raw_scale('data', 255)                        # [0, 1] -> [0, 255]
    t.set_mean('data', numpy.array([104, 117, 123]))
    net.blobs['data'].data[...] = t.preprocess('data', im)

Images are read with Pillow as scikit-image reads them in pycaffe: floats in
[0, 1], RGB, H x W x C (color=False gives H x W x 1 with scikit-image's grey
weights 0.2125/0.7154/0.0721). resize_image interpolates with NumPy:
nearest (interp_order 0) or bilinear (1) with pixel centres aligned and the
edge replicated; scikit-image's Gaussian anti-aliasing before a downscale is
not applied. Other orders use scipy.ndimage when SciPy is installed.
"""
import numpy

from caffeplus.errors import CaffeplusError, FormatError
from caffeplus.io import blobproto as _blobproto
from caffeplus.io.blobproto import array_to_blobproto  # noqa: F401
from caffeplus.io.datum import array_to_datum, datum_to_array  # noqa: F401
from caffeplus.proto import caffe_pb2

__all__ = ['Transformer', 'load_image', 'resize_image', 'oversample', 'array_to_blobproto',
           'blobproto_to_array', 'arraylist_to_blobprotovector_str',
           'blobprotovector_str_to_arraylist', 'array_to_datum', 'datum_to_array',
           'caffe_pb2']

# scikit-image's rgb2gray weights (ITU-R BT.709), which pycaffe's load_image uses.
_GRAY_WEIGHTS = numpy.array([0.2125, 0.7154, 0.0721])


# -- proto helpers -------------------------------------------------------------
def blobproto_to_array(blob, return_diff=False):
    """The data (or diff) of a BlobProto as an array of its shape, float64
    as stock pycaffe gives it (NumPy over the proto's repeated floats); the
    values are the stored float32 ones. caffeplus's own readers keep float32
    (caffeplus.io.blobproto)."""
    return _blobproto.blobproto_to_array(blob, return_diff).astype(numpy.float64)


def arraylist_to_blobprotovector_str(arraylist):
    """Serialized BlobProtoVector of a list of arrays."""
    vec = caffe_pb2.BlobProtoVector()
    for arr in arraylist:
        vec.blobs.add().CopyFrom(array_to_blobproto(arr))
    return vec.SerializeToString()


def blobprotovector_str_to_arraylist(s):
    """The arrays of a serialized BlobProtoVector."""
    vec = caffe_pb2.BlobProtoVector()
    try:
        vec.ParseFromString(bytes(s))
    except Exception as exc:
        raise FormatError('not a serialized BlobProtoVector: %s' % exc)
    return [blobproto_to_array(b) for b in vec.blobs]


# -- images ----------------------------------------------------------------------
def _pil_image(filename):
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow is a dependency
        raise CaffeplusError('load_image needs Pillow (pip install Pillow)')
    try:
        img = Image.open(filename)
        img.load()
    except FileNotFoundError:
        raise FormatError('%s: image file not found' % filename)
    except Exception as exc:
        raise FormatError('%s: cannot read image (%s)' % (filename, exc))
    return img


def _as_float(img):
    """A Pillow image as floats in [0, 1] (scikit-image's img_as_float), H x W [x C]."""
    mode = img.mode
    if mode == '1':
        return numpy.asarray(img, dtype=numpy.float64)
    if mode in ('I;16', 'I;16B', 'I;16L', 'I;16N'):
        return numpy.asarray(img).astype(numpy.float64) / 65535.0
    if mode == 'I':
        a = numpy.asarray(img).astype(numpy.float64)
        # 16-bit PNGs open as 'I' in some Pillow versions.
        return a / (65535.0 if a.max(initial=0) <= 65535 and a.min(initial=0) >= 0
                    else 2147483647.0)
    if mode == 'F':
        return numpy.asarray(img, dtype=numpy.float64)
    if mode == 'P':
        img = img.convert('RGBA' if 'transparency' in img.info else 'RGB')
    elif mode in ('CMYK', 'YCbCr', 'LAB', 'HSV'):
        img = img.convert('RGB')
    elif mode not in ('L', 'LA', 'RGB', 'RGBA'):
        img = img.convert('RGBA' if 'A' in mode else 'RGB')
    return numpy.asarray(img).astype(numpy.float64) / 255.0


def load_image(filename, color=True):
    """An image file as float32 in [0, 1]: H x W x 3 RGB, or H x W x 1 grey
    (color=False). A grey file read in colour is replicated to 3 channels;
    an alpha channel is dropped (blended over white when reading grey)."""
    img = _as_float(_pil_image(filename))
    if img.ndim == 3 and img.shape[2] == 2:       # grey + alpha
        img = img[:, :, 0]
    if not color and img.ndim == 3:
        if img.shape[2] == 4:
            alpha = img[:, :, 3:4]
            img = img[:, :, :3] * alpha + (1.0 - alpha)
        img = img[:, :, :3] @ _GRAY_WEIGHTS
    img = img.astype(numpy.float32)
    if img.ndim == 2:
        img = img[:, :, numpy.newaxis]
        if color:
            img = numpy.tile(img, (1, 1, 3))
    elif img.shape[2] == 4:
        img = img[:, :, :3]
    return numpy.ascontiguousarray(img)


def _axis_taps(src, dst, order):
    """Source indices and weights for resizing one axis from src to dst."""
    scale = src / float(dst)
    centres = (numpy.arange(dst, dtype=numpy.float64) + 0.5) * scale - 0.5
    if order == 0:
        idx = numpy.clip(numpy.floor(centres + 0.5).astype(numpy.int64), 0, src - 1)
        return idx, idx, numpy.zeros(dst)
    centres = numpy.clip(centres, 0, src - 1)
    lo = numpy.floor(centres).astype(numpy.int64)
    hi = numpy.minimum(lo + 1, src - 1)
    return lo, hi, centres - lo


def resize_image(im, new_dims, interp_order=1):
    """Resize an H x W x K image to new_dims (height, width); float32 out.

    interp_order 0 is nearest neighbour, 1 bilinear (NumPy); higher orders
    use scipy.ndimage (spline interpolation) when SciPy is installed.
    """
    im = numpy.asarray(im)
    squeeze = im.ndim == 2
    if squeeze:
        im = im[:, :, numpy.newaxis]
    if im.ndim != 3:
        raise CaffeplusError('resize_image needs an H x W x K image, got shape %s'
                             % (im.shape,))
    h, w = int(new_dims[0]), int(new_dims[1])
    if h <= 0 or w <= 0:
        raise CaffeplusError('resize_image: invalid size %s' % (tuple(new_dims),))
    if im.shape[0] == 0 or im.shape[1] == 0:
        raise CaffeplusError('resize_image: empty image of shape %s' % (im.shape,))
    src = im.astype(numpy.float64)
    if (h, w) == im.shape[:2]:
        out = src
    elif interp_order in (0, 1):
        y0, y1, fy = _axis_taps(im.shape[0], h, interp_order)
        x0, x1, fx = _axis_taps(im.shape[1], w, interp_order)
        fy = fy[:, None, None]
        fx = fx[None, :, None]
        rows = src[y0] * (1 - fy) + src[y1] * fy
        out = rows[:, x0] * (1 - fx) + rows[:, x1] * fx
    else:
        try:
            from scipy import ndimage
        except ImportError:
            raise CaffeplusError('resize_image with interp_order %d needs SciPy; orders 0 '
                                 'and 1 work without it' % interp_order)
        zoom = (h / float(im.shape[0]), w / float(im.shape[1]), 1.0)
        out = ndimage.zoom(src, zoom, order=interp_order, mode='nearest', grid_mode=True)
    out = out.astype(numpy.float32)
    return out[:, :, 0] if squeeze else out


def oversample(images, crop_dims):
    """Ten crops of each H x W x K image: the four corners and the centre,
    then the same five mirrored left-right. Returns (10 * N) x h x w x K."""
    images = [numpy.asarray(im) for im in images]
    if not images:
        raise CaffeplusError('oversample needs at least one image')
    im_shape = numpy.array(images[0].shape)
    crop_dims = numpy.array(crop_dims, dtype=int)
    if numpy.any(crop_dims > im_shape[:2]):
        raise CaffeplusError('oversample: crop %s is larger than the images %s'
                             % (tuple(crop_dims), tuple(im_shape[:2])))
    centre = im_shape[:2] / 2.0
    starts = [(0, 0), (0, im_shape[1] - crop_dims[1]),
              (im_shape[0] - crop_dims[0], 0),
              (im_shape[0] - crop_dims[0], im_shape[1] - crop_dims[1]),
              tuple((centre - crop_dims / 2.0).astype(int))]
    crops = numpy.empty((10 * len(images), crop_dims[0], crop_dims[1], im_shape[-1]),
                        dtype=numpy.float32)
    ix = 0
    for im in images:
        for y, x in starts:
            crops[ix] = im[y:y + crop_dims[0], x:x + crop_dims[1], :]
            ix += 1
        crops[ix:ix + 5] = crops[ix - 5:ix, :, ::-1, :]
        ix += 5
    return crops


# -- Transformer -----------------------------------------------------------------
class Transformer:
    """Turn images (H x W x K floats) into network inputs and back.

    `inputs` maps each input blob name to its shape (N, C, H, W). preprocess
    resizes to H x W, then applies, in order: transpose, channel swap,
    raw scale, mean subtraction, input scale; deprocess undoes them.
    """

    def __init__(self, inputs):
        self.inputs = {name: tuple(int(d) for d in shape) for name, shape in inputs.items()}
        self.transpose = {}
        self.channel_swap = {}
        self.raw_scale = {}
        self.mean = {}
        self.input_scale = {}

    def _check_input(self, in_):
        if in_ not in self.inputs:
            raise Exception('{} is not one of the net inputs: {}'.format(in_, self.inputs))

    def preprocess(self, in_, data):
        """An H x W x K image -> a C x H x W network input (float32)."""
        self._check_input(in_)
        caffe_in = numpy.array(data, dtype=numpy.float32, copy=True)
        transpose = self.transpose.get(in_)
        channel_swap = self.channel_swap.get(in_)
        raw_scale = self.raw_scale.get(in_)
        mean = self.mean.get(in_)
        input_scale = self.input_scale.get(in_)
        in_dims = self.inputs[in_][2:]
        if caffe_in.shape[:2] != in_dims:
            caffe_in = resize_image(caffe_in, in_dims)
        if transpose is not None:
            caffe_in = caffe_in.transpose(transpose)
        if channel_swap is not None:
            caffe_in = caffe_in[list(channel_swap), :, :]
        # In place on our own float32 copy, rounding after each step as pycaffe does.
        if raw_scale is not None:
            caffe_in *= raw_scale
        if mean is not None:
            caffe_in -= mean
        if input_scale is not None:
            caffe_in *= input_scale
        return numpy.ascontiguousarray(caffe_in, dtype=numpy.float32)

    def deprocess(self, in_, data):
        """A network input (C x H x W, or with a batch axis of 1) -> an image."""
        self._check_input(in_)
        decaf_in = numpy.array(data, copy=True).squeeze()
        if decaf_in.dtype.kind != 'f':
            decaf_in = decaf_in.astype(numpy.float32)
        transpose = self.transpose.get(in_)
        channel_swap = self.channel_swap.get(in_)
        raw_scale = self.raw_scale.get(in_)
        mean = self.mean.get(in_)
        input_scale = self.input_scale.get(in_)
        if input_scale is not None:
            decaf_in /= input_scale
        if mean is not None:
            decaf_in += mean
        if raw_scale is not None:
            decaf_in /= raw_scale
        if channel_swap is not None:
            decaf_in = decaf_in[numpy.argsort(channel_swap), :, :]
        if transpose is not None:
            decaf_in = decaf_in.transpose(numpy.argsort(transpose))
        return decaf_in

    def set_transpose(self, in_, order):
        """Order of the image axes in the input, e.g. (2, 0, 1) for HWC -> CHW."""
        self._check_input(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise Exception('Transpose order needs to have the same number of '
                            'dimensions as the input.')
        self.transpose[in_] = tuple(order)

    def set_channel_swap(self, in_, order):
        """Reorder channels, e.g. (2, 1, 0) for RGB -> BGR (after transpose)."""
        self._check_input(in_)
        if len(order) != self.inputs[in_][1]:
            raise Exception('Channel swap needs to have the same number of '
                            'dimensions as the input channels.')
        self.channel_swap[in_] = tuple(order)

    def set_raw_scale(self, in_, scale):
        """Multiply by `scale` (e.g. 255 for images loaded in [0, 1]) before the mean."""
        self._check_input(in_)
        self.raw_scale[in_] = scale

    def set_mean(self, in_, mean):
        """Subtract a mean: one value per channel (K,) or a C x H x W image."""
        self._check_input(in_)
        mean = numpy.asarray(mean)
        ms = mean.shape
        if mean.ndim == 1:
            if ms[0] != self.inputs[in_][1]:
                raise ValueError('Mean channels incompatible with input.')
            mean = mean[:, numpy.newaxis, numpy.newaxis]
        else:
            if len(ms) == 2:
                ms = (1,) + ms
            if len(ms) != 3:
                raise ValueError('Mean shape invalid')
            if tuple(ms) != self.inputs[in_][1:]:
                raise ValueError('Mean shape incompatible with input shape: mean %s, input '
                                 '%s' % (tuple(ms), self.inputs[in_][1:]))
            mean = mean.reshape(ms)
        self.mean[in_] = mean

    def set_input_scale(self, in_, scale):
        """Multiply by `scale` after subtracting the mean."""
        self._check_input(in_)
        self.input_scale[in_] = scale


def input_transformer(net, what, mean=None, input_scale=None, raw_scale=None, channel_swap=None):
    """A Transformer for the first input of `net`, set up as pycaffe's
    Classifier and Detector do (HxWxC images to CxHxW, then the options)."""
    from caffeplus.errors import CaffeplusError
    if not net.inputs:
        raise CaffeplusError('%s: the net %s has no Input layer' % (what, net.name))
    in_ = net.inputs[0]
    transformer = Transformer({in_: net.blobs[in_].data.shape})
    transformer.set_transpose(in_, (2, 0, 1))
    if mean is not None:
        transformer.set_mean(in_, mean)
    if input_scale is not None:
        transformer.set_input_scale(in_, input_scale)
    if raw_scale is not None:
        transformer.set_raw_scale(in_, raw_scale)
    if channel_swap is not None:
        transformer.set_channel_swap(in_, channel_swap)
    return transformer
