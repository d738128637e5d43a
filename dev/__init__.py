"""Developer scripts: investigation probes, profilers, fuzzers and checks.

Run from a source checkout (`python3 dev/NAME.py --help`); tests import some
of them (`from dev import check_plans_equal`). Not installed: users run the
`caffeplus` command and the scripts in tools/.
"""
