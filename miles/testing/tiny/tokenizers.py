"""Tokenizers built in memory (no hub, no vocabulary files) for the tiny pipelines.

Each builder returns a transformers tokenizer of the class the real checkpoint uses, so the tiny pipeline
saves and reloads through `AutoTokenizer.from_pretrained` exactly like a real one:

- `build_clip_tokenizer`: CLIP's byte-level BPE (SD3's two CLIP encoders), every byte a token, no merges.
- `build_t5_tokenizer`: a small T5 Unigram (SD3/FLUX/LTX T5; also UMT5 for Wan, same tokenizer class).
- `build_qwen2_tokenizer`: Qwen2's byte-level BPE with the chat special tokens (Qwen-Image, Cosmos 3).
- `build_gemma_tokenizer`: a Gemma BPE over ASCII characters (the LTX-2 Gemma 3 encoder).

The vocabularies are small (a few hundred entries), so the text encoders' embedding tables stay tiny; the
`vocab_size` to give the text encoder config is `len(tokenizer)`.
"""

from __future__ import annotations

import string
from typing import Sequence

from transformers import CLIPTokenizer, GemmaTokenizer, Qwen2Tokenizer, T5Tokenizer


def _byte_level_alphabet() -> list[str]:
    """The 256 printable characters byte-level BPE maps bytes to (GPT-2's bytes-to-unicode table)."""
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet())


def build_clip_tokenizer(model_max_length: int = 77) -> CLIPTokenizer:
    """Byte-level CLIP BPE: specials, then each byte symbol alone and as a word end (`</w>`), no merges."""
    vocab: dict[str, int] = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for symbol in _byte_level_alphabet():
        vocab[symbol] = len(vocab)
    for symbol in _byte_level_alphabet():
        vocab[symbol + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def build_t5_tokenizer(model_max_length: int = 512, extra_ids: int = 0) -> T5Tokenizer:
    """A small T5 Unigram: pad/eos/unk, the word-start marker, ASCII letters, digits and punctuation.

    Every piece exists both word-initially (`▁a`) and inside a word (`a`), so any ASCII text tokenizes
    without falling back to `<unk>` (non-ASCII characters become `<unk>`, as in a real T5 vocabulary).
    """
    vocab = t5_character_pieces()
    vocab += [(f"<extra_id_{i}>", 0.0) for i in range(extra_ids - 1, -1, -1)]
    return T5Tokenizer(vocab=vocab, extra_ids=extra_ids, model_max_length=model_max_length)


def t5_character_pieces() -> list[tuple[str, float]]:
    """The Unigram pieces of `build_t5_tokenizer` (pad, eos, unk, the word-start marker, ASCII characters)."""
    characters = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation
    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + ch, -3.0) for ch in characters]
    vocab += [(ch, -4.0) for ch in characters]
    return vocab


QWEN2_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# A minimal Qwen chat template (role headers and <|im_end|> separators), enough for `apply_chat_template`.
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_qwen2_tokenizer(
    model_max_length: int = 1024, extra_special_tokens: Sequence[str] = (), chat_template: str | None = QWEN2_CHAT_TEMPLATE
) -> Qwen2Tokenizer:
    """Byte-level Qwen2 BPE: the 256 byte symbols, no merges, then the chat/vision special tokens."""
    vocab = {symbol: i for i, symbol in enumerate(_byte_level_alphabet())}
    for token in (*QWEN2_SPECIAL_TOKENS, *extra_special_tokens):
        vocab.setdefault(token, len(vocab))
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        model_max_length=model_max_length,
        extra_special_tokens=[t for t in (*QWEN2_SPECIAL_TOKENS[1:], *extra_special_tokens)],
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def build_gemma_tokenizer(model_max_length: int = 1024) -> GemmaTokenizer:
    """A small Gemma BPE: its special tokens, the word-start marker `▁`, ASCII characters alone and merged with
    `▁` (a word-initial piece), so any ASCII text tokenizes without `<unk>`."""
    characters = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation
    vocab = {token: i for i, token in enumerate(("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "▁"))}
    for character in characters:
        vocab.setdefault(character, len(vocab))
    for character in characters:
        vocab.setdefault("▁" + character, len(vocab))
    merges = [("▁", character) for character in characters]
    return GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)
