"""Which layers a net keeps: Caffe's NetState rules (phase, level, stages)."""
from caffeplus import log
from caffeplus.errors import NetError
from caffeplus.proto import caffe_pb2


def state_meets_rule(state, rule, layer_name):
    if rule.HasField('phase') and rule.phase != state.phase:
        log.info('The NetState phase (%d) differed from the phase (%d) specified by a rule '
                 'in layer %s', state.phase, rule.phase, layer_name)
        return False
    if rule.HasField('min_level') and state.level < rule.min_level:
        log.info('The NetState level (%d) is above the min_level (%d) specified by a rule '
                 'in layer %s', state.level, rule.min_level, layer_name)
        return False
    if rule.HasField('max_level') and state.level > rule.max_level:
        log.info('The NetState level (%d) is above the max_level (%d) specified by a rule '
                 'in layer %s', state.level, rule.max_level, layer_name)
        return False
    stages = set(state.stage)
    for stage in rule.stage:
        if stage not in stages:
            log.info("The NetState did not contain stage '%s' specified by a rule in layer %s",
                     stage, layer_name)
            return False
    for stage in rule.not_stage:
        if stage in stages:
            log.info("The NetState contained a not_stage '%s' specified by a rule in layer %s",
                     stage, layer_name)
            return False
    return True


def filter_net(param):
    """A copy of `param` holding only the layers its `state` includes."""
    state = param.state
    filtered = caffe_pb2.NetParameter()
    filtered.CopyFrom(param)
    del filtered.layer[:]
    for layer in param.layer:
        if len(layer.include) and len(layer.exclude):
            raise NetError('layer %s: specify either include rules or exclude rules; not both'
                           % layer.name)
        included = len(layer.include) == 0
        for rule in layer.exclude:
            if state_meets_rule(state, rule, layer.name):
                included = False
        for rule in layer.include:
            if state_meets_rule(state, rule, layer.name):
                included = True
        if included:
            filtered.layer.add().CopyFrom(layer)
    return filtered
