"""Kernels and the layers built on them: the reference paged attention and rotary, the Triton kernels
(*_triton.py), the CPU packing (cpu_linear.py) and the compiled C kernels (*.c, built by cpu_kernels.py),
quantized weights (quant_*.py). A model family imports them; they import no family."""
