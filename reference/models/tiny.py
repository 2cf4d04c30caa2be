"""Tiny random model directories in mlx-lm's format, for tests and for trying the loop without a download.

``write_tiny_model(out, arch, seed)`` writes ``config.json`` (accepted by ``mlx_lm.utils.load`` and by
:func:`reference.models.load_model`), ``model.safetensors`` (float32, mlx-lm parameter names, drawn with
NumPy from ``seed``: the same seed gives the same bytes) and a byte-level tokenizer (``tokenizer.json`` +
``tokenizer_config.json`` with a ChatML chat template) that transformers' ``AutoTokenizer`` loads.

Token ids 0..255 are the UTF-8 bytes of the text, so prompts stay readable; 256..258 are
``<|endoftext|>`` (EOS), ``<|im_start|>``, ``<|im_end|>``; the vocabulary is padded to 260.

>>> import tempfile, json, os
>>> out = write_tiny_model(tempfile.mkdtemp(), "qwen3_next", seed=1)
>>> sorted(os.listdir(out))
['config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json']
>>> json.load(open(os.path.join(out, "config.json")))["model_type"]
'qwen3_next'
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from reference.atomic import atomic_files

ARCHS = ("qwen3_5", "qwen3_next", "llama", "llama_sliding")
VOCAB_SIZE = 260
SPECIAL_TOKENS = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
EOS_TOKEN_ID = 256
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=4096,
               eos_token_id=EOS_TOKEN_ID)
_HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_conv_kernel_dim=4, attention_bias=False)

TINY_CONFIGS = {
    # Qwen3.5's text model: 3 GatedDeltaNet layers then 1 attention layer, dense MLP, tied embeddings.
    "qwen3_5": dict(_COMMON, **_HYBRID, model_type="qwen3_5", num_hidden_layers=4, full_attention_interval=4,
                    tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "partial_rotary_factor": 0.25}),
    # Qwen3-Next: GDN, GDN, attention; sparse MoE (4 experts, top 2 + shared expert) except layer 1 (dense).
    "qwen3_next": dict(_COMMON, **_HYBRID, model_type="qwen3_next", num_hidden_layers=3,
                       full_attention_interval=3, tie_word_embeddings=False, rope_theta=10000.0,
                       partial_rotary_factor=0.25, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                       mlp_only_layers=[1], moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       norm_topk_prob=True),
    # Llama / SmolLM2 family: attention only, grouped KV heads, tied embeddings.
    "llama": dict(_COMMON, model_type="llama", num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=True),
    # Llama with sliding-window layers (mistral / gemma style): two layers see the last 4 tokens, one all.
    "llama_sliding": dict(_COMMON, model_type="llama", num_hidden_layers=3, rope_theta=10000.0,
                          tie_word_embeddings=True, sliding_window=4,
                          layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
}


def tiny_config(arch: str, **overrides) -> dict:
    """The tiny config of ``arch`` (one of :data:`ARCHS`) with ``overrides`` applied."""
    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    return {**TINY_CONFIGS[arch], **overrides}


class _Draw:
    """The random tensors of a tiny model, drawn from one generator in a fixed order."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def dense(self, n_out, n_in):  # ~unit-variance outputs for unit-variance inputs
        return (self.rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(self, n):
        return (1 + 0.1 * self.rng.standard_normal(n)).astype(np.float32)

    def bias(self, n):
        return (0.1 * self.rng.standard_normal(n)).astype(np.float32)


def tiny_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights for ``config`` under mlx-lm's parameter names (qwen3_5 gets ``language_model.``)."""
    from reference.models import ARCHITECTURES

    draw, c = _Draw(seed), config
    arch = ARCHITECTURES[c["model_type"]]
    d = c["hidden_size"]
    w = {"model.embed_tokens.weight": (0.1 * draw.rng.standard_normal((c["vocab_size"], d))).astype(np.float32),
         "model.norm.weight": draw.norm(d)}
    if not c["tie_word_embeddings"]:
        w["lm_head.weight"] = draw.dense(c["vocab_size"], d)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = draw.norm(d)
        w[p + "post_attention_layernorm.weight"] = draw.norm(d)
        if arch.is_linear_layer(i, c):
            _linear_attention(w, p + "linear_attn.", c, draw)
        else:
            _attention(w, p + "self_attn.", c, draw)
        _mlp(w, p + "mlp.", c, draw, sparse=arch.is_sparse_layer(i, c))
    if c["model_type"] == "qwen3_5":  # qwen3_5.Model wraps the text model as .language_model
        w = {"language_model." + k: v for k, v in w.items()}
    return w


def _linear_attention(w: dict, g: str, c: dict, draw: _Draw) -> None:
    """A GatedDeltaNet layer's weights (qwen3_5: separate projections; qwen3_next: fused qkvz and ba)."""
    d = c["hidden_size"]
    nk, nv, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                      c["linear_value_head_dim"])
    conv_dim = 2 * nk * dk + nv * dv
    if c["model_type"] == "qwen3_5":
        w[g + "in_proj_qkv.weight"] = draw.dense(conv_dim, d)
        w[g + "in_proj_z.weight"] = draw.dense(nv * dv, d)
        w[g + "in_proj_b.weight"] = draw.dense(nv, d)
        w[g + "in_proj_a.weight"] = draw.dense(nv, d)
    else:
        w[g + "in_proj_qkvz.weight"] = draw.dense(2 * nk * dk + 2 * nv * dv, d)
        w[g + "in_proj_ba.weight"] = draw.dense(2 * nv, d)
    w[g + "conv1d.weight"] = (draw.rng.standard_normal((conv_dim, c["linear_conv_kernel_dim"], 1)) / 2
                              ).astype(np.float32)
    w[g + "A_log"] = np.log(draw.rng.uniform(0.5, 16, nv)).astype(np.float32)
    w[g + "dt_bias"] = (1 + 0.1 * draw.rng.standard_normal(nv)).astype(np.float32)
    w[g + "norm.weight"] = draw.norm(dv)
    w[g + "out_proj.weight"] = draw.dense(d, nv * dv)


def _attention(w: dict, a: str, c: dict, draw: _Draw) -> None:
    """A softmax attention layer's weights (qwen3_5 / qwen3_next: gated queries and q/k norms)."""
    d, hd = c["hidden_size"], c["head_dim"]
    n_q = c["num_attention_heads"] * hd * (1 if c["model_type"] == "llama" else 2)  # + output gate
    w[a + "q_proj.weight"] = draw.dense(n_q, d)
    w[a + "k_proj.weight"] = draw.dense(c["num_key_value_heads"] * hd, d)
    w[a + "v_proj.weight"] = draw.dense(c["num_key_value_heads"] * hd, d)
    w[a + "o_proj.weight"] = draw.dense(d, c["num_attention_heads"] * hd)
    if c.get("attention_bias"):
        for name in ("q_proj", "k_proj", "v_proj"):
            w[a + name + ".bias"] = draw.bias(w[a + name + ".weight"].shape[0])
        w[a + "o_proj.bias"] = draw.bias(d)
    if c["model_type"] != "llama":
        w[a + "q_norm.weight"] = draw.norm(hd)
        w[a + "k_norm.weight"] = draw.norm(hd)


def _mlp(w: dict, m: str, c: dict, draw: _Draw, sparse: bool) -> None:
    """A feed-forward block's weights: SwiGLU, or (``sparse``) Qwen3-Next's experts and shared expert."""
    d = c["hidden_size"]
    if sparse:
        e, f = c["num_experts"], c["moe_intermediate_size"]
        w[m + "gate.weight"] = draw.dense(e, d)
        w[m + "switch_mlp.gate_proj.weight"] = np.stack([draw.dense(f, d) for _ in range(e)])
        w[m + "switch_mlp.up_proj.weight"] = np.stack([draw.dense(f, d) for _ in range(e)])
        w[m + "switch_mlp.down_proj.weight"] = np.stack([draw.dense(d, f) for _ in range(e)])
        fs = c["shared_expert_intermediate_size"]
        w[m + "shared_expert.gate_proj.weight"] = draw.dense(fs, d)
        w[m + "shared_expert.up_proj.weight"] = draw.dense(fs, d)
        w[m + "shared_expert.down_proj.weight"] = draw.dense(d, fs)
        w[m + "shared_expert_gate.weight"] = draw.dense(1, d)
    else:
        f = c["intermediate_size"]
        w[m + "gate_proj.weight"] = draw.dense(f, d)
        w[m + "up_proj.weight"] = draw.dense(f, d)
        w[m + "down_proj.weight"] = draw.dense(d, f)
        if c.get("mlp_bias"):  # llama only
            w[m + "gate_proj.bias"], w[m + "up_proj.bias"], w[m + "down_proj.bias"] = (draw.bias(f), draw.bias(f),
                                                                                        draw.bias(d))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the others to chr(256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


def write_tokenizer(out: str | os.PathLike) -> None:
    """A byte-level tokenizer with no merges: token id = byte value, plus the special tokens."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise ValueError("writing the tiny model's tokenizer needs the tokenizers package: "
                         "pip install tokenizers") from None

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    out = Path(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "add_bos_token": False, "model_max_length": 4096, "chat_template": CHAT_TEMPLATE,
    }, indent=2))


def write_tiny_model(out: str | os.PathLike, arch: str, seed: int = 0, **overrides) -> Path:
    """Write the tiny ``arch`` model drawn from ``seed`` (config ``overrides`` applied) into ``out``; returns it."""
    from safetensors.numpy import save_file

    config = tiny_config(arch, **overrides)
    with atomic_files(out) as tmp:   # all four files or none: never new weights beside an old config
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(tiny_weights(config, seed), str(tmp / "model.safetensors"), metadata={"format": "mlx"})
        write_tokenizer(tmp)
    return Path(out)
