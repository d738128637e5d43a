#!/usr/bin/env python3
"""Print the cuDNN algorithm candidates and choices of every convolution of
a net on the GPU (for calibrating caffeplus.memory.workspace_model and the
placed workspace's time/memory trade-off).

    python3 tools/dump_algorithms.py --plan shared --json out.json NET.prototxt ...

For each convolution layer and call site (fwd, bwd_data, bwd_filter): the
candidates (algorithm, workspace bytes, time in ms when timed) and the one
the plan chose, plus the layer's input/output sizes.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dump(model, plan, gpu, budget=None):
    import caffeplus
    from caffeplus.memory import shapes
    os.environ.setdefault('CAFFEPLUS_CUDNN_SEARCH', 'auto')
    param = shapes.load_net_param(model)
    caffeplus.set_mode_gpu()
    caffeplus.set_device(gpu)
    if budget:
        from caffeplus.memory.apply import apply_named_plan
        from caffeplus.memory.budget import parse_bytes
        net = caffeplus.Net(param, caffeplus.TRAIN, memory='stock')
        apply_named_plan(net, plan, training=True, budget=parse_bytes(budget))
    else:
        net = caffeplus.Net(param, caffeplus.TRAIN, memory=plan)
    net.forward()                  # plans (and times) the workspace
    net.backward()
    ws = net.workspace
    from caffeplus.memory.workspace import VIEW_NAMES, view_part
    out = []
    index = {id(l): i for i, l in enumerate(net.layers)}
    for layer, site in (ws.sites() if ws is not None else []):
        i = index[id(layer)]
        bottom, top = net.bottom_vecs[i][0], net.top_vecs[i][0]
        out.append({
            'layer': layer.layer_param.name, 'kind': site.kind,
            'in_bytes': bottom.count * 4, 'out_bytes': top.count * 4,
            'chosen': [site.choice.algo, site.choice.memory, site.choice.time],
            'planned': (getattr(net.applied_plan.plan, 'call_workspace', None) or {}).get(
                (layer.layer_param.name, VIEW_NAMES[view_part(layer, site.kind)]))
            if getattr(net, 'applied_plan', None) is not None else None,
            'candidates': [[c.algo, c.memory, c.time] for c in site.candidates],
        })
    return {'net': net.name, 'plan': plan, 'sites': out,
            'views': len(getattr(ws, 'views', {}) or {}),
            'arena_bytes': getattr(net.applied_plan, 'arena_bytes', 0)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('models', nargs='+')
    ap.add_argument('--plan', default='shared')
    ap.add_argument('--gpu', type=int, default=0)
    ap.add_argument('--budget', default=None, help="plan auto's budget (e.g. 12G)")
    ap.add_argument('--json', default=None)
    ap.add_argument('--calibration', default=None,
                    help='also save the timed candidates as a calibration table '
                         '(caffeplus.memory.calibration) for `caffeplus memory --calibration`')
    args = ap.parse_args(argv)
    docs = []
    for model in args.models:
        doc = dump(model, args.plan, args.gpu, args.budget)
        docs.append(doc)
        print('%s (%s): arena %d MiB' % (doc['net'], args.plan, doc['arena_bytes'] >> 20))
        for s in doc['sites']:
            best = s['candidates'][0] if s['candidates'] else None
            print('  %-22s %-10s chose algo %d ws %8.1f MiB %7.3f ms (planned %s) | fastest %s | '
                  'smallest %s'
                  % (s['layer'], s['kind'], s['chosen'][0], s['chosen'][1] / 2 ** 20,
                     s['chosen'][2], s.get('planned'), best,
                     min(s['candidates'], key=lambda c: c[1]) if s['candidates'] else None))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(docs, f)
    if args.calibration:
        from caffeplus.memory import calibration
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(args.gpu)
        calibration.save(args.calibration, device='%s, plan %s, FP32' % (
            props['name'].decode(), args.plan))
        print('calibration table: %s (%d geometries)' % (args.calibration,
                                                         calibration.entries()))


if __name__ == '__main__':
    main()
