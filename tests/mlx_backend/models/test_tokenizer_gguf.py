"""The tokenizer built from SmolLM2's GGUF metadata: BPE by merge rank, round trips, specials, chat template."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("mlx.core")
from mlx_backend.models import gguf  # noqa: E402
from mlx_backend.models.tokenizer import tokenizer_from_metadata  # noqa: E402


@pytest.fixture(scope="module")
def metadata():
    try:
        path = gguf.default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return gguf.read_gguf(path)[1]


@pytest.fixture(scope="module")
def tok(metadata):
    return tokenizer_from_metadata(metadata)


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet of the vocabulary)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def naive_bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Byte-pair encoding by definition: repeatedly merge the adjacent pair of lowest merge rank."""
    table = _gpt2_bytes_to_unicode()
    parts = [table[b] for b in word.encode()]
    while len(parts) > 1:
        pairs = [(ranks.get((a, b), float("inf")), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank == float("inf"):
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


@settings(max_examples=60, deadline=None)
@given(word=st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=12),
       space=st.booleans())
def test_words_split_by_merge_rank(tok, metadata, word, space):
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(metadata["tokenizer.ggml.merges"])}
    text = (" " if space else "") + word
    assert tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False)) == naive_bpe(text, ranks)


# SmolLM2's vocabulary has no token for these bytes (tokens of its GGUF; checked below), so text
# containing them cannot round-trip: code points above U+3FFFF start with 0xF1..0xF4 in UTF-8.
MISSING_BYTES = {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)}


def test_missing_byte_tokens_become_unk(tok, metadata):
    vocab = set(metadata["tokenizer.ggml.tokens"])
    table = _gpt2_bytes_to_unicode()
    assert {b for b in range(256) if table[b] not in vocab} == MISSING_BYTES
    assert tok.encode("a\x04b", add_special_tokens=False) == tok.encode("a", add_special_tokens=False) + [0] + \
        tok.encode("b", add_special_tokens=False)


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",), max_codepoint=0x3FFFF,
                                  blacklist_characters="".join(chr(b) for b in MISSING_BYTES if b < 0x80)),
                    max_size=60))
def test_any_text_round_trips(tok, text):
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("text", [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return {'a': [1, 2, 3]}[x]  # comment\n\n\tindented\r\n",
    "naïve café, Zürich — 東京 🚀 مرحبا",
    "   leading and trailing spaces   ",
])
def test_english_and_code_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    detok = tok.detokenizer  # mlx-lm's streaming detokenizer gives the same text
    detok.reset()
    for t in ids:
        detok.add_token(t)
    detok.finalize()
    # mlx-lm's BPEStreamingDetokenizer drops one leading space of the stream (its _maybe_trim_space)
    assert detok.text == (text[1:] if text.startswith(" ") else text)


def test_known_pieces(tok):
    assert tok.convert_ids_to_tokens(tok.encode("Hello world", add_special_tokens=False)) == ["Hello", "Ġworld"]
    # SmolLM's pre-tokenizer splits every digit (llama.cpp LLAMA_VOCAB_PRE_TYPE_SMOLLM: "\p{N}" first)
    assert tok.convert_ids_to_tokens(tok.encode(" 2024", add_special_tokens=False)) == ["Ġ", "2", "0", "2", "4"]


def test_special_tokens(tok):
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[::2] == [1, 2]
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert 2 in tok.eos_token_ids
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)  # add_bos false
    assert tok.decode([1, 19556, 2], skip_special_tokens=True) == "Hello"


def test_chat_template(tok):
    messages = [{"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert tok.convert_ids_to_tokens(ids[:3]) == ["<|im_start|>", "system", "Ċ"]
    assert tok.decode(ids) == text


def test_unsupported_tokenizer_model_is_named(metadata):
    with pytest.raises(gguf.GGUFError, match="unsupported GGUF tokenizer model 'llama'"):
        tokenizer_from_metadata({**metadata, "tokenizer.ggml.model": "llama"})
    with pytest.raises(gguf.GGUFError, match="unsupported GGUF pre-tokenizer 'qwen2'"):
        tokenizer_from_metadata({**metadata, "tokenizer.ggml.pre": "qwen2"})


def test_an_end_of_turn_token_also_ends_generation(metadata):
    """``tokenizer.ggml.eot_token_id`` (llama.cpp's end of turn) stops generation as the EOS does: both are
    among the wrapper's ``eos_token_ids`` (SmolLM2's file has none; here <|endoftext|>, id 0, is named)."""
    import mlx.core as mx

    tok = tokenizer_from_metadata({**metadata, "tokenizer.ggml.eot_token_id": mx.array(0, dtype=mx.uint32)})
    assert set(tok.eos_token_ids) == {0, 2}


def test_add_bos_token_prepends_the_bos(metadata):
    """With ``tokenizer.ggml.add_bos_token`` true (SmolLM2's file says false) ``encode`` starts with the BOS
    token (id 1, <|im_start|>) and only with ``add_special_tokens``."""
    import mlx.core as mx

    tok = tokenizer_from_metadata({**metadata, "tokenizer.ggml.add_bos_token": mx.array(True)})
    assert tok.convert_ids_to_tokens(tok.encode("Hello world")) == ["<|im_start|>", "Hello", "Ġworld"]
    assert tok.convert_ids_to_tokens(tok.encode("Hello world", add_special_tokens=False)) == ["Hello", "Ġworld"]


def test_a_user_defined_token_is_one_piece_and_stays_in_the_text(metadata):
    """A user-defined token (``token_type`` 4; SmolLM2's file has none, so <gh_stars>, id 7, is made one here)
    is matched whole, as a control token is, but it is text, not a special token: decoding with
    ``skip_special_tokens`` keeps it, and drops the control tokens around it."""
    import mlx.core as mx

    types = metadata["tokenizer.ggml.token_type"].tolist()
    types[7] = 4
    tok = tokenizer_from_metadata({**metadata, "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32)})
    assert tok.encode("<gh_stars>", add_special_tokens=False) == [7]
    assert tok.decode([1, 7, 19556, 2], skip_special_tokens=True) == "<gh_stars>Hello"
