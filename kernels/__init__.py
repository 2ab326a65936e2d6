"""Compute kernels. Issue 4 adds quantized CPU and Triton kernels here; each has a torch reference in moerun.quant."""
