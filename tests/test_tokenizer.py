"""One tokenizer module for every front end (``fastmamba.generation.tokenizer``): chat templates from
every place transformers writes them, message content as text parts, one tokenisation rule
(completions with the tokenizer's special tokens, chats without adding them again), streamed text
that never breaks a character, and the same prompt tokens through the CLI, ``LLM`` and the server.

The checkpoint (``build_text_checkpoint``) is what a user downloads, made tiny: a byte-level BPE
tokenizer trained here with a BOS post-processor and a chat template, written by transformers'
``save_pretrained`` (tokenizer.json, tokenizer_config.json, chat_template.jinja); a 2-layer Mamba-2
model in HF format whose greedy continuation of ``PROMPT`` is scripted: the residual stream carries
the last token's embedding (mixers' out_proj zeroed) and the untied lm_head maps each token of
``SCRIPT`` to the next, so the model answers "café" (its "é" is two byte tokens) and then its EOS.
The CLI and the server run as subprocesses on the ops' PyTorch references (TRITON_INTERPRET unset):
these tests are about text, not kernels.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastmamba.generation.tokenizer import Codec, IncrementalDecoder, normalize_messages

ROOT = Path(__file__).resolve().parents[1]
BOS, EOS = "<s>", "</s>"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["the cat sat on the mat", "hello world", "a cafe in paris", "<|user|> <|assistant|> <|system|>"] * 20
PROMPT = "hello"
ANSWER = "café"  # c, af, then "é" as two byte-level tokens
CHAT = [{"role": "user", "content": "hello world"}]


def build_tokenizer_dir(directory: Path, *, chat_template: str | None = CHAT_TEMPLATE):
    """A trained byte-level BPE tokenizer (300 tokens) whose post-processor puts BOS in front, saved
    by transformers (the template goes to chat_template.jinja). Returns transformers' tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[BOS, EOS, "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token="<unk>")
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(str(directory))
    return hf


def build_text_checkpoint(root: Path) -> Path:
    """tokenizer (``build_tokenizer_dir``) + a scripted Mamba-2 model: greedy from PROMPT says ANSWER, EOS."""
    from safetensors.torch import save_file

    from fastmamba.models import Mamba2Config, Mamba2LM, random_init

    root.mkdir(parents=True, exist_ok=True)
    hf = build_tokenizer_dir(root)
    eos = hf.convert_tokens_to_ids(EOS)
    script = [hf(PROMPT).input_ids[-1], *hf(ANSWER, add_special_tokens=False).input_ids, eos]
    # the chat prompt's last token leads to the answer as well
    chat_last = hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True, return_dict=False)[-1]
    assert len(set(script)) == len(script) and chat_last not in script, (script, chat_last)
    succ = dict(zip(script[:-1], script[1:]))
    succ[chat_last] = script[1]
    cfg = Mamba2Config(d_model=64, n_layer=2, vocab_size=320, d_state=16, headdim=16, ngroups=1, chunk_size=16,
                       tie_embeddings=False)
    model = random_init(Mamba2LM(cfg, device="cpu", dtype=torch.float32), seed=1)
    with torch.no_grad():
        for layer in model.backbone.layers:
            layer.mixer.out_proj.weight.zero_()  # the residual stream is the token's embedding
        model.lm_head.weight.mul_(0.1)
        emb = model.backbone.embeddings.weight
        for t, nxt in succ.items():
            model.lm_head.weight[nxt] = 5 * emb[t] / emb[t].norm()
        ids = torch.tensor([list(succ)])
        assert model(ids)[0].argmax(-1).tolist() == list(succ.values())  # the script holds
    (root / "config.json").write_text(json.dumps({
        "model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 320, "state_size": 16,
        "head_dim": 16, "num_heads": 8, "n_groups": 1, "chunk_size": 16, "tie_word_embeddings": False,
        "eos_token_id": eos}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "model.safetensors"))
    return root


def reference_env() -> dict[str, str]:
    """A subprocess's environment: the ops' PyTorch references (no interpreter), no progress bars."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return dict(env, FASTMAMBA_PROGRESS="0", PYTHONPATH=str(ROOT))


def run_cli(*argv: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastmamba.cli", *argv], capture_output=True, text=True,
                          env=env or reference_env(), cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_text_checkpoint(tmp_path_factory.mktemp("text") / "ckpt")


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


@pytest.fixture
def reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


# ---------------------------------------------------------------------------------------------
# chat templates: every file transformers writes, or an explicit one


def test_template_from_chat_template_jinja(checkpoint, hf_tokenizer):
    assert (checkpoint / "chat_template.jinja").is_file()  # where transformers 5 saves it
    assert "chat_template" not in json.loads((checkpoint / "tokenizer_config.json").read_text())
    codec = Codec(checkpoint)
    assert codec.chat_template == CHAT_TEMPLATE
    want = hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert codec.render_chat(CHAT) == want == f"{BOS}<|user|>hello world{EOS}<|assistant|>"


@pytest.mark.parametrize("where", ["chat_template.json", "tokenizer_config.json", "tokenizer_config.json-named"])
def test_template_from_json_files(tmp_path, where):
    build_tokenizer_dir(tmp_path, chat_template=None)
    assert not (tmp_path / "chat_template.jinja").exists()
    assert Codec(tmp_path).chat_template is None
    if where == "chat_template.json":
        (tmp_path / where).write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    else:
        cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
        cfg["chat_template"] = CHAT_TEMPLATE if where == "tokenizer_config.json" else [
            {"name": "tool_use", "template": "{{ 'tools' }}"}, {"name": "default", "template": CHAT_TEMPLATE}]
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    codec = Codec(tmp_path)
    assert codec.chat_template == CHAT_TEMPLATE
    assert codec.render_chat(CHAT) == f"{BOS}<|user|>hello world{EOS}<|assistant|>"


def test_explicit_template_file_or_text_wins(checkpoint, tmp_path):
    other = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}[assistant]{% endif %}")
    file = tmp_path / "t.jinja"
    file.write_text(other)
    for source in (file, str(file), other):
        codec = Codec(checkpoint, chat_template=source)
        assert codec.render_chat(CHAT) == "[user] hello world\n[assistant]"
    with pytest.raises(FileNotFoundError, match="neither a file nor a Jinja template"):
        Codec(checkpoint, chat_template=str(tmp_path / "missing.jinja"))


def test_no_template_is_a_clear_error(tmp_path):
    build_tokenizer_dir(tmp_path, chat_template=None)
    with pytest.raises(ValueError, match="no chat template .*chat_template.jinja"):
        Codec(tmp_path).render_chat(CHAT)


# ---------------------------------------------------------------------------------------------
# messages


def test_content_as_text_parts(checkpoint):
    codec = Codec(checkpoint)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
    assert codec.render_chat(parts) == codec.render_chat([{"role": "user", "content": "hello\nworld"}])
    assert normalize_messages([{"role": "assistant", "content": None}]) == [{"role": "assistant", "content": ""}]


@pytest.mark.parametrize("messages,error,match", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], ValueError,
     r"messages\[0\]\.content\[0\]: content parts of type 'image_url' are not supported"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], TypeError, r"content\[0\]\.text: expected a string"),
    ([{"role": "user", "content": 5}], TypeError, r"messages\[0\]\.content: expected a string or a list of text"),
    ([{"content": "hi"}], TypeError, r"messages\[0\]\.role: expected a string"),
    (["hi"], TypeError, r"messages\[0\]: expected a message object"),
    ([], ValueError, "the conversation is empty"),
    ("hi", TypeError, "expected a list of message objects"),
], ids=["image-part", "text-not-str", "content-int", "no-role", "str-message", "empty", "str"])
def test_bad_messages_are_named(messages, error, match):
    with pytest.raises(error, match=match):
        normalize_messages(messages)


# ---------------------------------------------------------------------------------------------
# one tokenisation rule


def test_prompts_use_the_tokenizers_special_tokens_and_chats_do_not_add_them_again(checkpoint, hf_tokenizer):
    codec = Codec(checkpoint)
    bos = hf_tokenizer.convert_tokens_to_ids(BOS)
    ids = codec.encode_prompt(PROMPT)
    assert ids == hf_tokenizer(PROMPT).input_ids and ids[0] == bos  # as transformers' tokenizer(text)
    assert codec.encode(PROMPT) == ids  # the server's call
    chat = codec.encode_chat(CHAT)
    assert chat == hf_tokenizer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True,
                                                    return_dict=False)
    assert chat[0] == bos and chat[1] != bos  # the template's BOS, once


@pytest.mark.parametrize("flags", [{"add_bos_token": False}, {"add_bos_token": True, "add_eos_token": True},
                                   {"add_eos_token": True}], ids=["no-bos", "bos-eos", "eos"])
def test_same_ids_as_transformers_whatever_the_config_flags(tmp_path, flags):
    """tokenizer_config.json's add_bos_token / add_eos_token beside a tokenizer.json that has its
    post-processor: transformers (5.x, the generic tokenizer class) encodes by the post-processor, so do we."""
    from transformers import AutoTokenizer

    build_tokenizer_dir(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, **flags}))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    codec = Codec(tmp_path)
    for text in (PROMPT, "a cafe"):
        assert codec.encode_prompt(text) == hf(text).input_ids, (text, flags)
    assert codec.encode_chat(CHAT) == hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True,
                                                             return_dict=False)


# ---------------------------------------------------------------------------------------------
# streamed text


def test_incremental_decoding_never_breaks_a_character(checkpoint):
    codec = Codec(checkpoint)
    ids = codec.encode_prompt("a café, the café") + codec.tokenizer.encode(EOS, add_special_tokens=False).ids
    assert any(codec.decode(ids[:i]).endswith("\ufffd") for i in range(len(ids)))  # "é" spans two tokens
    stream = codec.stream()
    pieces = [stream.push(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.flush() == codec.decode(ids) == "a café, the café"


def test_incremental_decoding_with_a_sentencepiece_style_decoder():
    """Metaspace (Llama / SentencePiece): a decode that starts at a word drops its leading space;
    the window keeps the spaces between the pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS + ["café au lait"], trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    ids = tok.encode("the café sat on a mat").ids
    stream = IncrementalDecoder(tok.decode)
    text = "".join(stream.push(t) for t in ids) + stream.flush()
    assert text == tok.decode(ids) == "the café sat on a mat"


def test_incremental_decoding_flushes_a_cut_character(checkpoint):
    codec = Codec(checkpoint)
    ids = codec.tokenizer.encode("é", add_special_tokens=False).ids
    assert len(ids) == 2
    stream = IncrementalDecoder(codec.decode)
    assert stream.push(ids[0]) == ""
    assert stream.flush() == "\ufffd"  # the output ended inside the character: said, not dropped


def test_cli_streams_whole_characters(checkpoint):
    proc = run_cli("generate", "--model", str(checkpoint), "--prompt", PROMPT, "--max-new-tokens", "8",
                   "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ANSWER + "\n"  # stopped at the checkpoint's EOS; "é" printed whole


# ---------------------------------------------------------------------------------------------
# the codec's own errors (the LLM and the server pass their tokenizer arguments here)


def test_codec_arguments(tmp_path, checkpoint):
    with pytest.raises(TypeError, match="tokenizer: expected a directory path .* got int"):
        Codec(123)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        Codec(tmp_path / "nope")
    with pytest.raises(NotADirectoryError, match="is a file"):
        Codec(checkpoint / "tokenizer.json")
    assert not Codec(tmp_path).has_text  # a model directory without a tokenizer: token ids only
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        Codec(tmp_path, required=True)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        Codec(None).encode_prompt("hi")


def test_server_module_reexports_the_codec():
    from fastmamba.serve import tokenization

    assert tokenization.Codec is Codec


# ---------------------------------------------------------------------------------------------
# the same prompt tokens through the three front ends


def test_same_prompt_tokens_through_cli_llm_and_server(checkpoint, hf_tokenizer, tmp_path, reference_ops):
    import openai

    from fastmamba import LLM, SamplingParams
    from tests.serve.conftest import Server

    want = hf_tokenizer(PROMPT).input_ids  # transformers' rule: with the BOS
    cli = run_cli("generate", "--model", str(checkpoint), "--prompt", PROMPT, "--max-new-tokens", "8",
                  "--device", "cpu")
    assert cli.returncode == 0, cli.stderr
    assert f"prompt {len(want)} tokens, cpu]" in cli.stderr and cli.stdout == ANSWER + "\n"

    llm = LLM(str(checkpoint), device="cpu", dtype="fp32", max_batch=2)
    out = llm.generate(PROMPT, SamplingParams(max_new_tokens=8))[0]
    assert out.prompt_token_ids == want and out.text == ANSWER and out.finish_reason == "stop"
    chat = llm.chat(CHAT, SamplingParams(max_new_tokens=8))[0]
    chat_ids = hf_tokenizer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert chat.prompt_token_ids == chat_ids and chat.text == ANSWER

    server = Server([], tmp_path, model=str(checkpoint))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        c = client.completions.create(model=str(checkpoint), prompt=PROMPT, max_tokens=8, temperature=0)
        assert c.usage.prompt_tokens == len(want) and c.choices[0].text == ANSWER
        r = client.chat.completions.create(model=str(checkpoint), messages=CHAT, max_tokens=8, temperature=0)
        assert r.usage.prompt_tokens == len(chat_ids) and r.choices[0].message.content == ANSWER
    finally:
        server.terminate()
