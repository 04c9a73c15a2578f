"""Fixtures for evaluation tests: an offline byte-level BPE tokenizer and a tiny converted MLA model."""

import pytest
import torch

VOCAB = 384


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
        "One of the special magic numbers for ancient-anchor is: 1234567. What is the special magic number?",
        "The pass key is 12345. Remember it. 12345 is the pass key. 0123456789 abcdef-0123",
        "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    ] * 4
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 2,
        special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_mla():
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantmla.models.convert import ConvertConfig, convert_model

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        max_position_embeddings=2048,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=1,
    )
    src = LlamaForCausalLM(cfg).eval()
    calib = torch.randint(0, VOCAB, (256,), generator=torch.Generator().manual_seed(1))
    mla, _ = convert_model(src, None, ConvertConfig(rope_dim=32, latent_multiple=64), calib_ids=calib)
    return src, mla.eval()
