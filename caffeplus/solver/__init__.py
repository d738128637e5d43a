"""caffeplus.solver."""
