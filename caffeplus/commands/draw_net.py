"""caffeplus draw_net: draw a net diagram (pycaffe's python/draw_net.py).

    caffeplus draw_net NET.prototxt OUT.png [--rankdir LR|TB|BT|RL] \\
        [--phase TRAIN|TEST|ALL] [--display_lrm]

The output format follows OUT's extension (png, svg, pdf, ...; .dot writes
the Graphviz source and needs no Graphviz). Rendering needs Graphviz's `dot`.
"""
import sys

from caffeplus.errors import CaffeplusError


def add_arguments(parser):
    parser.add_argument('input_net_proto_file', help='input network prototxt file')
    parser.add_argument('output_image_file', help='output image file')
    parser.add_argument('--rankdir', default='LR',
                        help='one of TB (top-bottom, i.e., vertical), RL (right-left, i.e., '
                             'horizontal), or another valid dot option; see '
                             'http://www.graphviz.org/doc/info/attrs.html#k:rankdir')
    parser.add_argument('--phase', default='ALL',
                        help='which network phase to draw: TRAIN, TEST or ALL. If ALL, the '
                             'entire network is drawn.')
    parser.add_argument('--display_lrm', action='store_true',
                        help='display the learning rate multipliers of the layers')


def run(args):
    from caffeplus import draw
    from caffeplus.io.prototxt import read_net_param
    phase = args.phase.upper()
    if phase not in ('TRAIN', 'TEST', 'ALL'):
        raise CaffeplusError("--phase must be TRAIN, TEST or ALL, not '%s'" % args.phase)
    net = read_net_param(args.input_net_proto_file)
    print('Drawing net to %s' % args.output_image_file)
    draw.draw_net_to_file(net, args.output_image_file, args.rankdir.upper(),
                          None if phase == 'ALL' else phase, args.display_lrm)
    return 0


def main(argv=None):
    from caffeplus import cli
    return cli.main(['draw_net'] + list(sys.argv[1:] if argv is None else argv))
