"""caffeplus plot_training_log: Caffe's tools/extra/plot_training_log.py, with matplotlib.

    caffeplus plot_training_log CHART_TYPE OUT.png LOG [LOG ...]

Chart types (Caffe's numbering):
    0: Test accuracy  vs. Iters
    1: Test accuracy  vs. Seconds
    2: Test loss  vs. Iters
    3: Test loss  vs. Seconds
    4: Train learning rate  vs. Iters
    5: Train learning rate  vs. Seconds
    6: Train loss  vs. Iters
    7: Train loss  vs. Seconds
Each log is one line, labelled with its file name. The logs are read with
parse_log (stock Caffe's and caffeplus's logs alike). The chart is written
as a PNG (or any format matplotlib knows, from the file's extension).
"""
import os
import sys

from caffeplus.commands.parse_log import parse_log
from caffeplus.errors import CaffeplusError

CHART_TYPES = {
    0: ('Test accuracy', 'Iters'),
    1: ('Test accuracy', 'Seconds'),
    2: ('Test loss', 'Iters'),
    3: ('Test loss', 'Seconds'),
    4: ('Train learning rate', 'Iters'),
    5: ('Train learning rate', 'Seconds'),
    6: ('Train loss', 'Iters'),
    7: ('Train loss', 'Seconds'),
}


def get_supported_chart_types():
    return sorted(CHART_TYPES)


def get_chart_type_description(chart_type):
    y, x = CHART_TYPES[chart_type]
    return '%s  vs. %s' % (y, x)


def chart_types_text():
    return '\n'.join('    %d: %s' % (t, get_chart_type_description(t))
                     for t in get_supported_chart_types())


def add_arguments(parser):
    import argparse
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = 'Plot training logs. Supported chart types:\n' + chart_types_text()
    parser.add_argument('chart_type', type=int, metavar='CHART_TYPE',
                        help='0-7, see above')
    parser.add_argument('output', metavar='OUT.png', help='where to save the chart')
    parser.add_argument('logs', metavar='LOG', nargs='+', help='training logs')


def _column(rows, wanted, what, path):
    """The value column for a chart: an exact name, else one containing it."""
    names = []
    for row in rows:
        for key in row:
            if key not in names and key not in ('NumIters', 'Seconds', 'LearningRate'):
                names.append(key)
    if wanted in names:
        return wanted
    for name in names:
        if wanted in name.lower():
            return name
    raise CaffeplusError('%s: no %s in the log (its %s outputs are: %s)'
                         % (path, what, what.split()[0].lower(), ', '.join(names) or 'none'))


def chart_data(chart_type, path):
    """(x values, y values) of one log for a chart type."""
    if chart_type not in CHART_TYPES:
        raise CaffeplusError('chart type %s is not supported; supported:\n%s'
                             % (chart_type, chart_types_text()))
    y_label, x_label = CHART_TYPES[chart_type]
    train_rows, test_rows = parse_log(path)
    rows = test_rows if y_label.startswith('Test') else train_rows
    if not rows:
        raise CaffeplusError('%s: no %s rows in the log' % (path, y_label.split()[0].lower()))
    x_key = 'NumIters' if x_label == 'Iters' else 'Seconds'
    if y_label.endswith('learning rate'):
        y_key = 'LearningRate'
    else:
        y_key = _column(rows, 'accuracy' if y_label.endswith('accuracy') else 'loss',
                        y_label, path)
    points = [(row[x_key], row[y_key]) for row in rows if y_key in row]
    return [p[0] for p in points], [p[1] for p in points]


def _labels(paths):
    """Legend labels: the log names without .log, with their folder when
    two logs share a name (sgd/train, adam/train)."""
    def short(path, with_dir):
        name = os.path.basename(path)
        if name.endswith('.log'):
            name = name[:-len('.log')]
        if with_dir:
            parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
            name = parent + '/' + name
        return name
    plain = [short(p, False) for p in paths]
    return [short(p, plain.count(n) > 1) for p, n in zip(paths, plain)]


def plot_chart(chart_type, path_to_png, logs):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        raise CaffeplusError('plot_training_log needs matplotlib (pip install matplotlib)')
    data = [(path, chart_data(chart_type, path)) for path in logs]
    y_label, x_label = CHART_TYPES[chart_type]
    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        labels = _labels([path for path, _ in data])
        for (path, (xs, ys)), label in zip(data, labels):
            ax.plot(xs, ys, marker='.' if len(xs) < 50 else None, linewidth=1.25,
                    label=label)
        ax.set_title(get_chart_type_description(chart_type))
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.grid(True, alpha=0.3)
        ax.legend(loc='best', fontsize='small')
        fig.tight_layout()
        fig.savefig(path_to_png)
    finally:
        plt.close(fig)


def run(args):
    plot_chart(args.chart_type, args.output, args.logs)
    return 0


def main(argv=None):
    from caffeplus import cli
    return cli.main(['plot_training_log'] + list(sys.argv[1:] if argv is None else argv))
