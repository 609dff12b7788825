"""Tiny checkpoints as a user meets them: a random Mamba-2 and a random Nemotron-H model written by
transformers' ``save_pretrained``, each with a BPE tokenizer trained here and saved by
``PreTrainedTokenizerFast.save_pretrained`` (current transformers writes the chat template to
``chat_template.jinja``, not into tokenizer_config.json)."""
from __future__ import annotations

import os

VOCAB = 320
CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "hello world, how are you today? I am fine, thank you",
    "mamba models keep a fixed state per request while attention keeps every token",
    "one two three four five six seven eight nine ten eleven twelve",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 fa\u00e7ade",
]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def save_tokenizer(directory) -> None:
    """A byte-level BPE tokenizer of at most VOCAB ids, trained on CORPUS, with a BOS post-processor
    and a chat template, saved by transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    assert os.path.isfile(os.path.join(directory, "chat_template.jinja")), os.listdir(directory)
    assert tok.get_vocab_size() <= VOCAB


def _randomise(model) -> None:
    import torch

    with torch.no_grad():  # larger weights than the default init, so every layer moves the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith(".D"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() == 2:
                p.copy_(torch.randn_like(p) * 0.1)


def save_mamba2(directory, *, seed: int = 0, eos_token_id: int | None = 1) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Mamba2Config(
        hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2, state_size=16, n_groups=1,
        vocab_size=VOCAB, conv_kernel=4, chunk_size=8, use_conv_bias=True, use_bias=False, tie_word_embeddings=True,
        residual_in_fp32=True, layer_norm_epsilon=1e-5, eos_token_id=eos_token_id, bos_token_id=0, pad_token_id=0)
    model = transformers.Mamba2ForCausalLM(cfg).float().eval()
    _randomise(model)
    model.save_pretrained(directory)


def save_nemotron_h(directory, *, seed: int = 0, max_position_embeddings: int | None = None,
                    eos_token_id: int | None = 1) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    extra = {} if max_position_embeddings is None else {"max_position_embeddings": max_position_embeddings}
    cfg = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64, hybrid_override_pattern="M*-M", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=80, mamba_num_heads=6, mamba_head_dim=16,
        n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=8, tie_word_embeddings=False,
        layer_norm_epsilon=1e-5, eos_token_id=eos_token_id, bos_token_id=0, pad_token_id=0, **extra)
    model = transformers.NemotronHForCausalLM(cfg).float().eval()
    _randomise(model)
    model.save_pretrained(directory)


def checkpoint(directory, family: str, **kw) -> str:
    """``family`` "mamba2" or "nemotron_h": the model and the tokenizer in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    (save_mamba2 if family == "mamba2" else save_nemotron_h)(directory, **kw)
    save_tokenizer(directory)
    return str(directory)
