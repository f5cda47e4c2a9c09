"""Device kernels for compression (packbits, sign compression, blockwise quantization).

The accelerator table and the fast implementations plug in here; ``_reference`` holds the
pure-torch oracle every implementation must match bit for bit.
"""

from fn.kernels._reference import dequantize, packbits, quantize, sign_compress, unpackbits

__all__ = ["packbits", "unpackbits", "sign_compress", "quantize", "dequantize"]
