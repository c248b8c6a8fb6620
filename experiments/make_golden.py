"""Writes the golden files of ``tests/golden/``: tiny random Hugging Face models and their outputs.

The tests of ``svflow_jax.checkpoints`` load these models with our loaders and compare the Flax
Transformer's hidden states and logits with the ones stored here, which Hugging Face
``transformers`` computed. CI therefore needs no torch; only this script does. It needs the
optional extra ``golden`` (torch + transformers) and ``gguf``; a separate venv is best::

    python3 -m venv /tmp/golden-venv
    /tmp/golden-venv/bin/pip install torch==2.13.0 transformers safetensors tokenizers gguf numpy
    /tmp/golden-venv/bin/python experiments/make_golden.py

Generated with transformers 5.24.0, torch 2.13.0+cpu, tokenizers 0.23.3, safetensors 0.8.0,
gguf 0.19.0 (CPU, float32, eager attention).

Each ``tests/golden/<name>/`` holds ``config.json`` + ``model.safetensors`` (``save_pretrained``),
a tiny ``tokenizer.json`` trained offline on a few sentences with ``tokenizers``, and
``golden.npz`` (float32): ``input_ids``, ``attention_mask`` (a batch of two sequences of unequal
lengths, padded), optionally ``position_ids`` / ``token_type_ids`` (exactly what was passed to
the model), ``hidden_states`` ``(L + 1, B, n, d)`` from ``output_hidden_states=True`` (for the
decoders the last one is after the final RMSNorm, as transformers reports it) and ``logits``
``(B, n, V)`` (decoders only; BERT is a ``BertModel`` with hidden states only). Every parameter
is redrawn at the scale ``1/sqrt(fan_in)`` (embeddings ``0.3 N(0,1)``, gains ``1 + 0.1 N(0,1)``,
biases ``0.1 N(0,1)``) so
that every branch, bias and gain visibly matters; transformers' own 0.02 init would make the
layers almost the identity. ``llama_gqa_tied/model.gguf`` is the same model as
``llama_gqa_tied`` written as llama.cpp's converter would (float32, Q/K rows permuted, llama.*
metadata, a ``gpt2`` BPE tokenizer section).

The models:

* ``llama_gqa_tied``: Llama, GQA (4 query heads, 2 key/value heads), tied embeddings, default
  RoPE, right padding.
* ``llama3_rope``: Llama, ``rope_type="llama3"`` frequency scaling (every regime: kept, smoothed
  and divided frequencies), separate LM head, MQA, left padding with explicit ``position_ids``.
* ``qwen2``: Qwen2 (Q/K/V biases, no O bias), left padding with explicit ``position_ids``.
* ``qwen3``: Qwen3 (per-head q/k RMSNorm, explicit ``head_dim`` != hidden / heads), tied.
* ``bert``: BertModel (post-norm encoder, learned positions, token types, pooler not used).
* ``gpt2``: GPT-2 (pre-LayerNorm with biases, learned positions, fused ``c_attn``, tanh GELU,
  tied), left padding with explicit ``position_ids``. Written with transformers 5.25.0.
* ``phi3``: Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``, GQA, separate head). 5.25.0.
* ``gpt_neox``: GPT-NeoX/Pythia (parallel attention and MLP, each behind its own LayerNorm,
  partial rotary embeddings on half of each head, fused per-head ``query_key_value``, exact
  GELU, separate head), left padding with ``position_ids``. 5.25.0.
* ``gemma``: Gemma 1 (``(1 + w)`` RMSNorm gains, ``sqrt(d)`` embedding scale, GeGLU with tanh
  GELU, MQA, ``head_dim`` != hidden / heads, tied). 5.25.0.

``python experiments/make_golden.py gpt2 phi3`` writes only the named ones of the last four.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1] / "tests" / "golden"

SENTENCES = [
    "The flow on the sphere is a Transformer in disguise.",
    "A residual step is one forward Euler step, then a retraction.",
    "Attention is a kernel; the softmax normalises it over 17 keys.",
    "Rotary embeddings rotate each pair of coordinates by an angle.",
    "Tiny models, 2 or 3 layers, make golden files that stay small.",
    "Padding tokens never receive attention, 0 weight, exactly.",
]
TEXTS = ["The softmax is a kernel on the sphere.", "A tiny step."]


# ------------------------------------------------------------------------------------------
# Tokenizers (trained offline on the sentences above)
# ------------------------------------------------------------------------------------------


def bpe_tokenizer() -> Tokenizer:
    """A byte-level BPE in SmolLM2's style: single digits, then GPT-2 byte-level pre-tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


def wordpiece_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=200,
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


def batch(tok: Tokenizer, pad_id: int, *, left: bool, cls_sep: tuple[int, int] | None = None):
    seqs = [tok.encode(t).ids for t in TEXTS]
    if cls_sep is not None:
        seqs = [[cls_sep[0], *s, cls_sep[1]] for s in seqs]
    n = max(len(s) for s in seqs)
    ids = np.full((len(seqs), n), pad_id, np.int64)
    mask = np.zeros((len(seqs), n), np.int64)
    for b, s in enumerate(seqs):
        where = slice(n - len(s), n) if left else slice(0, len(s))
        ids[b, where], mask[b, where] = s, 1
    assert mask.sum(1).min() < n, "the batch must have unequal lengths"
    return ids, mask


# ------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------


def redraw(model: torch.nn.Module, seed: int) -> None:
    """Every parameter at a scale where it matters (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            leaf = name.rsplit(".", 1)[-1]
            is_norm = "norm" in name.lower() or ".ln_" in name or name.startswith("ln_")
            if leaf == "bias":
                p.copy_(0.1 * noise)
            elif is_norm and p.ndim == 1:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed" in name or ".wte." in name or ".wpe." in name:  # 0.3: tied logits
                # of order 10, not 30
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise / np.sqrt(p.shape[-1]))


def build(cls, config, seed: int):
    """A model of class ``cls`` with every parameter redrawn (seeded), its head tied when the
    configuration says so."""
    torch.manual_seed(seed)
    model = cls(config)
    redraw(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
        head = model.get_output_embeddings().weight
        assert head is model.get_input_embeddings().weight
    return model


def run(model, ids, mask, **extra) -> dict[str, np.ndarray]:
    model.eval()
    kwargs = {k: torch.as_tensor(v) for k, v in extra.items()}
    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(ids),
            attention_mask=torch.as_tensor(mask),
            output_hidden_states=True,
            **kwargs,
        )
    result = {
        "input_ids": ids,
        "attention_mask": mask,
        "hidden_states": np.stack([h.numpy() for h in out.hidden_states]).astype(np.float32),
    }
    result |= {k: np.asarray(v) for k, v in extra.items()}
    if getattr(out, "logits", None) is not None:
        result["logits"] = out.logits.numpy().astype(np.float32)
    return result


def save(name: str, model, tok: Tokenizer, outputs: dict[str, np.ndarray]) -> Path:
    folder = ROOT / name
    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder, safe_serialization=True)
    for extra in ("generation_config.json",):
        (folder / extra).unlink(missing_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    np.savez_compressed(folder / "golden.npz", **outputs)
    config = json.loads((folder / "config.json").read_text())
    print(f"{name}: rope {config.get('rope_parameters') or config.get('rope_scaling')}, "
          f"tie {config.get('tie_word_embeddings')}, files "
          f"{sorted(p.name for p in folder.iterdir())}")
    return folder


def left_positions(mask: np.ndarray) -> np.ndarray:
    return np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int64)


def make_decoders(bpe: Tokenizer) -> None:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    pad, eos = bpe.token_to_id("<|pad|>"), bpe.token_to_id("<|endoftext|>")
    common = dict(
        vocab_size=320, max_position_embeddings=128, pad_token_id=pad, bos_token_id=eos,
        eos_token_id=eos, attn_implementation="eager",
    )


    # 1. Llama, GQA, tied embeddings, default RoPE, right padding.
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, rope_parameters=rope,
        tie_word_embeddings=True, **common,
    )
    model = build(LlamaForCausalLM, cfg, 1)
    ids, mask = batch(bpe, pad, left=False)
    folder = save("llama_gqa_tied", model, bpe, run(model, ids, mask))
    write_gguf(model, bpe, folder / "model.gguf")

    # 2. Llama 3.1 RoPE scaling, separate head, one key/value head, left padding.
    # head_dim 16, theta 5e5: wavelengths 6.3, 33, 169, 877, ...; original 256 -> high/low
    # wavelengths 64/256: two frequencies kept, one smoothed, five divided by the factor.
    rope = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
    }
    cfg = LlamaConfig(
        hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=500000.0, rope_parameters=rope,
        rope_scaling=rope, tie_word_embeddings=False,
        **(common | {"max_position_embeddings": 1024}),
    )
    model = build(LlamaForCausalLM, cfg, 2)
    ids, mask = batch(bpe, pad, left=True)
    save("llama3_rope", model, bpe, run(model, ids, mask, position_ids=left_positions(mask)))

    # 3. Qwen2: Q/K/V biases (no O bias), separate head, left padding.
    rope = {"rope_type": "default", "rope_theta": 1000000.0}
    cfg = Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_parameters=rope,
        tie_word_embeddings=False, use_sliding_window=False, **common,
    )
    model = build(Qwen2ForCausalLM, cfg, 3)
    ids, mask = batch(bpe, pad, left=True)
    save("qwen2", model, bpe, run(model, ids, mask, position_ids=left_positions(mask)))

    # 4. Qwen3: q/k RMSNorm, head_dim 16 != 32 / 4, tied, right padding.
    cfg = Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_parameters=rope, tie_word_embeddings=True, use_sliding_window=False, **common,
    )
    model = build(Qwen3ForCausalLM, cfg, 4)
    ids, mask = batch(bpe, pad, left=False)
    save("qwen3", model, bpe, run(model, ids, mask))


def make_new_families(bpe: Tokenizer) -> Iterator[tuple[str, Any, dict[str, np.ndarray]]]:
    """GPT-2, Phi-3, Gemma (1) and GPT-NeoX."""
    from transformers import (
        GemmaConfig,
        GemmaForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        Phi3Config,
        Phi3ForCausalLM,
    )

    pad, eos = bpe.token_to_id("<|pad|>"), bpe.token_to_id("<|endoftext|>")
    common = dict(vocab_size=320, pad_token_id=pad, bos_token_id=eos, eos_token_id=eos,
                  attn_implementation="eager")


    # GPT-2: pre-LayerNorm (biases), learned positions, fused c_attn (Conv1D, (in, out)),
    # tanh GELU, tied head; left padding with explicit position_ids.
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, n_inner=None,
                     activation_function="gelu_new", layer_norm_epsilon=1e-5,
                     tie_word_embeddings=True, **common)
    model = build(GPT2LMHeadModel, cfg, 6)
    ids, mask = batch(bpe, pad, left=True)
    yield "gpt2", model, run(model, ids, mask, position_ids=left_positions(mask))

    # Phi-3: fused qkv_proj and gate_up_proj, RMSNorm, RoPE, GQA, separate head.
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    cfg = Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                     max_position_embeddings=128, original_max_position_embeddings=128,
                     rope_parameters=rope, tie_word_embeddings=False, **common)
    model = build(Phi3ForCausalLM, cfg, 7)
    ids, mask = batch(bpe, pad, left=False)
    yield "phi3", model, run(model, ids, mask)

    # Gemma (1): RMSNorm gains stored as w with (1 + w) applied, embeddings times sqrt(d),
    # GeGLU (tanh GELU), head_dim 16 != 32 / 4, MQA, tied head; right padding.
    cfg = GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                      rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                      max_position_embeddings=128, rope_parameters=rope,
                      tie_word_embeddings=True, **common)
    model = build(GemmaForCausalLM, cfg, 8)
    with torch.no_grad():  # Gemma applies 1 + w: store w so that the gains are 1 + 0.1 N(0,1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.sub_(1.0)
    ids, mask = batch(bpe, pad, left=False)
    yield "gemma", model, run(model, ids, mask)

    # GPT-NeoX (Pythia): parallel attention and MLP with a LayerNorm each, partial rotary
    # embeddings (half of each head), fused per-head query_key_value, exact GELU, separate
    # head; left padding with explicit position_ids.
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    cfg = GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, hidden_act="gelu", rotary_pct=0.5,
                        rope_parameters=rope, max_position_embeddings=128,
                        layer_norm_eps=1e-5, use_parallel_residual=True,
                        tie_word_embeddings=False, **common)
    model = build(GPTNeoXForCausalLM, cfg, 9)
    ids, mask = batch(bpe, pad, left=True)
    yield "gpt_neox", model, run(model, ids, mask, position_ids=left_positions(mask))


def make_bert(wp: Tokenizer) -> None:
    from transformers import BertConfig, BertModel

    pad, cls_id, sep = (wp.token_to_id(t) for t in ("[PAD]", "[CLS]", "[SEP]"))
    cfg = BertConfig(
        vocab_size=wp.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
        type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu", pad_token_id=pad,
        attn_implementation="eager",
    )
    torch.manual_seed(5)
    model = BertModel(cfg)
    redraw(model, 5)
    ids, mask = batch(wp, pad, left=False, cls_sep=(cls_id, sep))
    types = np.zeros_like(ids)
    types[:, 4:] = 1  # a second "segment" from position 4 on
    types *= mask
    save("bert", model, wp, run(model, ids, mask, token_type_ids=types))


# ------------------------------------------------------------------------------------------
# GGUF, as llama.cpp's convert_hf_to_gguf.py writes a llama model
# ------------------------------------------------------------------------------------------


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """``LlamaModel.permute`` of llama.cpp's convert_hf_to_gguf.py, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(model, tok: Tokenizer, path: Path) -> None:
    import gguf

    cfg = model.config
    H, G = cfg.num_attention_heads, cfg.num_key_value_heads
    sd = {k: v.numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("svflow golden llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(G)
    w.add_rope_dimension_count(cfg.hidden_size // H)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    # Tokenizer section: byte-level BPE ("gpt2"), SmolLM2's pre-tokenizer ("smollm"), padded
    # with unused tokens up to the model's vocab_size as the converter does.
    vocab = tok.get_vocab()
    id_to_token = {i: t for t, i in vocab.items()}
    special = {tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|pad|>")}
    tokens, types = [], []
    for i in range(cfg.vocab_size):
        if i in id_to_token:
            tokens.append(id_to_token[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(cfg.pad_token_id)
    w.add_add_bos_token(False)

    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q = llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], H, H)
        k = llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], H, G)
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", q)
        w.add_tensor(f"blk.{i}.attn_k.weight", k)
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"gguf: {path} ({path.stat().st_size} bytes)")


def main(argv: list[str] | None = None) -> None:
    """All golden files, or with names (``gpt2 phi3 gemma``) only those of the later families
    (so that adding a family leaves the others' files byte for byte as they are)."""
    import argparse

    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="*",
                        help="write only these families (gpt2, phi3, gemma, gpt_neox)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    np.random.seed(0)
    torch.set_default_dtype(torch.float32)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    ROOT.mkdir(parents=True, exist_ok=True)
    if args.only:
        bpe = bpe_tokenizer()
        for name, model, outputs in make_new_families(bpe):
            if name in args.only:
                save(name, model, bpe, outputs)
    else:
        make_decoders(bpe_tokenizer())
        make_bert(wordpiece_tokenizer())
        bpe = bpe_tokenizer()
        for name, model, outputs in make_new_families(bpe):
            save(name, model, bpe, outputs)
    total = sum(p.stat().st_size for p in ROOT.rglob("*") if p.is_file())
    print(f"total size of {ROOT}: {total} bytes")


if __name__ == "__main__":
    main()
