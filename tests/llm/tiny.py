"""Tiny random checkpoints in the three on-disk formats, and independent reference forwards.

The writers follow each format's own conventions (Meta: interleaved-pair RoPE rows;
HF: half rotation; GGUF llama: Meta's layout; GGUF qwen2: HF's layout; GPT-2: Conv1D
[in, out] weights and a fused c_attn). The reference forwards are written from the
papers' formulations (complex rotation for Meta RoPE, rotate_half for HF RoPE, a loop
over heads), in float64, sharing no code with execupy.llm.export.models.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

LLAMA_SHAPE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=98, hidden_dim=96,
                   norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64)
GPT2_SHAPE = dict(dim=48, n_layers=2, n_heads=4, vocab_size=89, hidden_dim=192, norm_eps=1e-5, max_seq_len=40)


# ----------------------------------------------------------------------------- weights


def random_llama_weights(seed: int, qkv_bias: bool = False, tied: bool = False, **shape) -> dict[str, np.ndarray]:
    """Meta-named random weights (the RoPE layout is whatever the caller declares it to be)."""
    s = {**LLAMA_SHAPE, **shape}
    rng = np.random.default_rng(seed)
    hd = s["dim"] // s["n_heads"]
    normal = lambda *shp, scale=0.2: (rng.standard_normal(shp) * scale).astype(np.float32)  # noqa: E731
    w = {"tok_embeddings.weight": normal(s["vocab_size"], s["dim"], scale=1.0),
         "norm.weight": 1 + normal(s["dim"], scale=0.1)}
    for i in range(s["n_layers"]):
        p = f"layers.{i}."
        w[p + "attention_norm.weight"] = 1 + normal(s["dim"], scale=0.1)
        w[p + "ffn_norm.weight"] = 1 + normal(s["dim"], scale=0.1)
        w[p + "attention.wq.weight"] = normal(s["n_heads"] * hd, s["dim"])
        w[p + "attention.wk.weight"] = normal(s["n_kv_heads"] * hd, s["dim"])
        w[p + "attention.wv.weight"] = normal(s["n_kv_heads"] * hd, s["dim"])
        w[p + "attention.wo.weight"] = normal(s["dim"], s["n_heads"] * hd)
        w[p + "feed_forward.w1.weight"] = normal(s["hidden_dim"], s["dim"])
        w[p + "feed_forward.w2.weight"] = normal(s["dim"], s["hidden_dim"])
        w[p + "feed_forward.w3.weight"] = normal(s["hidden_dim"], s["dim"])
        if qkv_bias:
            for proj, rows in (("wq", s["n_heads"] * hd), ("wk", s["n_kv_heads"] * hd), ("wv", s["n_kv_heads"] * hd)):
                w[p + f"attention.{proj}.bias"] = normal(rows, scale=0.5)
    if not tied:
        w["output.weight"] = normal(s["vocab_size"], s["dim"])
    return w


def random_gpt2_weights(seed: int, **shape) -> dict[str, np.ndarray]:
    """HF GPT-2 names and layouts (Conv1D weights are [in, out])."""
    s = {**GPT2_SHAPE, **shape}
    rng = np.random.default_rng(seed)
    normal = lambda *shp, scale=0.2: (rng.standard_normal(shp) * scale).astype(np.float32)  # noqa: E731
    d, h = s["dim"], s["hidden_dim"]
    w = {"transformer.wte.weight": normal(s["vocab_size"], d, scale=1.0),
         "transformer.wpe.weight": normal(s["max_seq_len"], d, scale=0.5),
         "transformer.ln_f.weight": 1 + normal(d, scale=0.1), "transformer.ln_f.bias": normal(d, scale=0.1)}
    for i in range(s["n_layers"]):
        p = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            w[p + f"{ln}.weight"] = 1 + normal(d, scale=0.1)
            w[p + f"{ln}.bias"] = normal(d, scale=0.1)
        for name, (n_in, n_out) in {"attn.c_attn": (d, 3 * d), "attn.c_proj": (d, d),
                                    "mlp.c_fc": (d, h), "mlp.c_proj": (h, d)}.items():
            w[p + f"{name}.weight"] = normal(n_in, n_out)
            w[p + f"{name}.bias"] = normal(n_out, scale=0.1)
    return w


def meta_to_hf_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's convert_llama_weights_to_hf.py permute(): interleaved-pair rows -> half rotation."""
    dim1 = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, dim1 // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------- writers


def write_meta(folder: Path, w: dict[str, np.ndarray], shards: int = 1, **shape) -> Path:
    """params.json + consolidated.0N.pth, split like Meta's model-parallel checkpoints."""
    s = {**LLAMA_SHAPE, **shape}
    folder.mkdir(parents=True, exist_ok=True)
    params = {"dim": s["dim"], "n_layers": s["n_layers"], "n_heads": s["n_heads"], "n_kv_heads": s["n_kv_heads"],
              "vocab_size": -1, "multiple_of": 32, "norm_eps": s["norm_eps"], "rope_theta": s["rope_theta"],
              "max_seq_len": s["max_seq_len"]}
    (folder / "params.json").write_text(json.dumps(params))
    # Column-parallel layers split their output rows, row-parallel ones their input columns.
    split_axis = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1, "tok_embeddings": 1}
    for k in range(shards):
        part = {}
        for name, value in w.items():
            axis = split_axis.get(name.split(".")[-2]) if value.ndim == 2 else None
            if axis is not None and shards > 1:
                value = np.split(value, shards, axis=axis)[k]
            part[name] = torch.from_numpy(np.ascontiguousarray(value))
        torch.save(part, folder / f"consolidated.{k:02d}.pth")
    return folder


def write_hf_llama(folder: Path, w: dict[str, np.ndarray], model_type: str = "llama", permute: bool = True,
                   tied: bool = False, extra_config: dict | None = None, **shape) -> Path:
    """config.json + two .safetensors files; ``permute`` converts Meta RoPE rows to HF's."""
    from safetensors.numpy import save_file

    s = {**LLAMA_SHAPE, **shape}
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": model_type, "hidden_size": s["dim"], "num_hidden_layers": s["n_layers"],
              "num_attention_heads": s["n_heads"], "num_key_value_heads": s["n_kv_heads"],
              "vocab_size": s["vocab_size"], "intermediate_size": s["hidden_dim"], "rms_norm_eps": s["norm_eps"],
              "rope_theta": s["rope_theta"], "max_position_embeddings": s["max_seq_len"],
              "tie_word_embeddings": tied, **(extra_config or {})}
    (folder / "config.json").write_text(json.dumps(config))
    names = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj", "feed_forward.w3": "mlp.up_proj"}
    files: list[dict[str, np.ndarray]] = [{}, {}]
    for name, value in w.items():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            base, kind = rest.rsplit(".", 1)
            if permute and base in ("attention.wq", "attention.wk"):
                value = meta_to_hf_rows(value, s["n_heads"] if base == "attention.wq" else s["n_kv_heads"])
            files[int(i) % 2][f"model.layers.{i}.{names[base]}.{kind}"] = np.ascontiguousarray(value)
        else:
            hf = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}[name]
            files[0][hf] = value
    for k, tensors in enumerate(files):
        save_file(tensors, str(folder / f"model-0000{k + 1}-of-00002.safetensors"))
    return folder


def write_hf_gpt2(folder: Path, w: dict[str, np.ndarray], **shape) -> Path:
    from safetensors.numpy import save_file

    s = {**GPT2_SHAPE, **shape}
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "gpt2", "n_embd": s["dim"], "n_layer": s["n_layers"], "n_head": s["n_heads"],
              "vocab_size": s["vocab_size"], "n_positions": s["max_seq_len"], "n_inner": s["hidden_dim"],
              "layer_norm_epsilon": s["norm_eps"]}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(dict(w), str(folder / "model.safetensors"))
    return folder


def write_gguf(path: Path, arch: str, w: dict[str, np.ndarray], qtypes: dict[str, object] | None = None,
               tokenizer: dict | None = None, **shape) -> Path:
    """A GGUF written with gguf.GGUFWriter. ``w`` uses Meta names (llama/qwen2) stored as
    given, or HF GPT-2 names (gpt2). ``qtypes`` maps a GGUF tensor name to a quantization type to quantize it to, or to a
    (raw blocks, type) pair written as is."""
    import gguf

    gpt2 = arch == "gpt2"
    s = {**(GPT2_SHAPE if gpt2 else LLAMA_SHAPE), **shape}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-test")
    writer.add_block_count(s["n_layers"])
    writer.add_context_length(s["max_seq_len"])
    writer.add_embedding_length(s["dim"])
    writer.add_feed_forward_length(s["hidden_dim"])
    writer.add_head_count(s["n_heads"])
    writer.add_vocab_size(s["vocab_size"])
    if gpt2:
        writer.add_layer_norm_eps(s["norm_eps"])
    else:
        writer.add_head_count_kv(s["n_kv_heads"])
        writer.add_layer_norm_rms_eps(s["norm_eps"])
        writer.add_rope_freq_base(s["rope_theta"])
    if tokenizer:
        _add_gguf_tokenizer(writer, tokenizer)
    tensors = _gguf_gpt2_tensors(w) if gpt2 else _gguf_llama_tensors(w)
    for name, value in tensors.items():
        qtype = (qtypes or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, np.ascontiguousarray(value))
        elif isinstance(qtype, tuple):  # (raw quantized blocks, their type)
            writer.add_tensor(name, qtype[0], raw_dtype=qtype[1])
        else:
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_llama_tensors(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    block = {"attention_norm": "attn_norm", "attention.wq": "attn_q", "attention.wk": "attn_k",
             "attention.wv": "attn_v", "attention.wo": "attn_output", "ffn_norm": "ffn_norm",
             "feed_forward.w1": "ffn_gate", "feed_forward.w2": "ffn_down", "feed_forward.w3": "ffn_up"}
    out = {}
    for name, value in w.items():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            base, kind = rest.rsplit(".", 1)
            out[f"blk.{i}.{block[base]}.{kind}"] = value
        else:
            out[{"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                 "output.weight": "output.weight", "rope_freqs.weight": "rope_freqs.weight"}[name]] = value
    return out


def _gguf_gpt2_tensors(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    # llama.cpp's GPT-2 converter transposes Conv1D weights to [out, in] and keeps c_attn fused.
    names = {"ln_1": "attn_norm", "ln_2": "ffn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
             "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    out = {"token_embd.weight": w["transformer.wte.weight"], "position_embd.weight": w["transformer.wpe.weight"],
           "output_norm.weight": w["transformer.ln_f.weight"], "output_norm.bias": w["transformer.ln_f.bias"]}
    for name, value in w.items():
        if name.startswith("transformer.h."):
            _, _, i, rest = name.split(".", 3)
            base, kind = rest.rsplit(".", 1)
            out[f"blk.{i}.{names[base]}.{kind}"] = value.T if (kind == "weight" and value.ndim == 2) else value
    return out


def _add_gguf_tokenizer(writer, t: dict) -> None:
    writer.add_tokenizer_model(t["model"])
    if "pre" in t:
        writer.add_tokenizer_pre(t["pre"])
    writer.add_token_list(t["tokens"])
    writer.add_token_types(t["types"])
    if "scores" in t:
        writer.add_token_scores(t["scores"])
    if "merges" in t:
        writer.add_token_merges(t["merges"])
    for key in ("bos", "eos", "unk"):
        if key in t:
            getattr(writer, f"add_{key}_token_id")(t[key])
    if "add_bos" in t:
        writer.add_add_bos_token(t["add_bos"])
    if "chat_template" in t:
        writer.add_chat_template(t["chat_template"])


# ----------------------------------------------------------------------------- references


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; loops over heads so GQA is spelled out."""
    T, H, D = q.shape
    group = H // k.shape[1]
    mask = torch.triu(torch.full((T, T), float("-inf"), dtype=q.dtype), 1)
    heads = []
    for h in range(H):
        scores = q[:, h] @ k[:, h // group].T / math.sqrt(D) + mask
        heads.append(torch.softmax(scores, -1) @ v[:, h // group])
    return torch.stack(heads, 1).reshape(T, H * D)


def reference_llama_logits(w: dict[str, np.ndarray], tokens: list[int], rope: str,
                           dtype: torch.dtype = torch.float64, **shape) -> np.ndarray:
    """Full-sequence Llama forward on Meta-named weights; ``rope`` is 'interleaved'
    (Meta: complex multiplication of consecutive pairs) or 'half' (HF: rotate_half)."""
    s = {**LLAMA_SHAPE, **shape}
    T = len(tokens)
    H, Hkv = s["n_heads"], s["n_kv_heads"]
    D = s["dim"] // H
    t = lambda name: torch.from_numpy(np.array(w[name])).to(dtype)  # noqa: E731
    freqs = 1.0 / (s["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.outer(torch.arange(T, dtype=torch.float64), freqs).to(dtype)  # [T, D/2]

    def rotate(x: torch.Tensor) -> torch.Tensor:  # x: [T, heads, D]
        if rope == "interleaved":
            xc = torch.view_as_complex(x.reshape(T, x.shape[1], D // 2, 2).contiguous())
            return torch.view_as_real(xc * torch.polar(torch.ones_like(angles), angles)[:, None]).reshape(x.shape)
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]
        rotated = torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1)
        return x * cos + rotated * sin

    def linear(x, name):
        y = x @ t(name + ".weight").T
        return y + t(name + ".bias") if name + ".bias" in w else y

    x = t("tok_embeddings.weight")[tokens]
    for i in range(s["n_layers"]):
        p = f"layers.{i}."
        h = _rms(x, t(p + "attention_norm.weight"), s["norm_eps"])
        q = rotate(linear(h, p + "attention.wq").reshape(T, H, D))
        k = rotate(linear(h, p + "attention.wk").reshape(T, Hkv, D))
        v = linear(h, p + "attention.wv").reshape(T, Hkv, D)
        x = x + linear(_causal_attention(q, k, v), p + "attention.wo")
        h = _rms(x, t(p + "ffn_norm.weight"), s["norm_eps"])
        gate = linear(h, p + "feed_forward.w1")
        x = x + linear(gate * torch.sigmoid(gate) * linear(h, p + "feed_forward.w3"), p + "feed_forward.w2")
    out = t("output.weight" if "output.weight" in w else "tok_embeddings.weight")
    return (_rms(x, t("norm.weight"), s["norm_eps"]) @ out.T).double().numpy()


def reference_gpt2_logits(w: dict[str, np.ndarray], tokens: list[int], **shape) -> np.ndarray:
    """Full-sequence float64 GPT-2 forward on HF weights (Conv1D: y = x @ W + b)."""
    s = {**GPT2_SHAPE, **shape}
    T, H = len(tokens), s["n_heads"]
    D = s["dim"] // H
    t = lambda name: torch.from_numpy(w["transformer." + name]).double()  # noqa: E731

    def layer_norm(x, name):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + s["norm_eps"]) * t(name + ".weight") + t(name + ".bias")

    def conv1d(x, name):
        return x @ t(name + ".weight") + t(name + ".bias")

    x = t("wte.weight")[tokens] + t("wpe.weight")[:T]
    for i in range(s["n_layers"]):
        p = f"h.{i}."
        q, k, v = conv1d(layer_norm(x, p + "ln_1"), p + "attn.c_attn").split(s["dim"], -1)
        att = _causal_attention(q.reshape(T, H, D), k.reshape(T, H, D), v.reshape(T, H, D))
        x = x + conv1d(att, p + "attn.c_proj")
        h = conv1d(layer_norm(x, p + "ln_2"), p + "mlp.c_fc")
        gelu = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
        x = x + conv1d(gelu, p + "mlp.c_proj")
    return (layer_norm(x, "ln_f") @ t("wte.weight").T).numpy()
