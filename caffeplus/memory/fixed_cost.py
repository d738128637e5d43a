"""What a caffeplus process holds on the device besides its plan's buffers
(the CUDA context, CuPy, cuBLAS, cuDNN, the fused kernels and the CUDA
graphs): measured; caffeplus.memory.workspace_model's "Fixed cost" says how."""
MiB = 2 ** 20
RUNTIME_BYTES = 660 * MiB
