"""Quantize/dequantize and quantized compute kernels (quantized_decomposed::*)."""
