"""Run one small decode per format with synchronization after every launch (for compute-sanitizer)."""

import sys

import torch

from quantmla.kernels import triton_decode
from quantmla.kernels.paged import PagedMLACache
from quantmla.quant.formats import CachePolicy

fmt = sys.argv[1] if len(sys.argv) > 1 else "c8r8"
lens = [0, 1, 17, 127, 128, 129, 4097]
B, N = len(lens), max(lens)
kv = torch.randn(B, N, 576, device="cuda").bfloat16()
c = PagedMLACache(fmt, B, N, policy=CachePolicy(), device="cuda", shuffle=True, fill_byte=0xFF,
                  num_pages=sum(-(-n // 64) for n in lens) + 2)  # fmt: skip
c.write(kv[..., :512], kv[..., 512:], lens, impl="triton")
torch.cuda.synchronize()
print("written", flush=True)
q = torch.randn(B, 16, 512, device="cuda").bfloat16()
qp = torch.randn(B, 16, 64, device="cuda").bfloat16()
out = triton_decode.decode_attention_triton(q, qp, c, 0.07)
torch.cuda.synchronize()
print("decoded", out.isfinite().all().item(), flush=True)
