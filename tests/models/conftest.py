"""Fixtures for the model tests: a tiny Llama checkpoint folder with an offline tokenizer, and a calibration text."""

from __future__ import annotations

import pytest
import torch

TEXT = "\n\n".join(
    f"Paragraph {i}: the grass is green, the sky is blue, and {i * 7} birds sing over the hills of the river."
    for i in range(400)
)


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=126, special_tokens=["<eos>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:100])  # fmt: skip
    tok.train_from_iterator([TEXT[:4000]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


@pytest.fixture(scope="session")
def source_dir(tmp_path_factory):
    """A Llama checkpoint folder (6 heads, 3 KV heads of 16) + tokenizer, as ``quantmla convert --source`` takes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, head_dim=16, max_position_embeddings=512,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, tie_word_embeddings=False,
                      eos_token_id=0, pad_token_id=1, bos_token_id=None)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(d)
    make_tokenizer().save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def calib_text(tmp_path_factory):
    p = tmp_path_factory.mktemp("corpus") / "calib.txt"
    p.write_text(TEXT)
    return str(p)
