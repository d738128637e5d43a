"""Reading and writing Caffe's file formats."""
