"""quantmla.eval: perplexity, RULER-style needle retrieval and passkey, the evaluation harness, an lm-eval adapter
and plots. Submodules import torch/transformers; nothing here initializes CUDA."""
