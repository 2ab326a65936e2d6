"""Compute kernels that read GGUF blocks as stored: `cpu` (the C extension `_cpu`, built by setup.py).

Each kernel has a torch reference: moerun.quant.dequant + a float matmul (tests/test_kernels_cpu.py).
"""
