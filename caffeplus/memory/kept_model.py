"""The model of what each layer keeps for itself from forward to backward
(its internal buffers: a max pooling's argmax, a Dropout's mask,
BatchNorm's normalized copy), for a net built anywhere as its GPU layers
would keep them. The memory plans place these beside the maps (the
runtime's from the layers' own declarations, caffeplus.memory.scratch)."""
from caffeplus.memory import caffe1
from caffeplus.memory.liveness import FLOAT_BYTES
from caffeplus.proto import caffe_pb2


def map_itemsize(blob):
    """Bytes a value of the blob's data as the GPU stores it (2 for a
    16-bit map)."""
    return int(blob.data_storage.dtype.itemsize)


def internal_bytes(net, i, plan_name=None):
    """Bytes layer i keeps for itself from forward to backward;
    under `stock`, Caffe 1.0's buffers (caffeplus.memory.caffe1)."""
    layer = net.layers[i]
    own = layer.internal_bytes()
    if own is not None:
        return int(own)
    if plan_name == 'stock':
        return caffe1.layer_bytes(net, i)
    t = layer.layer_param.type
    bottom, top = net.bottom_vecs[i], net.top_vecs[i]
    training = layer.phase == caffe_pb2.TRAIN
    gpu_own = layer.gpu_internal_bytes()
    if gpu_own is not None:
        return int(gpu_own)         # cuDNN's pooling keeps no argmax
    if t == 'Pooling' and layer.layer_param.pooling_param.pool in (
            caffe_pb2.PoolingParameter.MAX, caffe_pb2.PoolingParameter.STOCHASTIC):
        return 4 * top[0].count
    if t == 'LRN':
        # cuDNN's LRN (across channels, on the GPU) keeps nothing between passes.
        across = layer.layer_param.lrn_param.norm_region == caffe_pb2.LRNParameter.ACROSS_CHANNELS
        return 0 if across else FLOAT_BYTES * bottom[0].count
    if t == 'Dropout' and training:
        return bottom[0].count
    if t == 'BatchNorm' and getattr(layer, 'keeps_normalized', training):
        return map_itemsize(top[0]) * top[0].count     # (in the maps' type)
    if t == 'Scale' and bottom and top and bottom[0].data_storage is top[0].data_storage:
        if _after_in_place_batch_norm(net, i):
            return 0        # a BatchNorm -> Scale chain: its gradient reads BatchNorm's copy
        learns = len(bottom) > 1 or layer.param_needs_backward(0)
        itemsize = map_itemsize(bottom[0])           # (in the maps' type)
        return itemsize * bottom[0].count if learns and net.layer_need_backward[i] else 0
    if t == 'Eltwise' and layer.layer_param.eltwise_param.operation == \
            caffe_pb2.EltwiseParameter.MAX:
        return 4 * top[0].count
    return 0


def _after_in_place_batch_norm(net, i):
    """Layer i directly follows a BatchNorm in place on the same blob (the
    GPU runs the two as one chain, layers/fused_chain.py)."""
    if i == 0 or net.layers[i - 1].layer_param.type != 'BatchNorm':
        return False
    blob = net.bottom_vecs[i][0]
    return any(b is blob for b in net.bottom_vecs[i - 1]) and \
        any(t is blob for t in net.top_vecs[i - 1])


def model_internals(net):
    """{layer index: {'kept': bytes}}: the model's buffers each layer keeps
    from forward to backward (internal_bytes), for make_plan to place with
    their lifetimes."""
    out = {}
    for i in range(len(net.layers)):
        n = internal_bytes(net, i)
        if n:
            out[i] = {'kept': n}
    return out
