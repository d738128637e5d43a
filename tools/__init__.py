"""Caffe's companion tools as scripts (convert_imageset, compute_image_mean,
parse_log, ...): thin wrappers of the `caffeplus` subcommands, for a source
checkout. Not installed: an installed caffeplus runs `caffeplus NAME`."""
