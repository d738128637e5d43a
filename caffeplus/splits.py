"""Split insertion: a top read by several bottoms gets a Split layer.

Names follow Caffe exactly (`label_mnist_1_split`, `label_mnist_1_split_0`),
so weights, logs and pycaffe blob names match stock Caffe's.
"""
from caffeplus.errors import NetError
from caffeplus.proto import caffe_pb2


def split_layer_name(layer_name, blob_name, blob_idx):
    return '%s_%s_%d_split' % (blob_name, layer_name, blob_idx)


def split_blob_name(layer_name, blob_name, blob_idx, split_idx):
    return '%s_%s_%d_split_%d' % (blob_name, layer_name, blob_idx, split_idx)


def insert_splits(param):
    last_top = {}           # blob name -> (layer index, top index)
    source_of_bottom = {}   # (layer, bottom) -> (layer, top)
    uses = {}               # (layer, top) -> number of consumers
    loss_weight = {}        # (layer, top) -> loss weight
    next_split = {}         # (layer, top) -> next split index to hand out
    names = [layer.name for layer in param.layer]

    for i, layer in enumerate(param.layer):
        for j, blob in enumerate(layer.bottom):
            if blob not in last_top:
                raise NetError("Unknown bottom blob '%s' (layer '%s', bottom index %d)"
                               % (blob, layer.name, j))
            src = last_top[blob]
            source_of_bottom[(i, j)] = src
            uses[src] = uses.get(src, 0) + 1
        for j, blob in enumerate(layer.top):
            last_top[blob] = (i, j)
        # A loss on a top counts as one more consumer of it.
        for j in range(min(len(layer.loss_weight), len(layer.top))):
            src = last_top[layer.top[j]]
            loss_weight[src] = layer.loss_weight[j]
            if loss_weight[src]:
                uses[src] = uses.get(src, 0) + 1

    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    for i, layer in enumerate(param.layer):
        new = out.layer.add()
        new.CopyFrom(layer)
        for j in range(len(new.bottom)):
            src = source_of_bottom[(i, j)]
            if uses.get(src, 0) > 1:
                k = next_split.get(src, 0)
                next_split[src] = k + 1
                new.bottom[j] = split_blob_name(names[src[0]], new.bottom[j], src[1], k)
        for j in range(len(new.top)):
            count = uses.get((i, j), 0)
            if count <= 1:
                continue
            weight = loss_weight.get((i, j), 0.0)
            split = out.layer.add()
            split.name = split_layer_name(layer.name, new.top[j], j)
            split.type = 'Split'
            split.bottom.append(new.top[j])
            for k in range(count):
                split.top.append(split_blob_name(layer.name, new.top[j], j, k))
                if weight:
                    split.loss_weight.append(weight if k == 0 else 0.0)
            if weight:
                # The split's first output carries the loss instead.
                del new.loss_weight[:]
                next_split[(i, j)] = next_split.get((i, j), 0) + 1
    return out
