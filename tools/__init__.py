"""Caffe companion tools (convert_imageset, compute_image_mean, parse_log, ...)."""
