"""edgemoe.quant: per output channel INT2/4/8 quantization (RTN, optional HQQ refinement).

    qt = quantize(w, bits, group_size=None, method="rtn")   # w float [R, C]
    dequantize_reference(qt)                                 # float32 [R, C], plain torch
    QuantizedTensor.from_arrays(bits, group_size, shape, qt.arrays())   # zero-copy rebuild
    narrow(qt, 2)                                            # its high 2 bit planes: a cheap copy

Layouts: edgemoe.quant.formats. Kernels on the packed codes: edgemoe.kernels.
"""

from .formats import FORMATS, QuantError, QuantFormat, get_format
from .tensor import ARRAY_DTYPES, QuantizedTensor, dequantize_arrays, dequantize_reference, group_layout, narrow, quantize

__all__ = ["ARRAY_DTYPES", "FORMATS", "QuantError", "QuantFormat", "QuantizedTensor", "dequantize_arrays", "dequantize_reference",
           "get_format", "group_layout", "narrow", "quantize"]
