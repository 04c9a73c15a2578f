"""QuantMLACache on CUDA against the same cache on the CPU (fused writer and GPU attention vs torch references)."""

import pytest
import torch

from quantmla.cache.hf import QuantMLACache
from quantmla.compat import with_cache
from quantmla.mla.attention import disable_absorbed_attention, enable_absorbed_attention
from quantmla.mla.spec import MLASpec
from quantmla.mla.tiny import tiny_model
from quantmla.quant.formats import CachePolicy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def spec(layers=2):
    return MLASpec(model_type="deepseek_v3", num_layers=layers, hidden_size=64, num_heads=16, kv_lora_rank=512,
                   qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None, rope_pairing="half",
                   softmax_scale=192**-0.5, latent_norm=True)  # fmt: skip


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("fmt", ["bf16", "c8r8", "c4r4", "c2r4", "c4r16", "c4r4t", "c2r4t"])
def test_same_bytes_and_attention_as_on_the_cpu(fmt):
    """DeepSeek widths: the same BF16 latents written on both devices give the same pages bit for bit; prefill
    (SDPA on CUDA) and decode (the kernels) agree with the CPU's fp32 references."""
    g = torch.Generator().manual_seed(0)
    B, N, H = 3, 700, 16
    c = (torch.randn(B, N + 1, 512, generator=g)).bfloat16()
    k = (torch.randn(B, N + 1, 64, generator=g)).bfloat16()
    q = torch.randn(B, H, N, 512, generator=g) * 0.05, torch.randn(B, H, N, 64, generator=g) * 0.05
    outs = {}
    for dev in ("cpu", "cuda"):
        cache = QuantMLACache(spec(), fmt, CachePolicy())
        lay = cache.mla_layer(0)
        lay.write(c[:, :N].to(dev), k[:, :N].to(dev))
        pre = lay.attend(q[0].to(dev), q[1].to(dev), 0.07).cpu()
        lay.write(c[:, N:].to(dev), k[:, N:].to(dev))
        dec = lay.attend(q[0][:, :, -1:].to(dev), q[1][:, :, -1:].to(dev), 0.07).cpu()
        outs[dev] = (lay.view.pool.cpu(), lay.view.sink.cpu(), lay.view.local.cpu(), pre, dec)
    for i in range(3):
        assert torch.equal(outs["cpu"][i].view(torch.uint8), outs["cuda"][i].view(torch.uint8))
    assert _rel(outs["cuda"][3], outs["cpu"][3]) < 1e-2  # prefill: BF16 workspace and queries
    assert _rel(outs["cuda"][4], outs["cpu"][4]) < 1e-2  # decode kernel: fp16/bf16 operands


@pytest.mark.parametrize("fmt", ["bf16", "c4r4", "c2r4"])
def test_model_on_cuda_matches_cpu(fmt):
    """A tiny fp32 model in absorbed form: prefill and 16 teacher-forced decode steps on CUDA vs CPU."""
    model = tiny_model("deepseek_v3", first_k_dense_replace=99)
    ids = torch.randint(0, model.config.vocab_size, (2, 200), generator=torch.Generator().manual_seed(3))
    logits = {}
    enable_absorbed_attention(model)
    for dev in ("cpu", "cuda"):
        m = model.to(dev)
        cache = QuantMLACache(m.config, fmt, CachePolicy(4, 32))
        steps = []
        with torch.no_grad():
            steps.append(m(ids[:, :184].to(dev), **with_cache(cache)).logits[:, -1].cpu())
            for i in range(184, 200):
                steps.append(m(ids[:, i : i + 1].to(dev), **with_cache(cache)).logits[:, -1].cpu())
        logits[dev] = torch.stack(steps)
    disable_absorbed_attention(model)
    model.cpu()
    for s in range(logits["cpu"].shape[0]):
        assert _rel(logits["cuda"][s], logits["cpu"][s]) < 2e-2, f"step {s}"
