//! Quantization formats (QARL.md section 3), packing, and the quantized linear layer.
