"""Healing fine-tune: only the latent path trains, and a few steps reduce the loss (tiny model, CPU)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quantmla.models.convert import ConvertConfig, convert_model
from quantmla.models.heal import HealConfig, heal, trainable_parameters

CALIB = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(1))


def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(cfg).eval()


def test_heal_trains_latent_path_only_and_reduces_loss():
    teacher = tiny_llama()
    student, _ = convert_model(teacher, None, ConvertConfig(variant="b", latent_multiple=16), calib_ids=CALIB)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    trainable = {id(p) for p in trainable_parameters(student)}
    assert trainable and len(trainable) < len(before)
    ids = torch.randint(0, 128, (64 * 8,), generator=torch.Generator().manual_seed(5))
    losses = heal(student, teacher, ids, HealConfig(steps=30, batch=4, seq=64, lr=3e-3, warmup=3), progress=False)
    assert sum(losses[-5:]) < sum(losses[:5])
    for n, p in student.named_parameters():
        changed = not torch.equal(p, before[n])
        assert changed == any(
            f".self_attn.{t}." in n for t in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "q_proj")
        ), n
