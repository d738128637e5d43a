"""caffeplus test: Caffe's `caffe test`, scoring a model.

    caffeplus test -model m.prototxt -weights w.caffemodel [-iterations 50] [-gpu 0]

Builds the net in the TEST phase (--phase changes that), runs --iterations
forward passes and logs every output of every batch, then the loss and each
output's mean, in Caffe's lines:

    Batch 0, accuracy = 1
    Loss: 0.00571098
    accuracy = 1
    loss = 0.00571098 (* 1 = 0.00571098 loss)
"""
import numpy

from caffeplus import backend, config, log, precision
from caffeplus.commands.train import add_device_arguments, parse_gpus, parse_phase, \
    parse_stages, use_device
from caffeplus.errors import CaffeplusError
from caffeplus.io import workers
from caffeplus.proto import caffe_pb2

F32 = numpy.float32


def add_arguments(parser):
    parser.add_argument('--model', default='', help='the model definition protocol buffer '
                        'text file')
    parser.add_argument('--weights', default='',
                        help="the trained weights, separated by ','")
    parser.add_argument('--iterations', type=int, default=50,
                        help='the number of iterations to run')
    parser.add_argument('--phase', default='', help='network phase (TRAIN or TEST; default '
                        'TEST)')
    add_device_arguments(parser)
    workers.add_argument(parser)
    precision.add_argument(parser)
    config.add_arguments(parser, 'test', skip=('data_workers',))


def run(args):
    with config.cli_scope(args):
        return _run(args)


def _run(args):
    from caffeplus.net import Net
    if not args.model:
        raise CaffeplusError('Need a model definition to score (--model).')
    if not args.weights:
        raise CaffeplusError('Need model weights to score (--weights).')
    phase = parse_phase(args.phase, caffe_pb2.TEST)
    stages = parse_stages(args.stage)
    use_device(parse_gpus(args.gpu), 'test')
    with workers.cli_setting(args), precision.setting(args.precision):
        net = Net(args.model, phase, level=args.level, stages=stages)
    for name in args.weights.split(','):
        net.copy_from([name.strip()])
    log.info('Running for %d iterations.', args.iterations)
    test_score, test_score_output_id = [], []
    loss = F32(0)
    for i in range(args.iterations):
        loss += F32(net.forward_prefilled())
        idx = 0
        for j, blob_id in enumerate(net.output_blob_indices):
            name = net._blob_names[blob_id]
            for score in backend.to_numpy(net._blobs[blob_id].data).ravel():
                if i == 0:
                    test_score.append(F32(score))
                    test_score_output_id.append(j)
                else:
                    test_score[idx] = F32(test_score[idx] + score)
                log.info('Batch %d, %s = %g', i, name, score)
                idx += 1
    if args.iterations > 0:
        loss /= F32(args.iterations)
    log.info('Loss: %g', loss)
    for i, score in enumerate(test_score):
        blob_id = net.output_blob_indices[test_score_output_id[i]]
        name = net._blob_names[blob_id]
        weight = F32(net._blob_loss_weights[blob_id])
        mean_score = F32(score / F32(args.iterations))
        extra = ' (* %g = %g loss)' % (weight, weight * mean_score) if weight else ''
        log.info('%s = %g%s', name, mean_score, extra)
    return 0
