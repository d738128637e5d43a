"""A memory plan's names and options as users write them: `keep`, offload
policies, and whether a net trains."""
from caffeplus.errors import CaffeplusError


def check_keep(net, keep, what='keep'):
    """The `keep` names as a list; CaffeplusError for a name that is no blob of `net`."""
    if isinstance(keep, str):
        keep = [k for k in keep.split(',')]
    keep = [k.strip() for k in (keep or ()) if k and k.strip()]
    known = set(net._blob_names)
    missing = [k for k in keep if k not in known]
    if missing:
        raise CaffeplusError(
            "%s: net %s has no blob named %s (its blobs: %s)"
            % (what, net.name or '(unnamed)', ', '.join("'%s'" % m for m in missing),
               ', '.join(net._blob_names)))
    return keep


def _net_keep(net):
    """The keep list written in the net's own prototxt (caffeplus_param { keep })."""
    param = getattr(net, 'net_param', None)
    if param is None or not param.HasField('caffeplus_param'):
        return []
    return list(param.caffeplus_param.keep)


def _offload_policy(values):
    """caffeplus_param.offload (repeated string) -> 'conv' | 'all' | 'free' | [names]."""
    values = [v.strip() for v in values if v and v.strip()]
    if not values:
        return 'conv'
    if len(values) == 1 and values[0] in ('conv', 'all', 'free'):
        return values[0]
    names = []
    for v in values:
        names.extend(n.strip() for n in v.split(',') if n.strip())
    return names


def _training_default(net):
    from caffeplus.proto import caffe_pb2
    return net.phase == caffe_pb2.TRAIN or bool(getattr(net.net_param, 'force_backward', False))
