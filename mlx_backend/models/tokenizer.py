"""The tokenizer stored in a GGUF file, as a Hugging Face fast tokenizer wrapped for mlx-lm.

A ``tokenizer.ggml.model == "gpt2"`` GGUF holds a byte-level BPE: ``tokenizer.ggml.tokens`` (the
vocabulary, index = id), ``tokenizer.ggml.merges`` (``"a b"`` strings in rank order),
``tokenizer.ggml.token_type`` (1 normal, 3 control, 4 user-defined), the bos/eos ids, whether to add
bos, and ``tokenizer.chat_template``. ``tokenizer.ggml.pre`` names llama.cpp's pre-tokenizer
(``llama-vocab.cpp``); for ``smollm`` it splits every digit off, then applies GPT-2's regex, which is
the ``tokenizers`` pair ``Digits(individual_digits=True)`` + ``ByteLevel(use_regex=True)``.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

from mlx_backend.models.gguf_file import GGUFError, default_model_path, metadata_value, read_gguf

TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's LLAMA_TOKEN_TYPE_*)

# tokenizer.ggml.pre -> the pre-tokenizer llama.cpp applies before byte-level BPE.
_PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
}


def _byte_level_bpe(metadata: dict) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` for a gpt2-style GGUF vocabulary (see the module docstring)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"unsupported GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2') is mapped; "
            "use an mlx-lm model directory (with tokenizer.json) for this model"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(
            f"unsupported GGUF pre-tokenizer {pre!r} (mapped: {', '.join(_PRE_TOKENIZERS)}); "
            "use an mlx-lm model directory (with tokenizer.json) for this model"
        )
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    # SmolLM2's vocabulary lacks 21 of the 256 byte tokens (e.g. 0x04, 0xF1): such bytes become unk
    unk_id = metadata_value(metadata, "tokenizer.ggml.unknown_token_id", None)
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token=unk))
    tok.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    types = metadata["tokenizer.ggml.token_type"].tolist()
    tok.add_tokens(
        [AddedToken(tokens[i], special=(t == TOKEN_CONTROL), normalized=False)
         for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    )
    if metadata_value(metadata, "tokenizer.ggml.add_bos_token", False):
        bos = tokens[metadata_value(metadata, "tokenizer.ggml.bos_token_id")]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def hf_tokenizer_from_metadata(metadata: dict) -> PreTrainedTokenizerFast:
    """A transformers ``PreTrainedTokenizerFast`` (chat template included) from GGUF metadata."""
    tokens = metadata["tokenizer.ggml.tokens"]

    def special(key: str) -> str | None:
        token_id = metadata_value(metadata, f"tokenizer.ggml.{key}_token_id", None)
        return tokens[token_id] if token_id is not None else None

    return PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_bpe(metadata),
        bos_token=special("bos"),
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def tokenizer_from_metadata(metadata: dict) -> TokenizerWrapper:
    """mlx-lm ``TokenizerWrapper`` (byte-level streaming detokenizer) from GGUF metadata."""
    eos_ids = [
        metadata_value(metadata, f"tokenizer.ggml.{key}_token_id")
        for key in ("eos", "eot")
        if f"tokenizer.ggml.{key}_token_id" in metadata
    ]
    return TokenizerWrapper(
        hf_tokenizer_from_metadata(metadata),
        detokenizer_class=BPEStreamingDetokenizer,
        eos_token_ids=eos_ids,
    )


def load_gguf_tokenizer(path: str | Path | None = None) -> TokenizerWrapper:
    """The tokenizer of a GGUF file (default: SmolLM2-135M-Instruct), ready for mlx-lm generation."""
    _, metadata = read_gguf(path if path is not None else default_model_path())
    return tokenizer_from_metadata(metadata)
