"""Shared parts of the tiny random-weight pipelines, built offline (no download, no vocab files):
their tokenizers (CLIP, T5, Qwen2, ByT5, Llama 3), a T5 text encoder, a FLUX-style AutoencoderKL.

Every tiny pipeline (``tiny-flux``, ``tiny-wan``, ``tiny-sd3``, ...) needs its family's tokenizer
class, because the diffusers pipeline calls that class's API (a CLIP tokenizer's 77 positions, a
Qwen2 tokenizer's chat template, ...). The vocabularies here are character- or byte-level, so a
prompt costs about one token per character; the text encoders behind them have random weights,
so what a prompt *means* is irrelevant: these exist to run the code path, not to make pictures.
The module constructors draw from torch's global generator: a builder seeds it first.
"""

from __future__ import annotations

from typing import Any

# Qwen2's special tokens, in the order the real vocabulary lists them (the ones diffusers'
# Qwen-family pipelines and transformers' Qwen-VL processors name).
QWEN2_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# The chat template Qwen2.5 / Qwen3 tokenizers ship (system / user / assistant turns), reduced to
# what ``apply_chat_template(..., add_generation_prompt=...)`` needs for text-and-image messages.
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _byte_level_alphabet() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet())


def clip_tokenizer(max_length: int = 77) -> Any:
    """A CLIP BPE tokenizer over single byte-level characters (no merges): every word becomes
    its characters, the last one carrying CLIP's ``</w>`` suffix."""
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {}
    for tok in ("<|startoftext|>", "<|endoftext|>"):
        vocab[tok] = len(vocab)
    for ch in _byte_level_alphabet():
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def t5_tokenizer(max_length: int) -> Any:
    """A T5 Unigram tokenizer over lowercase letters, digits and punctuation (no extra ids).
    UMT5 (Wan) uses the same tokenizer class."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()/"
    pieces += [("▁" + c, -3.0) for c in chars] + [(c, -4.0) for c in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def qwen2_tokenizer(max_length: int = 32768) -> Any:
    """A Qwen2 byte-level BPE tokenizer with no merges (one token per byte) plus Qwen's special
    tokens and a chat template; Qwen-Image's, Z-Image's, FLUX.2 Klein's and HunyuanVideo 1.5's
    pipelines call it as they call the real one (templates, ``apply_chat_template``)."""
    from transformers import AddedToken, Qwen2Tokenizer

    vocab = {ch: i for i, ch in enumerate(_byte_level_alphabet())}
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=max_length,
    )
    tok.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in QWEN2_SPECIAL_TOKENS]}
    )
    tok.chat_template = QWEN2_CHAT_TEMPLATE
    return tok


def byt5_tokenizer(max_length: int = 256) -> Any:
    """transformers' ByT5 tokenizer (bytes, no vocabulary file): HunyuanVideo 1.5's glyph encoder."""
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer(model_max_length=max_length)


def t5_encoder(tokenizer: Any, width: int, heads: int = 2, d_ff: int = 32, **extra: Any) -> Any:
    """A one-layer ``T5EncoderModel`` of width ``width`` (the transformer's text width) over
    ``tokenizer``'s vocabulary, T5 v1.1's gated-GELU feed-forward, in eval mode."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=width, d_kv=8, d_ff=d_ff, num_layers=1, num_heads=heads,
        relative_attention_num_buckets=8, dense_act_fn="gelu_new", feed_forward_proj="gated-gelu",
        is_gated_act=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **extra,
    )).eval()


def autoencoder_kl(latent_channels: int = 16, scaling_factor: float = 0.3611, shift_factor: float = 0.1159) -> Any:
    """FLUX.1's VAE layout in miniature: four levels (vae_scale_factor 8), 8-16 channels, no quant
    convs; FLUX.1's latent scale and shift unless given (SD3.5's are 1.5305 / 0.0609)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=4, sample_size=64, scaling_factor=scaling_factor,
        shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()


# Llama 3's special tokens that HunyuanVideo's prompt template spells out (the real vocabulary
# has 256 reserved ones; these are the ones a template or the tokenizer itself names).
LLAMA3_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>")


def llama3_tokenizer(max_length: int = 8192) -> Any:
    """A ``LlamaTokenizerFast`` over single characters (printable ASCII and the newline, no
    merges; other characters are dropped: the tokenizer's byte fallback finds no byte tokens) plus Llama 3's special tokens as whole tokens: HunyuanVideo's
    prompt template (``<|start_header_id|>system<|end_header_id|>...<|eot_id|>``) tokenizes as it
    does with the real LLaVA-Llama-3 tokenizer, one token per character between the specials.
    Like the real one it prepends ``<|begin_of_text|>``; it pads with ``<|end_of_text|>`` on the
    right (diffusers' HunyuanVideo conversion script loads the tokenizer with
    ``padding_side="right"``)."""
    import string

    from transformers import AddedToken, LlamaTokenizerFast

    chars = sorted(set(string.printable) - set(string.whitespace)) + ["\n", "▁"]  # ▁: the space
    vocab = {t: i for i, t in enumerate(("<unk>", *LLAMA3_SPECIAL_TOKENS[:2], *chars))}
    tok = LlamaTokenizerFast(
        vocab=vocab, merges=[], unk_token="<unk>", bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
        pad_token="<|end_of_text|>", add_bos_token=True, padding_side="right", model_max_length=max_length,
    )
    tok.add_special_tokens({"additional_special_tokens": [
        AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIAL_TOKENS[2:]]})
    return tok
