"""Net diagrams with Graphviz, as pycaffe's caffe.draw.

    net = caffeplus.io.prototxt.read_net_param('train_val.prototxt')
    caffeplus.draw.draw_net_to_file(net, 'net.png', rankdir='LR', phase=caffeplus.TRAIN)

Layers are boxes (coloured by type), blobs are octagons, edges run from
bottoms to layers to tops; rankdir is Graphviz's: LR, TB, BT or RL.
Building the graph needs only pydot; rendering an image needs Graphviz's
`dot` program. draw_net(..., ext='dot') gives the DOT source without it.
"""
import shutil

from caffeplus.errors import CaffeplusError
from caffeplus.proto import caffe_pb2

LAYER_STYLE_DEFAULT = {'shape': 'record', 'fillcolor': '#6495ED', 'style': 'filled'}
NEURON_LAYER_STYLE = {'shape': 'record', 'fillcolor': '#90EE90', 'style': 'filled'}
BLOB_STYLE = {'shape': 'octagon', 'fillcolor': '#E0E0E0', 'style': 'filled'}
RANKDIRS = ('LR', 'TB', 'BT', 'RL')
TEXT_FORMATS = ('dot', 'raw', 'gv', 'canon')


def _pydot():
    try:
        import pydot
    except ImportError:
        raise CaffeplusError('drawing nets needs the pydot package (pip install pydot, or '
                             'pip install caffeplus[dev]) and Graphviz to render images')
    return pydot


def get_pooling_types_dict():
    """Pooling enum value -> name ('MAX', 'AVE', 'STOCHASTIC')."""
    desc = caffe_pb2.PoolingParameter.PoolMethod.DESCRIPTOR
    return {v.number: v.name for v in desc.values}


def get_edge_label(layer):
    """Edge label from a layer to its tops: the batch size of data layers,
    num_output of convolution and inner product layers."""
    if layer.type == 'Data':
        return 'Batch ' + str(layer.data_param.batch_size)
    if layer.type in ('Convolution', 'Deconvolution'):
        return str(layer.convolution_param.num_output)
    if layer.type == 'InnerProduct':
        return str(layer.inner_product_param.num_output)
    return ''


def _first(values, default):
    return values[0] if len(values) else default


def get_layer_lr_mult(layer):
    """'lr mult' text of the layer's parameters, for display_lrm."""
    if not len(layer.param):
        return ''
    mults = ['%g' % (p.lr_mult if p.HasField('lr_mult') else 1.0) for p in layer.param]
    return 'lr mult: ' + ', '.join(mults)


def get_layer_label(layer, rankdir, display_lrm=False):
    """The text of a layer's box: name, type and the main geometry."""
    # Graphviz's line break inside a label is the two characters backslash, n.
    separator = ' ' if rankdir in ('TB', 'BT') else '\\n'
    lines = [layer.name, '(%s)' % layer.type]
    if layer.type in ('Convolution', 'Deconvolution'):
        p = layer.convolution_param
        kernel = p.kernel_h if p.HasField('kernel_h') else _first(p.kernel_size, 1)
        stride = p.stride_h if p.HasField('stride_h') else _first(p.stride, 1)
        pad = p.pad_h if p.HasField('pad_h') else _first(p.pad, 0)
        lines += ['kernel size: %d' % kernel, 'stride: %d' % stride, 'pad: %d' % pad]
    elif layer.type == 'Pooling':
        p = layer.pooling_param
        kernel = p.kernel_h if p.HasField('kernel_h') else p.kernel_size
        stride = p.stride_h if p.HasField('stride_h') else p.stride
        pad = p.pad_h if p.HasField('pad_h') else p.pad
        lines += ['pool type: %s' % get_pooling_types_dict()[p.pool],
                  'kernel size: %d' % kernel, 'stride: %d' % stride, 'pad: %d' % pad]
    if display_lrm:
        lrm = get_layer_lr_mult(layer)
        if lrm:
            lines.append(lrm)
    return separator.join(lines)


def choose_color_by_layertype(layertype):
    color = '#6495ED'
    if layertype in ('Convolution', 'Deconvolution'):
        color = '#FF5050'
    elif layertype == 'Pooling':
        color = '#FF9900'
    elif layertype == 'InnerProduct':
        color = '#CC33CC'
    return color


def _phase_value(phase):
    if phase is None or phase == 'ALL':
        return None
    if isinstance(phase, str):
        try:
            return {'TRAIN': caffe_pb2.TRAIN, 'TEST': caffe_pb2.TEST}[phase.upper()]
        except KeyError:
            raise CaffeplusError("phase must be TRAIN, TEST or ALL, not '%s'" % phase)
    return int(phase)


def layer_in_phase(layer, phase):
    """Whether a layer is part of the net in `phase` (None: every layer),
    judged by the phases of its include/exclude rules, as pycaffe's draw."""
    phase = _phase_value(phase)
    if phase is None:
        return True
    included = len(layer.include) == 0
    for rule in layer.include:
        if rule.HasField('phase') and rule.phase == phase:
            included = True
        elif not rule.HasField('phase'):
            included = True
    for rule in layer.exclude:
        if rule.HasField('phase') and rule.phase == phase:
            included = False
    return included


def _quote(name):
    return '"%s"' % name.replace('\\', '\\\\').replace('"', '\\"')


def _record_label(text):
    # Keep the \n line breaks; escape what DOT strings and record shapes treat
    # as syntax.
    for ch in '"{}|<>':
        text = text.replace(ch, '\\' + ch)
    return '"%s"' % text


def get_pydot_graph(caffe_net, rankdir='LR', label_edges=True, phase=None, display_lrm=False):
    """A pydot.Dot of a NetParameter (or a caffeplus Net)."""
    pydot = _pydot()
    if rankdir not in RANKDIRS:
        raise CaffeplusError("rankdir must be one of %s, not '%s'" % (', '.join(RANKDIRS),
                                                                       rankdir))
    if hasattr(caffe_net, 'to_proto') and not isinstance(caffe_net, caffe_pb2.NetParameter):
        caffe_net = caffe_net.to_proto()
    graph = pydot.Dot(_quote(caffe_net.name or 'net'), graph_type='digraph',
                      compound='true', rankdir=rankdir)
    nodes, edges = {}, []
    for layer in caffe_net.layer:
        if not layer_in_phase(layer, phase):
            continue
        node_name = '%s_%s' % (layer.name, layer.type)
        label = get_layer_label(layer, rankdir, display_lrm)
        if len(layer.bottom) == 1 and len(layer.top) == 1 and \
                layer.bottom[0] == layer.top[0]:
            style = dict(NEURON_LAYER_STYLE)   # in place
        else:
            style = dict(LAYER_STYLE_DEFAULT)
            style['fillcolor'] = choose_color_by_layertype(layer.type)
        nodes[node_name] = pydot.Node(_quote(node_name), label=_record_label(label), **style)
        for bottom in layer.bottom:
            blob_node = bottom + '_blob'
            nodes.setdefault(blob_node, pydot.Node(_quote(blob_node), label=_quote(bottom),
                                                   **BLOB_STYLE))
            edges.append((blob_node, node_name, ''))
        edge_label = get_edge_label(layer) if label_edges else ''
        for top in layer.top:
            blob_node = top + '_blob'
            nodes.setdefault(blob_node, pydot.Node(_quote(blob_node), label=_quote(top),
                                                   **BLOB_STYLE))
            edges.append((node_name, blob_node, edge_label))
    for node in nodes.values():
        graph.add_node(node)
    for src, dst, label in edges:
        kwargs = {'label': _quote(label)} if label else {}
        graph.add_edge(pydot.Edge(_quote(src), _quote(dst), **kwargs))
    return graph


def _check_dot():
    if shutil.which('dot') is None:
        raise CaffeplusError("Graphviz's `dot` program was not found on PATH, so the diagram "
                             "cannot be rendered. Install Graphviz (apt-get install graphviz, "
                             "brew install graphviz, conda install graphviz), or write the "
                             "DOT source instead (ext 'dot', or a .dot output file).")


def draw_net(caffe_net, rankdir='LR', ext='png', phase=None, display_lrm=False):
    """The diagram as bytes in format `ext` (png, svg, pdf, ...; 'dot' gives
    the Graphviz source and needs no Graphviz)."""
    graph = get_pydot_graph(caffe_net, rankdir, phase=phase, display_lrm=display_lrm)
    ext = ext.lower().lstrip('.')
    if ext in TEXT_FORMATS:
        return graph.to_string().encode('utf-8')
    _check_dot()
    try:
        return graph.create(format=ext)
    except Exception as exc:
        raise CaffeplusError('Graphviz could not render the diagram as %s: %s' % (ext, exc))


def draw_net_to_file(caffe_net, filename, rankdir='LR', phase=None, display_lrm=False):
    """Write the diagram to `filename`; its extension picks the format."""
    ext = filename[filename.rfind('.') + 1:] if '.' in filename else 'png'
    data = draw_net(caffe_net, rankdir, ext, phase, display_lrm)
    with open(filename, 'wb') as f:
        f.write(data)
