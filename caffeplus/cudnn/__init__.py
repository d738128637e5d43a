"""caffeplus.cudnn."""
