"""The dual-path cache: packed low-bit store + full-precision sink/local buffers, and the transformers
Cache class built on it."""
