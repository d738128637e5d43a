"""caffeplus.memory."""
