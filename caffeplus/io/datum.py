"""Datum records and images: arrays in Caffe's layout, decoded as OpenCV would.

Caffe stores one image per Datum: channels/height/width, the pixels as uint8
bytes (`data`) or floats (`float_data`) in C x H x W order, a label, and
`encoded` when `data` holds the bytes of a PNG/JPEG file instead. Colour
pixels are in OpenCV's BGR order.

caffeplus decodes JPEG with libjpeg-turbo through simplejpeg (which releases
the GIL, so data-layer workers decode in parallel, and writes BGR directly),
everything else, and JPEGs simplejpeg does not take (CMYK, an EXIF
orientation to apply, data it rejects), with Pillow. Both run libjpeg-turbo
with its defaults (the accurate integer IDCT, fancy upsampling), so a JPEG
decodes to the same pixels either way; tests/test_data_pipeline.py checks
it. The output reproduces what OpenCV (which Caffe uses) gives:
  * colour (IMREAD_COLOR): BGR, grey images replicated to 3 channels, alpha
    dropped;
  * grey (IMREAD_GRAYSCALE): for PNG libpng's own fixed-point conversion
    (coefficients 9797/19234/3737 out of 32768, truncated, as OpenCV asks
    libpng for it), for JPEG libjpeg's luma channel, otherwise OpenCV's
    cvtColor rounding;
  * native (IMREAD_UNCHANGED, used for encoded datums without force_color /
    force_gray): 1 channel for grey, 3 (BGR) for colour, 4 (BGRA) with alpha;
  * resizing: OpenCV's INTER_LINEAR fixed-point arithmetic (11-bit weights),
    bit-exact with the reference data made by convert_imageset.

Every function validates what a file claims before allocating for it: a
Datum's data must hold exactly channels*height*width values, and sizes are
bounded so a corrupt header cannot make us allocate terabytes.
"""
import io

import numpy

from caffeplus.errors import FormatError
from caffeplus.proto import caffe_pb2

# Caffe indexes a datum with int; beyond this a record is corrupt, not large.
MAX_DATUM_COUNT = 2 ** 31 - 1
# Largest decoded image we accept (pixels * channels), about 2 GB of uint8.
MAX_IMAGE_VALUES = 2 ** 31 - 1

COLOR, GRAY, UNCHANGED = 'color', 'gray', 'unchanged'


def _where(key):
    if key is None or key == '':
        return ''
    if isinstance(key, bytes):
        key = key.decode('utf-8', 'replace')
    return ' %s' % key


def _what(key):
    return 'datum%s' % _where(key) if key is not None and key != '' else 'datum'


# -- Datum <-> array -----------------------------------------------------------
def array_to_datum(arr, label=None):
    """A Datum holding a C x H x W array: uint8 as bytes, others as floats."""
    arr = numpy.asarray(arr)
    if arr.ndim != 3:
        raise FormatError('array_to_datum needs a 3-D array (channels, height, width), '
                          'got shape %s' % (arr.shape,))
    datum = caffe_pb2.Datum()
    datum.channels, datum.height, datum.width = (int(d) for d in arr.shape)
    if arr.dtype == numpy.uint8:
        datum.data = numpy.ascontiguousarray(arr).tobytes()
    else:
        datum.float_data.extend(numpy.asarray(arr, dtype=numpy.float32).ravel().tolist())
    if label is not None:
        datum.label = int(label)
    return datum


def parse_datum(value, key=None, source=None):
    """A Datum from a database value; errors name the key and the database."""
    datum = caffe_pb2.Datum()
    try:
        datum.ParseFromString(bytes(value))
    except Exception as exc:  # protobuf raises DecodeError or RuntimeError
        where = ' in %s' % source if source else ''
        raise FormatError('%s%s is not a valid Datum record (%s)' % (_what(key), where, exc))
    return datum


# Datum's fields by number: the varint ones (int32 channels, height, width,
# label; bool encoded) and the bytes one (data).
_VARINT_FIELDS = {1: 'channels', 2: 'height', 3: 'width', 5: 'label', 7: 'encoded'}
_DATA_FIELD = 4


class DatumView:
    """A serialized Datum's fields read in place: `data` is a memoryview of
    the record, not a copy (a 256 x 256 image's bytes are 196 KB; protobuf
    copies them twice, holding the GIL). Has the attributes datum_to_array
    reads; float_data is always empty (such records take protobuf's path)."""
    __slots__ = ('channels', 'height', 'width', 'label', 'encoded', 'data')
    float_data = ()

    def __init__(self):
        self.channels = self.height = self.width = self.label = 0
        self.encoded = False
        self.data = memoryview(b'')


def _varint(buf, pos, end):
    """(value, next position) of the varint at pos, or None if malformed."""
    value = shift = 0
    while pos < end and shift < 70:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7f) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    return None


def _int32(value):
    """A varint as protobuf reads an int32: the low 32 bits, signed."""
    value &= 0xffffffff
    return value - (1 << 32) if value >= 1 << 31 else value


def view_datum(value):
    """A DatumView of a serialized Datum, or None when it is anything but
    plain (float_data, unknown or mistyped fields, malformed bytes): those
    go to protobuf (parse_datum), which decides what they mean."""
    buf = memoryview(value)
    if buf.ndim != 1 or buf.itemsize != 1:
        buf = buf.cast('B')
    view = DatumView()
    pos, end = 0, len(buf)
    while pos < end:
        tag = _varint(buf, pos, end)
        if tag is None:
            return None
        tag, pos = tag
        field, wire = tag >> 3, tag & 7
        if field in _VARINT_FIELDS and wire == 0:
            got = _varint(buf, pos, end)
            if got is None:
                return None
            number, pos = got
            number &= (1 << 64) - 1         # protobuf keeps a varint's low 64 bits
            if field == 7:
                view.encoded = bool(number)
            else:
                setattr(view, _VARINT_FIELDS[field], _int32(number))
        elif field == _DATA_FIELD and wire == 2:
            got = _varint(buf, pos, end)
            if got is None or got[1] + got[0] > end:
                return None
            length, pos = got
            view.data = buf[pos:pos + length]
            pos += length
        else:
            return None
    return view


def read_datum(value, key=None, source=None):
    """The record as a DatumView (no copy) when it is plain, else a parsed Datum."""
    view = view_datum(value)
    return view if view is not None else parse_datum(value, key, source)


def datum_shape(datum, key=None):
    """(channels, height, width) that a raw (not encoded) datum claims, checked."""
    c, h, w = datum.channels, datum.height, datum.width
    if c <= 0 or h <= 0 or w <= 0:
        raise FormatError('%s has an invalid shape: channels %d, height %d, width %d'
                          % (_what(key), c, h, w))
    if c * h * w > MAX_DATUM_COUNT:
        raise FormatError('%s claims %d x %d x %d = %d values, more than the %d allowed '
                          '(corrupt record?)' % (_what(key), c, h, w, c * h * w, MAX_DATUM_COUNT))
    return c, h, w


def datum_to_array(datum, key=None, mode=UNCHANGED, what=None, contiguous=True):
    """The C x H x W array of a Datum: uint8 for `data`, float32 for `float_data`.

    An encoded datum is decoded (mode: 'unchanged' as OpenCV's native decode,
    'color' or 'gray'; contiguous=False: the decoder's H x W x C pixels seen
    as C x H x W, for a caller that copies them on anyway). Errors name
    `what` (default: 'datum <key>').
    """
    if datum.encoded:
        return decode_image(datum.data, mode, what=what or _what(key), contiguous=contiguous)
    c, h, w = datum_shape(datum, key)
    name = what or _what(key)
    count = c * h * w
    if len(datum.data):
        if len(datum.data) != count:
            raise FormatError('%s holds %d bytes of data but channels*height*width = '
                              '%d*%d*%d = %d' % (name, len(datum.data), c, h, w, count))
        return numpy.frombuffer(datum.data, dtype=numpy.uint8).reshape(c, h, w)
    if len(datum.float_data):
        if len(datum.float_data) != count:
            raise FormatError('%s holds %d float_data values but channels*height*width = '
                              '%d*%d*%d = %d' % (name, len(datum.float_data), c, h, w,
                                                 count))
        return numpy.asarray(datum.float_data, dtype=numpy.float32).reshape(c, h, w)
    raise FormatError('%s holds no pixel data (neither data nor float_data)' % name)


# -- images --------------------------------------------------------------------
def _pil():
    try:
        from PIL import Image, ImageOps
    except ImportError:  # pragma: no cover - Pillow is a dependency
        raise FormatError('decoding images needs the Pillow package (pip install Pillow)')
    return Image, ImageOps


def _gray_png(rgb):
    """libpng's rgb_to_gray with OpenCV's (0.299, 0.587): fixed point, truncated."""
    r = rgb[..., 0].astype(numpy.int32)
    g = rgb[..., 1].astype(numpy.int32)
    b = rgb[..., 2].astype(numpy.int32)
    gray = (9797 * r + 19234 * g + 3737 * b) >> 15
    same = (r == g) & (r == b)
    return numpy.where(same, r, gray).astype(numpy.uint8)


def _gray_cv(rgb):
    """OpenCV's cvtColor BGR2GRAY for 8-bit images: 14-bit fixed point, rounded."""
    r = rgb[..., 0].astype(numpy.int32)
    g = rgb[..., 1].astype(numpy.int32)
    b = rgb[..., 2].astype(numpy.int32)
    return ((4899 * r + 9617 * g + 1868 * b + 8192) >> 14).astype(numpy.uint8)


def _to_8bit(img):
    """A Pillow image in an 8-bit mode (OpenCV keeps the high byte of 16-bit data)."""
    if img.mode in ('I;16', 'I;16B', 'I;16L', 'I;16N', 'I'):
        a = numpy.asarray(img)
        if img.mode == 'I':
            a = numpy.clip(a, 0, 65535)
        Image, _ = _pil()
        return Image.fromarray((a.astype(numpy.uint32) >> 8).astype(numpy.uint8), 'L')
    if img.mode == 'F':
        raise FormatError('floating-point images are not supported')
    return img


def _decode_pil(img, mode, what):
    """Pillow image -> H x W x C uint8 in OpenCV's channel order."""
    Image, ImageOps = _pil()
    w, h = img.size
    bands = len(img.getbands())
    if w <= 0 or h <= 0 or w * h * max(bands, 3) > MAX_IMAGE_VALUES:
        raise FormatError('%s: image of %d x %d pixels is too large or empty' % (what, w, h))
    fmt = img.format
    if fmt == 'JPEG' and mode != UNCHANGED:
        if mode == GRAY and img.mode in ('RGB', 'YCbCr'):
            # libjpeg's own grey output (the Y channel), as OpenCV asks for.
            img.draft('L', img.size)
        img = ImageOps.exif_transpose(img)
    img.load()
    img = _to_8bit(img)
    m = img.mode
    has_alpha = m in ('RGBA', 'LA', 'PA', 'La', 'RGBa') or \
        (m == 'P' and 'transparency' in img.info)
    if mode == UNCHANGED:
        if m in ('L', '1') and not has_alpha:
            return numpy.asarray(img.convert('L'))[:, :, None]
        if has_alpha:
            a = numpy.asarray(img.convert('RGBA'))
            return a[:, :, [2, 1, 0, 3]]
        return numpy.asarray(img.convert('RGB'))[:, :, ::-1]
    if mode == COLOR:
        if m in ('L', '1', 'LA', 'La'):
            g = numpy.asarray(img.convert('L'))
            return numpy.repeat(g[:, :, None], 3, axis=2)
        return numpy.ascontiguousarray(numpy.asarray(img.convert('RGB'))[:, :, ::-1])
    if mode == GRAY:
        if m in ('L', '1', 'LA', 'La'):
            return numpy.asarray(img.convert('L'))[:, :, None]
        rgb = numpy.asarray(img.convert('RGB'))
        if fmt == 'PNG':
            return _gray_png(rgb)[:, :, None]
        return _gray_cv(rgb)[:, :, None]
    raise ValueError('unknown decode mode %r' % (mode,))


_JPEG_START = b'\xff\xd8\xff'
# The EXIF block sits in an APP1 segment before the image data; looking in
# this many leading bytes finds it (a false match costs only the slower path).
_EXIF_SEARCH_BYTES = 1 << 16


def _simplejpeg():
    try:
        import simplejpeg
    except ImportError:     # Pillow decodes JPEG too, one image at a time
        return None
    return simplejpeg


def _decode_jpeg_turbo(data, mode, what):
    """H x W x C uint8 of JPEG bytes by simplejpeg, or None where Pillow must
    decode: not a JPEG, simplejpeg missing or rejecting the data (Pillow then
    gives the reason), CMYK/YCCK/RGB-coded files, or an EXIF orientation to
    apply (COLOR and GRAY apply it, as OpenCV's imread does)."""
    if data[:3] != _JPEG_START:
        return None
    sj = _simplejpeg()
    if sj is None:
        return None
    try:
        h, w, colorspace, _ = sj.decode_jpeg_header(data)
    except ValueError:
        return None
    if colorspace not in ('Gray', 'YCbCr'):
        return None
    if mode != UNCHANGED and data.find(b'Exif\x00\x00', 0, _EXIF_SEARCH_BYTES) >= 0:
        return None
    if w <= 0 or h <= 0 or w * h * 3 > MAX_IMAGE_VALUES:
        raise FormatError('%s: image of %d x %d pixels is too large or empty' % (what, w, h))
    gray_out = colorspace == 'Gray' or mode == GRAY
    try:
        pixels = sj.decode_jpeg(data, colorspace='GRAY' if gray_out else 'BGR')
    except ValueError:
        return None
    if gray_out and mode == COLOR:
        return numpy.repeat(pixels, 3, axis=2)
    return pixels


def decode_image_hwc(data, mode=COLOR, what='image'):
    """Encoded image bytes -> H x W x C uint8 (BGR / grey / native)."""
    Image, _ = _pil()
    if not len(data):
        raise FormatError('%s: empty image data' % what)
    data = bytes(data)
    fast = _decode_jpeg_turbo(data, mode, what)
    if fast is not None:
        return fast
    try:
        img = Image.open(io.BytesIO(data))
        return numpy.ascontiguousarray(_decode_pil(img, mode, what))
    except FormatError:
        raise
    except Exception as exc:
        raise FormatError('%s: cannot decode image (%s)' % (what, exc))


def decode_image(data, mode=COLOR, what='image', contiguous=True):
    """Encoded image bytes -> C x H x W uint8, as Caffe's DecodeDatumToCVMat
    (contiguous=False: a transposed view of the decoded H x W x C pixels)."""
    chw = decode_image_hwc(data, mode, what).transpose(2, 0, 1)
    return numpy.ascontiguousarray(chw) if contiguous else chw


def read_image_hwc(path, mode=COLOR, new_height=0, new_width=0, what=None):
    """Caffe's ReadImageToCVMat: an image file -> H x W x C uint8 (BGR or grey)."""
    Image, _ = _pil()
    what = what or path
    try:
        with open(path, 'rb') as f:
            data = f.read()
    except FileNotFoundError:
        raise FormatError('%s: image file not found' % what)
    except IsADirectoryError:
        raise FormatError('%s: is a directory, not an image' % what)
    except (OSError, ValueError) as exc:   # ValueError: a NUL in the path
        raise FormatError('%s: cannot open image (%s)' % (what, getattr(exc, 'strerror', None)
                                                         or exc))
    arr = _decode_jpeg_turbo(data, mode, what)
    if arr is None:
        arr = _decode_file_pil(Image, data, mode, what)
    if new_height > 0 and new_width > 0:
        arr = resize_linear(arr, new_height, new_width)
    return numpy.ascontiguousarray(arr)


def _decode_file_pil(Image, data, mode, what):
    try:
        img = Image.open(io.BytesIO(data))
    except Exception as exc:
        raise FormatError('%s: cannot open image (%s)' % (what, exc))
    try:
        with img:
            return _decode_pil(img, mode, what)
    except FormatError:
        raise
    except Exception as exc:
        raise FormatError('%s: cannot decode image (%s)' % (what, exc))


def read_image(path, is_color=True, new_height=0, new_width=0, what=None, contiguous=True):
    """An image file -> C x H x W uint8, BGR (is_color) or 1-channel grey
    (contiguous=False: a transposed view of the H x W x C pixels)."""
    arr = read_image_hwc(path, COLOR if is_color else GRAY, new_height, new_width, what)
    chw = arr.transpose(2, 0, 1)
    return numpy.ascontiguousarray(chw) if contiguous else chw


# -- OpenCV's INTER_LINEAR resize ---------------------------------------------
_COEF_BITS = 11
_COEF_SCALE = 1 << _COEF_BITS


def _linear_taps(ssize, dsize, clamp_weights):
    """Source indices (d, 2) and 11-bit weights (d, 2) for one axis."""
    scale = 1.0 / (float(dsize) / ssize)
    d = numpy.arange(dsize, dtype=numpy.float64)
    f = ((d + 0.5) * scale - 0.5).astype(numpy.float32)
    s = numpy.floor(f).astype(numpy.int64)
    f = (f - s.astype(numpy.float32)).astype(numpy.float32)
    if clamp_weights:
        low = s < 0
        f[low] = 0
        s[low] = 0
        high = s >= ssize - 1
        f[high] = 0
        s[high] = ssize - 1
    w0 = numpy.rint((numpy.float32(1) - f) * numpy.float32(_COEF_SCALE)).astype(numpy.int64)
    w1 = numpy.rint(f * numpy.float32(_COEF_SCALE)).astype(numpy.int64)
    i0 = numpy.clip(s, 0, ssize - 1)
    i1 = numpy.clip(s + 1, 0, ssize - 1)
    return numpy.stack([i0, i1], 1), numpy.stack([w0, w1], 1)


def resize_linear(img, height, width):
    """OpenCV's cv::resize(INTER_LINEAR) of an H x W x C uint8 image, bit-exact.

    Horizontal pass with 11-bit integer weights (the source column clamped at
    the borders), vertical pass as OpenCV's 8-bit kernel computes it:
    ((b0 * (r0 >> 4)) >> 16) + ((b1 * (r1 >> 4)) >> 16) + 2) >> 2.
    """
    img = numpy.asarray(img)
    squeeze = img.ndim == 2
    if squeeze:
        img = img[:, :, None]
    if img.dtype != numpy.uint8:
        raise FormatError('resize_linear needs uint8 pixels, got %s' % img.dtype)
    h, w = img.shape[:2]
    height, width = int(height), int(width)
    if height <= 0 or width <= 0:
        raise FormatError('resize target %d x %d is invalid' % (height, width))
    if (h, w) == (height, width):
        out = img.copy()
    else:
        xi, xw = _linear_taps(w, width, True)
        yi, yw = _linear_taps(h, height, False)
        src = img.astype(numpy.int64)
        rows = src[:, xi[:, 0], :] * xw[:, 0][None, :, None] + \
            src[:, xi[:, 1], :] * xw[:, 1][None, :, None]
        r0 = rows[yi[:, 0]] >> 4
        r1 = rows[yi[:, 1]] >> 4
        b0 = yw[:, 0][:, None, None]
        b1 = yw[:, 1][:, None, None]
        val = (((b0 * r0) >> 16) + ((b1 * r1) >> 16) + 2) >> 2
        out = numpy.clip(val, 0, 255).astype(numpy.uint8)
    return out[:, :, 0] if squeeze else out
