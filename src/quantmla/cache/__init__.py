"""The MLA cache: every layer in the paged low-bit layout (packed pages + BF16 sink/local buffers), the per-query
mixed-precision policy, and the transformers ``Cache`` class built on it (:class:`quantmla.cache.hf.QuantMLACache`)."""
