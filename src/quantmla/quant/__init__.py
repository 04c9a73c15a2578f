"""Quantization primitives, bit packing and the named cache formats (C4R4, C2R4, ...)."""
