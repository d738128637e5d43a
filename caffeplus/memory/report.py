"""Tables and charts of memory plans, for `caffeplus memory`.

A result is the dict a plan's JSON entry holds (peak_bytes, breakdown,
iter_ms, estimated, ...), plus, for charts, `curve`: bytes live on the
device at each of the 2L+1 steps of one iteration (forward of every layer,
backward of every layer, the solver update).

Charts (matplotlib, Agg backend, no display needed), two PNG files:
  <name>.png           one stacked bar per plan: its peak split into the
                       categories (a measured plan's bar is the measurement,
                       its steady peak where that is lower: offload 'free'
                       runs its first iterations as shared; a black tick
                       marks the planner's estimate beside it)
  <name>_timeline.png  one line per plan: bytes live across the forward then
                       backward steps of one iteration (dashed: measured)
where --plot gives <name>.png (a name without .png gets it appended).
"""
import os

from caffeplus.errors import CaffeplusError
from caffeplus.memory.budget import format_bytes
from caffeplus.memory.plan import CATEGORIES

LABELS = {'parameters': 'parameters', 'parameter_diffs': 'param diffs',
          'solver_history': 'solver history', 'activations': 'activations',
          'activation_diffs': 'act diffs', 'workspace': 'workspace', 'other': 'other'}
COLORS = {'parameters': '#4c72b0', 'parameter_diffs': '#8da0cb', 'solver_history': '#64b5cd',
          'activations': '#dd8452', 'activation_diffs': '#f2b880', 'workspace': '#55a868',
          'other': '#a0a0a0'}


def _ms(value):
    return '-' if value is None else '%.1f' % value


# Below this a table cell shows '-': nothing a reader weighs, and the few
# bytes the shares' rounding leaves in a category are not worth a figure.
LEAST_SHOWN = 2 ** 10


def format_cell(n):
    """A size for the table: '-' for none (under LEAST_SHOWN), else
    format_bytes's GiB, MiB or KiB with one or two decimals."""
    if n is None or abs(int(n)) < LEAST_SHOWN:
        return '-'
    return format_bytes(n)


def model_gpu():
    from caffeplus.memory import workspace_model
    return workspace_model.MODEL_GPU


OTHER_LEGEND = ('other = runtime (CUDA context, CuPy, cuDNN, cuBLAS workspace, kernels)\n'
                '      + cuDNN handles (stock Caffe\'s: 3 per convolution group, 1 per other '
                'cuDNN layer)\n'
                '      + layer buffers (pooling indices, dropout masks, BatchNorm/Scale '
                'copies, 16-bit weight copies, shared scratch; stock: Caffe 1.0\'s own)')
OTHER_PART_LABELS = (('runtime', 'runtime'), ('cudnn_handles', 'cuDNN handles'),
                     ('layer_buffers', 'layer buffers'))


def _other_line(name, other, parts, width):
    terms = ['%s %s' % (label, format_bytes(parts[key]))
             for key, label in OTHER_PART_LABELS if parts.get(key, 0) >= LEAST_SHOWN]
    return '  %s  %s = %s' % (name.ljust(width), format_cell(other).rjust(10),
                              ' + '.join(terms) or '-')


def format_notes(results, measured_on=None, sixteen_bit=()):
    """The lines under the table: where the times come from, and what
    "other" holds in each estimate. `sixteen_bit`: the 16-bit storage types
    the net uses (the time model's 16-bit rates are said)."""
    lines = []
    measured = any(not r.get('estimated', True) for r in results.values())
    if measured:
        lines.append('iter ms: measured on %s; estimate rows model an %s'
                     % (measured_on or 'this GPU', model_gpu()))
    else:
        lines.append('iter ms: modelled for an %s (caffeplus.memory.workspace_model), '
                     'not this machine' % model_gpu())
    if sixteen_bit:
        from caffeplus.memory.workspace_model import SIXTEEN_BIT_CONV_TIME
        lines.append('iter ms estimates put the %s layers\' convolutions at %.2fx FP32\'s time '
                     '(cuDNN\'s NCHW 16-bit ones on an H200) and move their maps at 2 bytes a value'
                     % (' and '.join(sixteen_bit), SIXTEEN_BIT_CONV_TIME))
    rows = []
    for name, r in results.items():
        source = r if r.get('estimated', True) else r.get('estimate') or {}
        parts = source.get('other_parts')
        if parts:
            rows.append((name, source['breakdown'].get('other', 0), parts))
    if rows:
        lines.append(OTHER_LEGEND)
        width = max(len(n) for n, _, _ in rows)
        lines.extend(_other_line(n, o, p, width) for n, o, p in rows)
    if measured:
        lines.append("measured: the whole process's device memory (nvidia-smi's figure); "
                     "'whole process' rows: start-up included")
    return '\n'.join(lines)


def format_table(results, title=''):
    """An aligned text table, one row per plan (a measured plan gets a row
    with its steady peak where that differs, and one with the estimate and
    its error against the steady peak)."""
    head = ['plan', 'peak'] + [LABELS[c] for c in CATEGORIES] + ['iter ms', 'source']
    rows = []
    for name, r in results.items():
        source = 'estimate' if r.get('estimated', True) else 'measured'
        rows.append([name, format_cell(r['peak_bytes'])] +
                    [format_cell(r['breakdown'].get(c, 0)) for c in CATEGORIES] +
                    [_ms(r.get('iter_ms') if r.get('iter_ms') is not None
                         else r.get('est_iter_ms')), source])
        steady = r.get('steady_peak_bytes')
        if steady and abs(steady - r['peak_bytes']) > 0.01 * r['peak_bytes']:
            # offload 'free' runs its first iterations as shared while it measures
            rows.append(['', format_bytes(steady), 'steady peak (the timed iterations, once '
                                                   'the plan had settled)'])
        process = r.get('process_peak_bytes')
        if process:
            rows.append(['', format_cell(process),
                         'whole process, start-up included (start-up %s; training '
                         'iterations %s)' % (format_cell(r.get('startup_peak_bytes')),
                                             format_cell(r['peak_bytes']))])
        est = r.get('estimate')
        if est:
            settled = steady or r['peak_bytes']
            error = (est['peak_bytes'] - settled) / float(max(settled, 1))
            rows.append(['', format_bytes(est['peak_bytes'])] +
                        [format_bytes(est['breakdown'].get(c, 0)) for c in CATEGORIES] +
                        [_ms(est.get('iter_ms')), 'estimate (%+.1f%%)' % (100 * error)])
        if r.get('measure_error'):
            rows.append(['', '', 'not measured: %s' % r['measure_error']])
    full = [row for row in [head] + rows if len(row) == len(head)]
    widths = [max(len(str(row[i])) for row in full) for i in range(len(head))]
    lines = [title] if title else []
    for row in [head] + rows:
        cells = []
        for i, cell in enumerate(row):
            if i == len(row) - 1 and len(row) < len(head):
                cells.append(str(cell))       # a free-text tail
            elif i == 0 or i == len(head) - 1:
                cells.append(str(cell).ljust(widths[i]))
            else:
                cells.append(str(cell).rjust(widths[i]))
        lines.append('  '.join(cells).rstrip())
    return '\n'.join(lines)


def plot_paths(path):
    path = os.fspath(path)
    stem, ext = os.path.splitext(path)
    if ext.lower() != '.png':
        stem, ext = path, '.png'
    return stem + ext, stem + '_timeline' + ext


def _pyplot():
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise CaffeplusError('--plot needs matplotlib (%s): pip install matplotlib' % exc)
    return plt


def bar_bytes(result):
    """({category: bytes}, whether steady) of one plan's bar: the breakdown,
    less what the run held only before it settled (its peak over its steady
    peak, counted as "other": what the steady iterations no longer hold)."""
    values = dict((c, result['breakdown'].get(c, 0)) for c in CATEGORIES)
    steady = result.get('steady_peak_bytes')
    if not steady or steady >= result['peak_bytes']:
        return values, False
    values['other'] = max(0, values['other'] - (result['peak_bytes'] - steady))
    return values, True


def plot(path, results, title='', step_labels=None):
    """Write the two charts; returns their paths."""
    plt = _pyplot()
    bars_path, timeline_path = plot_paths(path)
    directory = os.path.dirname(os.path.abspath(bars_path))
    if not os.path.isdir(directory):
        raise CaffeplusError("--plot: directory '%s' does not exist" % directory)
    gib = float(2 ** 30)
    names = list(results)

    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(names) + 3), 5))
    bottoms = [0.0] * len(names)
    bars = [bar_bytes(results[n]) for n in names]
    for c in CATEGORIES:
        values = [b[0][c] / gib for b in bars]
        ax.bar(names, values, bottom=bottoms, color=COLORS[c], label=LABELS[c])
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for i, n in enumerate(names):
        r = results[n]
        ax.text(i, bottoms[i], '%.2f%s' % (bottoms[i], ' steady' if bars[i][1] else ''),
                ha='center', va='bottom', fontsize=8)
        if r.get('estimate'):
            ax.plot([i - 0.4, i + 0.4], [r['estimate']['peak_bytes'] / gib] * 2, color='black',
                    linewidth=2, label='estimate' if i == 0 else None)
    ax.set_ylabel('peak device memory (GiB)')
    ax.set_title(title or 'memory per plan')
    ax.legend(fontsize=8, loc='upper right')
    fig.tight_layout()
    fig.savefig(bars_path, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 5))
    steps = 0
    for n in names:
        r = results[n]
        for key, style, suffix in (('curve', '-', ' (planned, live)'),
                                   ('measured_curve', '--', ' (measured, in use)')):
            curve = r.get(key)
            if curve:
                steps = max(steps, len(curve))
                ax.plot(range(len(curve)), [v / gib for v in curve], style,
                        label=n + suffix)
    if steps:
        half = (steps - 1) / 2.0
        ax.axvline(half - 0.5, color='grey', linewidth=0.8, linestyle=':')
        ax.text(half / 2, ax.get_ylim()[1], 'forward', ha='center', va='top', fontsize=8)
        ax.text(half * 1.5, ax.get_ylim()[1], 'backward', ha='center', va='top', fontsize=8)
        if step_labels:
            every = max(1, len(step_labels) // 24)
            ticks = list(range(0, len(step_labels), every))
            ax.set_xticks(ticks)
            ax.set_xticklabels([step_labels[t] for t in ticks], rotation=90, fontsize=6)
        ax.legend(fontsize=8)
    ax.set_xlabel('step of one training iteration (layer forward, then backward, then update)')
    ax.set_ylabel('live device memory (GiB)')
    ax.set_title((title + ': ' if title else '') + 'live memory across one iteration')
    fig.tight_layout()
    fig.savefig(timeline_path, dpi=100)
    plt.close(fig)
    return bars_path, timeline_path
