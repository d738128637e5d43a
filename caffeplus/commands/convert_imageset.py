"""caffeplus convert_imageset: Caffe's convert_imageset, images to an LMDB of Datums.

    caffeplus convert_imageset [FLAGS] ROOTFOLDER/ LISTFILE DB_NAME

LISTFILE has one `subfolder/file.jpg label` line per image; the file name is
everything before the last space and is appended to ROOTFOLDER as given
(Caffe concatenates, so ROOTFOLDER should end with '/'). Records are keyed
`%08d_<file>` by line number, as Caffe does. Pixels are stored in OpenCV's
BGR order (C x H x W uint8), decoded as OpenCV decodes them:

  --gray                  read images as one grey channel
  --resize_height/width   resize both (OpenCV's INTER_LINEAR, bit-exact)
  --encoded               store the encoded image instead of pixels (the
                          file's own bytes when nothing changes it)
  --encode_type png|jpg   re-encode in this format (implies --encoded)
  --shuffle               shuffle the lines first
  --check_size            fail if the images differ in size
  --backend lmdb|leveldb  the database kind (default lmdb)

An image that cannot be read is logged and skipped, as in Caffe. A progress
bar shows on a terminal for long conversions (--no-progress hides it).
"""
import os
import sys
import time

import numpy

from caffeplus import log, rng
from caffeplus.errors import CaffeplusError, FormatError
from caffeplus.io import datum as datum_io
from caffeplus.io import db as db_io
from caffeplus.proto import caffe_pb2

COMMIT_EVERY = 1000
_PIL_FORMATS = {'jpg': 'JPEG', 'jpeg': 'JPEG', 'png': 'PNG', 'bmp': 'BMP', 'dib': 'BMP',
                'tif': 'TIFF', 'tiff': 'TIFF', 'webp': 'WEBP', 'ppm': 'PPM', 'pgm': 'PPM',
                'pbm': 'PPM', 'pnm': 'PPM', 'jp2': 'JPEG2000'}


def add_arguments(parser):
    parser.add_argument('root_folder', metavar='ROOTFOLDER/',
                        help='folder the file names in LISTFILE are relative to')
    parser.add_argument('list_file', metavar='LISTFILE', help="lines of '<file> <label>'")
    parser.add_argument('db_name', metavar='DB_NAME', help='the database to create')
    parser.add_argument('--gray', action='store_true',
                        help='treat images as grayscale ones')
    parser.add_argument('--shuffle', action='store_true',
                        help='randomly shuffle the order of images and their labels')
    parser.add_argument('--backend', default='lmdb',
                        help='the backend {lmdb, leveldb} for storing the result')
    parser.add_argument('--resize_width', type=int, default=0,
                        help='width images are resized to')
    parser.add_argument('--resize_height', type=int, default=0,
                        help='height images are resized to')
    parser.add_argument('--check_size', action='store_true',
                        help='check that all the datum have the same size')
    parser.add_argument('--encoded', action='store_true',
                        help='when true, the encoded image will be saved in datum')
    parser.add_argument('--encode_type', default='',
                        help="optional: what type should we encode the image as ('png','jpg',...)")
    parser.add_argument('--no-progress', dest='progress', action='store_false',
                        help='do not show a progress bar')


# -- the list file -------------------------------------------------------------
def read_list(path):
    """(file, label) pairs, split at the last space as Caffe does."""
    try:
        with open(path, 'rb') as f:
            raw = f.read()
    except FileNotFoundError:
        raise CaffeplusError('list file not found: %s' % path)
    except OSError as exc:
        raise CaffeplusError('cannot read list file %s: %s' % (path, exc.strerror or exc))
    text = raw.decode('utf-8', 'surrogateescape')
    lines = text.split('\n')
    if lines and lines[-1] == '':
        lines.pop()               # std::getline yields no line after a final newline
    out = []
    for number, line in enumerate(lines, 1):
        pos = line.rfind(' ')
        name, label_text = (line[:pos], line[pos + 1:]) if pos >= 0 else (line, line)
        out.append((name, _atoi(label_text), number))
    return out


def _atoi(text):
    """C's atoi: leading blanks, an optional sign, digits; 0 if none."""
    text = text.lstrip()
    sign, i = 1, 0
    if text[:1] in ('+', '-'):
        sign = -1 if text[0] == '-' else 1
        i = 1
    j = i
    while j < len(text) and text[j].isdigit():
        j += 1
    return sign * int(text[i:j]) if j > i else 0


# -- one image -----------------------------------------------------------------
def _match_ext(filename, encoding):
    p = filename.rfind('.')
    ext = (filename[p + 1:] if p >= 0 else filename).lower()
    enc = encoding.lower()
    return ext == enc or (enc == 'jpg' and ext == 'jpeg')


def _encode(img_hwc, encoding, what):
    """OpenCV's imencode('.<encoding>') of a BGR or grey H x W x C image, by Pillow."""
    from PIL import Image
    fmt = _PIL_FORMATS.get(encoding.lower())
    if fmt is None:
        raise CaffeplusError("cannot encode %s as '%s' (known: %s)"
                             % (what, encoding, ', '.join(sorted(_PIL_FORMATS))))
    if img_hwc.shape[2] == 1:
        pil = Image.fromarray(img_hwc[:, :, 0], 'L')
    else:
        pil = Image.fromarray(numpy.ascontiguousarray(img_hwc[:, :, ::-1]), 'RGB')
    import io
    buf = io.BytesIO()
    kwargs = {'quality': 95} if fmt == 'JPEG' else {}
    pil.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def image_to_datum(path, label, resize_height, resize_width, is_color, encoding):
    """Caffe's ReadImageToDatum. Raises FormatError if the image cannot be read."""
    mode = datum_io.COLOR if is_color else datum_io.GRAY
    img = datum_io.read_image_hwc(path, mode, resize_height, resize_width)
    datum = caffe_pb2.Datum()
    if encoding:
        if not resize_height and not resize_width and _match_ext(path, encoding):
            # The file's own bytes, unchanged (Caffe's ReadFileToDatum).
            with open(path, 'rb') as f:
                datum.data = f.read()
        else:
            datum.data = _encode(img, encoding, path)
        datum.label = label
        datum.encoded = True
        return datum, img.shape
    # Caffe's CVMatToDatum, then the label: the same fields set in the same way.
    datum.channels, datum.height, datum.width = img.shape[2], img.shape[0], img.shape[1]
    datum.encoded = False
    datum.data = numpy.ascontiguousarray(img.transpose(2, 0, 1)).tobytes()
    datum.label = label
    return datum, img.shape


# -- progress ------------------------------------------------------------------
class Progress:
    """A one-line bar on stderr, only on a terminal, redrawn at most 4 times a second."""

    def __init__(self, total, enabled=True, stream=None):
        self.stream = stream or sys.stderr
        self.total = total
        self.enabled = enabled and total >= COMMIT_EVERY and self.stream.isatty()
        self.start = self.last = time.monotonic()
        self.shown = False

    def update(self, done, force=False):
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self.last < 0.25:
            return
        self.last = now
        frac = done / float(self.total) if self.total else 1.0
        width = 30
        filled = int(frac * width)
        rate = done / max(now - self.start, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else 0
        self.stream.write('\r[%s%s] %d/%d images %3d%%  %.0f img/s  ETA %ds '
                          % ('#' * filled, '.' * (width - filled), done, self.total,
                             int(frac * 100), rate, int(eta)))
        self.stream.flush()
        self.shown = True

    def clear(self):
        if self.shown:
            self.stream.write('\r\033[K')
            self.stream.flush()
            self.shown = False


def _resolve(root, name, warned):
    path = root + name
    if root and not root.endswith(('/', os.sep)) and not os.path.exists(path):
        joined = os.path.join(root, name)
        if os.path.exists(joined):
            if not warned:
                log.warning("ROOTFOLDER '%s' does not end with '/': joining it to the file "
                            "names with a '/'", root)
                warned.append(True)
            return joined
    return path


def run(args):
    is_color = not args.gray
    encoding_flag = args.encode_type
    encoded = args.encoded or bool(encoding_flag)
    lines = read_list(args.list_file)
    if args.shuffle:
        log.info('Shuffling data')
        order = rng.get().permutation(len(lines))
        lines = [lines[i] for i in order]
    log.info('A total of %d images.', len(lines))
    if encoding_flag and not args.encoded:
        log.info('encode_type specified, assuming encoded=true.')
    resize_height = max(0, args.resize_height)
    resize_width = max(0, args.resize_width)
    if (resize_height > 0) != (resize_width > 0):
        log.warning('only one of resize_height (%d) and resize_width (%d) is set: images are '
                    'not resized (Caffe resizes only when both are)', resize_height, resize_width)

    db = db_io.open_db(args.db_name, db_io.backend_name(args.backend), 'new')
    progress = Progress(len(lines), getattr(args, 'progress', True))
    count = 0
    first_shape = None
    warned = []
    try:
        for line_id, (name, label, number) in enumerate(lines):
            encoding = encoding_flag
            if encoded and not encoding:
                p = name.rfind('.')
                if p < 0:
                    log.warning("Failed to guess the encoding of '%s'", name)
                encoding = name[p + 1:].lower()
            path = _resolve(args.root_folder, name, warned)
            try:
                datum, shape = image_to_datum(path, label, resize_height, resize_width,
                                              is_color, encoding)
            except FormatError as exc:
                progress.clear()
                log.error('Could not open or find file %s (%s, line %d of %s)', path, exc,
                          number, args.list_file)
                continue
            if args.check_size:
                if first_shape is None:
                    first_shape = shape
                elif shape != first_shape:
                    raise CaffeplusError(
                        'Incorrect data field size %d: %s (line %d) is %d x %d x %d, the '
                        'first image was %d x %d x %d (--check_size)'
                        % (shape[0] * shape[1] * shape[2], path, number, shape[2], shape[0],
                           shape[1], first_shape[2], first_shape[0], first_shape[1]))
            key = ('%08d_%s' % (line_id, name)).encode('utf-8', 'surrogateescape')
            db.put(key, datum.SerializeToString())
            count += 1
            if count % COMMIT_EVERY == 0:
                db.commit()
                progress.clear()
                log.info('Processed %d files.', count)
            progress.update(line_id + 1)
        if count % COMMIT_EVERY != 0:
            db.commit()
            progress.clear()
            log.info('Processed %d files.', count)
    finally:
        progress.clear()
        db.close()
    return 0


def main(argv=None):
    from caffeplus import cli
    return cli.main(['convert_imageset'] + list(sys.argv[1:] if argv is None else argv))
