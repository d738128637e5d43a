#!/usr/bin/env python3
"""One line a plan of a `caffeplus memory --json` file: the measured peak
(and steady peak), iteration time, estimate and offloaded maps. Used by the
GPU scripts (gpu_release_check.sh, gpu_plan_probe.sh) to summarise a run.

    python3 dev/memory_summary.py memory_vgg16_b64.json
"""
import json
import sys


def main(argv=None):
    path = (argv or sys.argv[1:])[0]
    try:
        doc = json.load(open(path))
    except (OSError, ValueError) as exc:
        print('  no JSON:', exc)
        return 0
    for name, p in doc['plans'].items():
        print('  %-8s peak %7.0f MiB (steady %7.0f)  iter %s ms  est %s ms  estimate err %s%%  '
              'offloaded %d' % (name, p['peak_bytes'] / 2 ** 20,
                                (p.get('steady_peak_bytes') or 0) / 2 ** 20, p.get('iter_ms'),
                                (p.get('estimate') or {}).get('iter_ms'),
                                p.get('estimate_error_pct'), len(p.get('offloaded') or [])))
    return 0


if __name__ == '__main__':
    sys.exit(main())
