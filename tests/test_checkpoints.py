"""Tests of ``svflow_jax.checkpoints``: real checkpoint formats against Hugging Face outputs.

The golden files of ``tests/golden/`` were written by ``experiments/make_golden.py`` with
Hugging Face transformers (eager attention, float32): tiny random Llama (GQA, tied; and
llama3 RoPE scaling, separate head), Qwen2, Qwen3 and BERT models, a GGUF copy of the first,
and every hidden state and the logits on a padded batch of two sequences of unequal lengths.

Tolerance: 1e-5 in max absolute difference, on the valid (non-padded) positions, for every
hidden state and the logits (the values are of order 1-10; both sides compute in float32, so
~1e-6 is float32 rounding in a different summation order; a modelling difference such as a
wrong RoPE pairing, a missing bias or gain, or a wrong mask shows up at O(0.1-1)).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import struct
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from models_for_tests import GOLDEN_FAMILIES
from safetensors.numpy import load_file, save_file

from svflow_jax.checkpoints import (
    CheckpointError,
    config_from_hf,
    llama_cpp_unpermute,
    load,
    load_gguf,
    load_hf,
)
from svflow_jax.checkpoints.gguf_file import read_gguf
from svflow_jax.transformer import embedding_params, layer_params, outer_norm_params

GOLDEN = Path(__file__).parent / "golden"
TOL = 1e-5
GGUF_PATH = GOLDEN / "llama_gqa_tied" / "model.gguf"
# The same model converted by llama.cpp's own convert_hf_to_gguf.py (experiments/
# make_llamacpp_gguf.py): the Q/K permutation is llama.cpp's, not our transcription of it.
LLAMACPP_GGUF_PATH = GOLDEN / "llama_gqa_tied" / "model.llamacpp.gguf"
GGUFS = {"gguf": GGUF_PATH, "gguf-llamacpp": LLAMACPP_GGUF_PATH}

_CACHE: dict[str, object] = {}


def loaded(name: str):
    """Each golden model is loaded once per test session."""
    if name not in _CACHE:
        _CACHE[name] = load_gguf(GGUFS[name]) if name in GGUFS else load_hf(GOLDEN / name)
    return _CACHE[name]


def golden(name: str) -> dict[str, np.ndarray]:
    folder = "llama_gqa_tied" if name in GGUFS else name
    with np.load(GOLDEN / folder / "golden.npz") as data:
        return dict(data)


def inputs(g: dict[str, np.ndarray]) -> dict:
    kw = {"mask": jnp.asarray(g["attention_mask"].astype(bool))}
    if "position_ids" in g:
        kw["positions"] = jnp.asarray(g["position_ids"])
    if "token_type_ids" in g:
        kw["token_types"] = jnp.asarray(g["token_type_ids"])
    return kw


def our_outputs(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Hidden states in transformers' convention (a decoder's last one after the final Norm)
    and the model's output (logits, or BERT's last hidden state)."""
    model, config, _ = loaded(name)
    g = golden(name)
    ids, kw = jnp.asarray(g["input_ids"]), inputs(g)
    states = np.array(model.hidden_states(ids, **kw))
    if config.lm_head:
        states[-1] = np.asarray(model.transformer.final_norm(jnp.asarray(states[-1])))
    return states, np.asarray(model(ids, **kw))


# ============================================================================================
# Agreement with transformers
# ============================================================================================


@pytest.mark.parametrize("name", [*GOLDEN_FAMILIES, *GGUFS])
def test_matches_transformers(name):
    g = golden(name)
    valid = g["attention_mask"].astype(bool)
    assert not valid.all() and valid.any(axis=1).all()  # really a padded batch
    states, out = our_outputs(name)
    ref = g["hidden_states"]
    assert states.shape == ref.shape
    assert out.dtype == np.float32
    errors = [float(np.max(np.abs(states[i][valid] - ref[i][valid]))) for i in range(len(ref))]
    assert max(errors) < TOL, errors
    if "logits" in g:
        err = float(np.max(np.abs(out[valid] - g["logits"][valid])))
        assert err < TOL, err
    else:  # BERT: the model's output is the last hidden state
        np.testing.assert_array_equal(out[valid], states[-1][valid])
    # The layers do act (agreement of near-identity layers would prove little).
    assert np.max(np.abs(ref[-1][valid] - ref[0][valid])) > 0.5


@pytest.mark.parametrize("name", ["llama3_rope", "bert"])
def test_padding_does_not_leak(name):
    """The shorter sequence alone, unpadded, gives its batched valid outputs (left padding with
    positions for llama3_rope, right padding and bidirectional attention for BERT)."""
    model, _, _ = loaded(name)
    g = golden(name)
    valid = g["attention_mask"].astype(bool)
    b = int(np.argmin(valid.sum(1)))
    kw = inputs(g)
    batched = np.asarray(model(jnp.asarray(g["input_ids"]), **kw))[b][valid[b]]
    alone_kw = {k: v[b][valid[b]] for k, v in kw.items() if k != "mask"}
    if "positions" in alone_kw:
        alone_kw["positions"] = alone_kw["positions"] - alone_kw["positions"][0]
    alone = np.asarray(model(jnp.asarray(g["input_ids"][b][valid[b]]), **alone_kw))
    np.testing.assert_allclose(batched, alone, rtol=0, atol=TOL)


def test_configs():
    llama, llama3, qwen2, qwen3, bert = (
        loaded(n).config for n in ("llama_gqa_tied", "llama3_rope", "qwen2", "qwen3", "bert"))
    assert (llama.n_heads, llama.kv_heads, llama.tie_embeddings) == (4, 2, True)
    assert llama3.rope.rope_type == "llama3" and llama3.rope.factor == 8.0
    assert not llama3.tie_embeddings and llama3.kv_heads == 1
    assert (qwen2.has_qkv_bias, qwen2.has_out_bias, qwen2.has_ffn_bias) == (True, False, False)
    assert qwen3.qk_norm and qwen3.d_head == 16 and qwen3.d_model == 32
    assert (bert.norm, bert.norm_position, bert.ffn) == ("layer", "post", "gelu")
    assert not bert.causal
    assert bert.n_positions == 64 and bert.type_vocab_size == 2 and not bert.lm_head
    # A tied head has no separate matrix.
    assert "unembed" not in embedding_params(loaded("llama_gqa_tied").model)
    assert "unembed" in embedding_params(loaded("llama3_rope").model)


# ============================================================================================
# Tokenizers
# ============================================================================================


@pytest.mark.parametrize("name", GOLDEN_FAMILIES)
def test_tokenizer_json_reproduces_golden_ids(name):
    _, _, tok = loaded(name)
    g = golden(name)
    texts = ["The softmax is a kernel on the sphere.", "A tiny step."]
    for b, text in enumerate(texts):
        ids = tok.encode(text).ids
        if name == "bert":  # [CLS] ... [SEP] were added by the golden script
            ids = [tok.token_to_id("[CLS]"), *ids, tok.token_to_id("[SEP]")]
        np.testing.assert_array_equal(g["input_ids"][b][g["attention_mask"][b].astype(bool)], ids)


def test_gguf_tokenizer_matches_tokenizer_json():
    """The BPE rebuilt from the GGUF metadata (vocabulary, merges, special tokens, SmolLM2's
    digit-splitting byte-level pre-tokenizer) tokenizes like the original tokenizer.json."""
    _, _, from_gguf = loaded("gguf")
    _, _, original = loaded("llama_gqa_tied")
    texts = [
        "The softmax is a kernel on the sphere.",
        "Padding 2024 tokens, 3.14 and  double  spaces\nnew line!",
        "<|endoftext|>A rotary step<|pad|>",
        "unseen wörds: ünïcödé, émojis 🙂",
    ]
    for text in texts:
        assert from_gguf.encode(text).ids == original.encode(text).ids, text
        ids = from_gguf.encode(text).ids
        assert from_gguf.decode(ids, skip_special_tokens=False) == text
    assert from_gguf.token_to_id("<|endoftext|>") == original.token_to_id("<|endoftext|>")


# ============================================================================================
# GGUF: Q/K un-permutation, identical weights, quantised tensors
# ============================================================================================


def llama_cpp_permute(weights, n_head, n_head_kv):
    """Independent transcription of llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute``."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize(("n_head", "n_head_kv", "dk", "rest"), [
    (4, 4, 8, (32,)), (4, 2, 8, (32,)), (6, 1, 4, (5,)), (3, 3, 16, ()),
])
def test_unpermute_inverts_llama_cpp_permute(n_head, n_head_kv, dk, rest):
    rng = np.random.default_rng(0)
    heads = n_head_kv  # K's rows: one block per key/value head (Q: n_head_kv == n_head)
    w = rng.standard_normal((heads * dk, *rest))
    permuted = llama_cpp_permute(w, n_head, n_head_kv)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(llama_cpp_unpermute(permuted, heads), w)
    # Explicitly: llama.cpp's row 2i (2i+1) of a head is our row i (i + dk/2), the
    # rotate-half pairs becoming interleaved pairs.
    for h in range(heads):
        for i in range(dk // 2):
            np.testing.assert_array_equal(permuted[h * dk + 2 * i], w[h * dk + i])
            np.testing.assert_array_equal(permuted[h * dk + 2 * i + 1], w[h * dk + i + dk // 2])


@pytest.mark.parametrize("name", GGUFS)
def test_gguf_weights_equal_safetensors_weights(name):
    a, b = loaded(name).model, loaded("llama_gqa_tied").model
    for get in (layer_params, outer_norm_params):
        pa, pb = get(a.transformer), get(b.transformer)
        assert set(pa) == set(pb)
        for k in pa:
            np.testing.assert_array_equal(np.asarray(pa[k]), np.asarray(pb[k]), err_msg=k)
    np.testing.assert_array_equal(embedding_params(a)["embed"], embedding_params(b)["embed"])
    # Same config, but for the epsilon, which GGUF stores in float32.
    from_gguf, from_hf = loaded(name).config, loaded("llama_gqa_tied").config
    assert from_gguf.norm_eps == float(np.float32(from_hf.norm_eps))
    assert from_gguf == dataclasses.replace(from_hf, norm_eps=from_gguf.norm_eps)


def test_our_gguf_tensors_are_llama_cpps():
    """The golden GGUF's tensors (our transcription of llama.cpp's converter, Q/K permuted)
    are byte for byte those llama.cpp's own converter wrote for the same model."""
    ours, theirs = (gguf.GGUFReader(str(p)) for p in (GGUF_PATH, LLAMACPP_GGUF_PATH))
    a = {t.name: (t.tensor_type, np.asarray(t.data)) for t in ours.tensors}
    b = {t.name: (t.tensor_type, np.asarray(t.data)) for t in theirs.tensors}
    assert sorted(a) == sorted(b) and any(".attn_q." in k for k in a)
    for k in a:
        assert a[k][0] == b[k][0], k
        np.testing.assert_array_equal(a[k][1], b[k][1], err_msg=k)


def _copy_gguf(path: Path, tensor_types: dict | None = None, drop: tuple = ()) -> None:
    """Rewrites the golden GGUF, optionally with some tensors quantised (``{name: qtype}``) or
    stored as raw bytes of an arbitrary type (``{name: (qtype, nbytes_per_row)}``)."""
    reader = gguf.GGUFReader(str(GGUF_PATH))
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, vtype)
    for t in reader.tensors:
        if t.name in drop:
            continue
        data = np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist())))
        qtype = (tensor_types or {}).get(t.name)
        if qtype is None:
            writer.add_tensor(t.name, data)
        elif isinstance(qtype, tuple):
            qtype, nbytes = qtype
            raw = np.zeros((data.shape[0], nbytes), np.uint8)
            writer.add_tensor(t.name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_quantised_tensors_are_dequantised(tmp_path):
    """Q8_0 weights load as gguf's dequantisation of them (un-permuted for Q and K)."""
    path = tmp_path / "q8.gguf"
    q8 = gguf.GGMLQuantizationType.Q8_0
    _copy_gguf(path, {"blk.0.attn_q.weight": q8, "blk.1.ffn_down.weight": q8})
    model, config, _ = load_gguf(path)
    reader = gguf.GGUFReader(str(GGUF_PATH))
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    expect_q = gguf.quants.dequantize(gguf.quants.quantize(tensors["blk.0.attn_q.weight"], q8), q8)
    expect_q = llama_cpp_unpermute(expect_q, config.n_heads).T.reshape(32, 4, 8)
    expect_down = gguf.quants.dequantize(
        gguf.quants.quantize(tensors["blk.1.ffn_down.weight"], q8), q8
    ).T
    p = layer_params(model.transformer)
    np.testing.assert_array_equal(np.asarray(p["wq"][0]), expect_q)
    np.testing.assert_array_equal(np.asarray(p["w_down"][1]), expect_down)
    assert 0 < np.max(np.abs(np.asarray(p["wq"][0]) - np.asarray(
        layer_params(loaded("gguf").model.transformer)["wq"][0]))) < 0.05  # really quantised


def test_gguf_unsupported_quantisation_type(tmp_path):
    path = tmp_path / "q8_1.gguf"
    q8_1 = gguf.GGMLQuantizationType.Q8_1
    _copy_gguf(path, {"blk.0.attn_v.weight": (q8_1, 40)})  # one 32-wide Q8_1 block per row
    with pytest.raises(CheckpointError, match=r"unsupported GGUF quantisation type.*"
                       r"blk\.0\.attn_v\.weight: Q8_1"):
        load_gguf(path)


def test_gguf_missing_tensor(tmp_path):
    path = tmp_path / "missing.gguf"
    _copy_gguf(path, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensors \['blk\.1\.ffn_up\.weight'\]"):
        load(path)


def _every_value_type_gguf(path: Path, alignment: int | None) -> None:
    """A GGUF written by ``gguf.GGUFWriter``: a key of every value type, arrays of strings,
    ints, floats and bools, non-ASCII strings, F32, F16, BF16 and Q8_0 tensors."""
    V, Q = gguf.GGUFValueType, gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    scalars = {
        V.UINT8: 255, V.INT8: -128, V.UINT16: 65535, V.INT16: -32768, V.UINT32: 2**32 - 1,
        V.INT32: -(2**31), V.FLOAT32: 0.1, V.BOOL: True, V.STRING: "é ✓ 日本語 \U0001f600",
        V.UINT64: 2**64 - 1, V.INT64: -(2**63), V.FLOAT64: 0.1,
    }
    for vtype, value in scalars.items():
        writer.add_key_value(f"test.{vtype.name.lower()}", value, vtype)
    arrays = {
        V.STRING: ["a", "", "Ġthe", "é ✓"], V.INT32: [1, -2, 3], V.UINT8: [0, 255],
        V.UINT64: [0, 2**64 - 1], V.FLOAT32: [0.1, -2.5, 1e30], V.FLOAT64: [0.1, -1e300],
        V.BOOL: [True, False, True],
    }
    for sub, value in arrays.items():
        writer.add_key_value(f"test.array.{sub.name.lower()}", value, V.ARRAY, sub_type=sub)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((2, 3)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 5)).astype(np.float16))
    for qtype in (Q.BF16, Q.Q8_0):
        data = gguf.quants.quantize(rng.standard_normal((3, 64)).astype(np.float32), qtype)
        writer.add_tensor(qtype.name.lower(), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _one_key_gguf(value: bytes) -> bytes:
    """A GGUF v3 file with no tensors and one key, ``test.value``, of the (type, value) bytes
    given; for what ``GGUFWriter`` refuses to write (an empty array)."""
    key = b"test.value"
    return struct.pack("<4sIQQQ", b"GGUF", 3, 0, 1, len(key)) + key + value


@pytest.fixture(params=["golden", "golden-llamacpp", "every-value-type",
                        "every-value-type-aligned-4096", "empty-array"])
def gguf_file(request, tmp_path) -> Path:
    if request.param.startswith("golden"):
        return GGUFS[request.param.replace("golden", "gguf")]
    path = tmp_path / f"{request.param}.gguf"
    if request.param == "every-value-type":
        _every_value_type_gguf(path, None)
        # The default alignment shows: the data starts at a multiple of 32, not of 64.
        assert gguf.GGUFReader(str(path)).data_offset % 64 == 32
    elif request.param.endswith("4096"):
        _every_value_type_gguf(path, 4096)
    else:
        path.write_bytes(_one_key_gguf(struct.pack("<IIQ", 9, 4, 0)))  # ARRAY of 0 UINT32
    return path


def test_gguf_header_reads_like_gguf_reader(gguf_file):
    """Our header reader against the gguf package's ``GGUFReader``: the same metadata (keys in
    order, values and their Python types) and the same tensors (name, shape, type, offset,
    the memory-mapped data's dtype, shape and bytes)."""
    meta, tensors = read_gguf(gguf_file)
    reader = gguf.GGUFReader(str(gguf_file))
    expect = {name: field.contents() for name, field in reader.fields.items()}

    def typed(value):
        return [typed(v) for v in value] if isinstance(value, list) else (type(value), value)

    assert list(meta) == list(expect)
    for key, value in expect.items():
        assert typed(meta[key]) == typed(value), key
    assert list(tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        ours = tensors[t.name]
        assert (ours.shape, ours.qtype, ours.data_offset, ours.n_bytes) == (
            tuple(reversed(t.shape.tolist())), t.tensor_type, t.data_offset, t.n_bytes
        ), t.name
        assert isinstance(ours.data, np.memmap) and not ours.data.flags.writeable
        assert (ours.data.dtype, ours.data.shape) == (t.data.dtype, t.data.shape), t.name
        assert ours.data.tobytes() == t.data.tobytes(), t.name


def _field_part(reader, name: str, part: int) -> int:
    """Where part ``part`` of a GGUFReader field starts in the file: for a metadata key 0 the
    key's length, 1 the key, 2 the value type, then the value's parts (an array: 3 the element
    type, 4 the count, 5 the first string's length, ...); for a tensor 4 its type, 5 its
    offset."""
    fields = {**reader.fields, **{t.name: t.field for t in reader.tensors}}
    return fields[name].offset + sum(int(p.nbytes) for p in fields[name].parts[:part])


@pytest.mark.parametrize(
    ("name", "part", "new", "match"),
    [
        ("general.name", 0, struct.pack("<Q", 2**60), r"needs 1152921504606846976 bytes"),
        ("general.name", 1, b"\xff", r"a string is not UTF-8"),
        ("tokenizer.ggml.tokens", 4, struct.pack("<Q", 2**54), r"18014398509481984 items"),
        ("tokenizer.ggml.tokens", 5, struct.pack("<Q", 2**40), r"1099511627776 bytes passes"),
        ("tokenizer.ggml.token_type", 4, struct.pack("<Q", 2**32), r"4294967296 items"),
        ("tokenizer.ggml.token_type", 3, struct.pack("<I", 9), r"arrays of arrays"),
        ("llama.block_count", 2, struct.pack("<I", 13), r"unknown value type 13"),
        ("blk.1.ffn_down.weight", 4, struct.pack("<I", 99), r"99 is not a valid GGMLQuant"),
        ("blk.1.ffn_down.weight", 5, struct.pack("<Q", 2**40), r"passes the end of the file"),
        ("GGUF.version", 0, struct.pack(">I", 3), r"big-endian"),
    ],
)
def test_gguf_damaged_header_is_refused(tmp_path, name, part, new, match):
    """One field of the golden GGUF overwritten (a length, a count, a type, a key's byte, a
    tensor's offset, the version in the other byte order) is a CheckpointError naming the
    file and what is wrong."""
    at = _field_part(gguf.GGUFReader(str(GGUF_PATH)), name, part)
    data = bytearray(GGUF_PATH.read_bytes())
    data[at: at + len(new)] = new
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: unreadable GGUF header") +
                       ".*" + match):
        load(path)


# ============================================================================================
# Hugging Face folders: sharded, bfloat16, bad input
# ============================================================================================


def _copy_folder(tmp_path: Path, name: str) -> tuple[Path, dict[str, np.ndarray], dict]:
    folder = tmp_path / name
    shutil.copytree(GOLDEN / name, folder)
    return folder, load_file(folder / "model.safetensors"), json.loads(
        (folder / "config.json").read_text()
    )


def test_sharded_folder(tmp_path):
    folder, tensors, _ = _copy_folder(tmp_path, "qwen2")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({k: tensors[k] for k in part}, folder / file)
    index = {"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_hf(folder).model
    a, b = layer_params(model.transformer), layer_params(loaded("qwen2").model.transformer)
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def test_bfloat16_checkpoint(tmp_path):
    import ml_dtypes

    folder, tensors, _ = _copy_folder(tmp_path, "qwen3")
    # safetensors' NumPy API cannot write bfloat16: write the file by hand (same format).
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        raw = tensors[name].astype(ml_dtypes.bfloat16).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    (folder / "model.safetensors").write_bytes(
        len(head).to_bytes(8, "little") + head + b"".join(blobs)
    )
    model = load_hf(folder).model
    wq = np.asarray(layer_params(model.transformer)["wq"][1])
    expect = tensors["model.layers.1.self_attn.q_proj.weight"].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(wq, expect.astype(np.float32).T.reshape(32, 4, 16))


def test_missing_tensor(tmp_path):
    folder, tensors, _ = _copy_folder(tmp_path, "llama3_rope")
    del tensors["model.layers.2.mlp.up_proj.weight"], tensors["lm_head.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"missing tensors \['lm_head\.weight', 'model\.layers\.2\.mlp\.up_proj\.weight'\]",
    ):
        load_hf(folder)


def test_extra_tensor(tmp_path):
    folder, tensors, _ = _copy_folder(tmp_path, "llama_gqa_tied")
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(32, np.float32)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"unexpected \(extra\) tensors \['model\.layers\.0\.self_attn\.o_proj\.bias'\]",
    ):
        load_hf(folder)


def test_tied_head_present_but_different(tmp_path):
    folder, tensors, _ = _copy_folder(tmp_path, "llama_gqa_tied")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, folder / "model.safetensors")
    load_hf(folder)  # a saved copy of the tied head is accepted...
    tensors["lm_head.weight"][0, 0] += 1.0
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_hf(folder)  # ...a different one is not


def test_shape_mismatch(tmp_path):
    folder, tensors, _ = _copy_folder(tmp_path, "qwen3")
    tensors["model.layers.1.self_attn.k_norm.weight"] = np.ones(8, np.float32)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"shape mismatch: model\.layers\.1\.self_attn\.k_norm\.weight: expected shape "
        r"\(16,\), got \(8,\)",
    ):
        load_hf(folder)


@pytest.mark.parametrize(
    ("name", "edit", "match"),
    [
        ("llama_gqa_tied", {"model_type": "mistral"}, "unknown model_type 'mistral'"),
        (
            "llama3_rope",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            "unsupported rope_type 'yarn'",
        ),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8}, "sliding-window"),
        ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ("llama_gqa_tied", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("bert", {"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
        ("bert", {"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ("llama_gqa_tied", {"partial_rotary_factor": 0.5}, "partial"),
        ("phi3", {"sliding_window": 2047}, "sliding-window"),
        ("gpt_neox", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
         "unsupported rope_type 'dynamic' for gpt_neox"),
        ("gpt_neox", {"rope_parameters": {"partial_rotary_factor": 0.1}},
         "gives 0 rotary coordinates of 8"),
        ("gemma", {"model_type": "gemma2"}, "model_type 'gemma2' is not supported: Gemma 2 has "
         "logit soft-capping"),
        ("gemma", {"model_type": "gemma3_text"}, "per-head query/key RMSNorm"),
        ("gemma", {"hidden_activation": "relu"}, "hidden_activation='relu'"),
        ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
         "unsupported rope_type 'longrope'"),
    ],
)
def test_unsupported_config(tmp_path, name, edit, match):
    folder, _, config = _copy_folder(tmp_path, name)
    (folder / "config.json").write_text(json.dumps(config | edit))
    with pytest.raises(CheckpointError, match=match):
        load_hf(folder)


def test_rope_settings_in_old_and_new_places():
    """rope_theta may sit at the top level (older transformers) with rope_scaling, or under
    rope_parameters (recent); both read the same."""
    new = json.loads((GOLDEN / "llama3_rope" / "config.json").read_text())
    params = dict(new.pop("rope_parameters"))
    theta = params.pop("rope_theta")
    old = new | {"rope_theta": theta, "rope_scaling": params}
    assert config_from_hf(old) == config_from_hf(new | {"rope_parameters": params | {
        "rope_theta": theta}})
    assert config_from_hf(old).rope.theta == 500000.0


def test_not_a_folder():
    with pytest.raises(CheckpointError, match="no such folder"):
        load_hf(GOLDEN / "does-not-exist")


def test_gguf_llama3_rope_freqs(tmp_path):
    """A Llama 3.1-style GGUF: llama.cpp's converter stores the RoPE scaling as a
    ``rope_freqs.weight`` tensor of per-frequency factors (transcribed below from
    convert_hf_to_gguf.py); written here from the llama3_rope golden model, it must reproduce
    transformers' outputs like the safetensors folder does."""
    import math

    folder = GOLDEN / "llama3_rope"
    hf = json.loads((folder / "config.json").read_text())
    sd = load_file(folder / "model.safetensors")
    rp = hf["rope_parameters"]
    H, G, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["hidden_size"]
    dim = d // H
    freqs = 1.0 / (rp["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old = rp["original_max_position_embeddings"]
    lo, hi, factor = rp["low_freq_factor"], rp["high_freq_factor"], rp["factor"]
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            rope_factors.append(1)
        elif wavelen > old / lo:
            rope_factors.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))

    path = tmp_path / "llama3.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(d)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(G)
    w.add_rope_dimension_count(dim)
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_vocab_size(hf["vocab_size"])
    w.add_tensor("rope_freqs.weight", np.asarray(rope_factors, np.float32))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    names = {"attn_norm": "input_layernorm", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight",
                     llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], H, H))
        w.add_tensor(f"blk.{i}.attn_k.weight",
                     llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], H, G))
        for ours, theirs in names.items():
            w.add_tensor(f"blk.{i}.{ours}.weight", sd[p + theirs + ".weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    model, config, tokenizer = load_gguf(path)
    assert tokenizer is None and config.rope.freq_factors is not None
    np.testing.assert_allclose(
        config.rope.inv_freq(dim), loaded("llama3_rope").config.rope.inv_freq(dim), rtol=1e-6
    )
    g = golden("llama3_rope")
    valid = g["attention_mask"].astype(bool)
    logits = np.asarray(model(jnp.asarray(g["input_ids"]), **inputs(g)))
    assert np.max(np.abs(logits[valid] - g["logits"][valid])) < TOL


# ============================================================================================
# Damaged and hostile files: every failure a CheckpointError naming the file or the field
# ============================================================================================


def _outcome(path: Path) -> str:
    """``"loaded"``, or the CheckpointError's message; any other exception fails the test."""
    try:
        load(path)
    except CheckpointError as err:
        return str(err)
    return "loaded"


@pytest.mark.parametrize("fraction", [0.0, 0.0001, 0.01, 0.1, 0.5, 0.9, 0.9999])
@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_truncated_file(tmp_path, kind, fraction):
    if kind == "gguf":
        path = tmp_path / "cut.gguf"
        data = GGUF_PATH.read_bytes()
        target = path
    else:
        path, _, _ = _copy_folder(tmp_path, "qwen2")
        target = path / "model.safetensors"
        data = target.read_bytes()
    target.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(CheckpointError, match=re.escape(str(target))):
        load(path)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_bit_flipped_header(tmp_path, kind, seed):
    """One flipped bit in the header (where names, shapes, offsets, counts and metadata are):
    either refused with a CheckpointError naming the file (or folder), or, for a flip in a
    value that changes nothing structural, loaded; never another exception."""
    rng = np.random.default_rng(seed)
    if kind == "gguf":
        path = target = tmp_path / "flip.gguf"
        data = bytearray(GGUF_PATH.read_bytes())
        # metadata and tensor table of the golden GGUF: everything before the first tensor
        header_end = min(t.data_offset for t in gguf.GGUFReader(str(GGUF_PATH)).tensors)
    else:
        path, _, _ = _copy_folder(tmp_path, "qwen2")
        target = path / "model.safetensors"
        data = bytearray(target.read_bytes())
        header_end = 8 + int.from_bytes(data[:8], "little")
    at = int(rng.integers(0, header_end))
    data[at] ^= 1 << int(rng.integers(8))
    target.write_bytes(bytes(data))
    result = _outcome(path)
    assert result == "loaded" or str(path) in result, (at, result)


@pytest.mark.parametrize("field", [8, 16])  # GGUF v3: tensor count at byte 8, KV count at 16
def test_gguf_flipped_count(tmp_path, field):
    data = bytearray(GGUF_PATH.read_bytes())
    data[field + 6] ^= 0x40  # a count of ~2^54
    path = tmp_path / "count.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        load(path)


@pytest.mark.parametrize(
    ("file", "content", "match"),
    [
        ("model.safetensors", b"", "model.safetensors: unreadable safetensors header"),
        ("config.json", b"", "config.json: unreadable JSON"),
        ("config.json", b"[1, 2]", "config.json: expected a JSON object"),
        ("tokenizer.json", b"", "tokenizer.json: unreadable tokenizer"),
        ("tokenizer.json", b'{"model": 3}', "tokenizer.json: unreadable tokenizer"),
        ("model.safetensors.index.json", b"{}", "index.json: no 'weight_map'"),
    ],
)
def test_empty_or_garbage_file(tmp_path, file, content, match):
    folder, _, _ = _copy_folder(tmp_path, "llama_gqa_tied")
    (folder / file).write_bytes(content)
    with pytest.raises(CheckpointError, match=match):
        load(folder)


def test_empty_gguf(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: unreadable GGUF")):
        load(path)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"hidden_size": None}, r"config\.json: missing key 'hidden_size'"),
        ({"num_hidden_layers": 1e9}, r"config\.json: num_hidden_layers=1000000000 is outside"),
        ({"vocab_size": 2**40}, r"config\.json: vocab_size=1099511627776 is outside"),
        ({"num_attention_heads": 2.5}, r"num_attention_heads=2\.5 is not a whole number"),
        ({"rms_norm_eps": "small"}, r"rms_norm_eps='small' is not a finite number"),
        ({"num_attention_heads": 5}, r"config\.json: inconsistent configuration"),
        ({"num_hidden_layers": 3}, r"missing tensors \['model\.layers\.2\."),
    ],
)
def test_bad_config_values(tmp_path, edit, match):
    """Missing keys, sizes out of bounds (refused before anything is allocated: the 10^9-layer
    configuration fails in well under a second) and values of the wrong type."""
    import time

    folder, _, config = _copy_folder(tmp_path, "llama_gqa_tied")
    config = {k: v for k, v in (config | edit).items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=match):
        load_hf(folder)
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_embedding_row_is_refused_by_name(tmp_path, value):
    folder, tensors, _ = _copy_folder(tmp_path, "llama_gqa_tied")
    tensors["model.embed_tokens.weight"][7, 3] = value
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'model\.embed_tokens\.weight' has 1 non-finite value\(s\) .* index "
        r"\(7, 3\); pass allow_nonfinite=True",
    ):
        load_hf(folder)
    with pytest.warns(RuntimeWarning, match=r"model\.embed_tokens\.weight.*loaded anyway"):
        model = load_hf(folder, allow_nonfinite=True).model
    embed = np.asarray(embedding_params(model)["embed"])
    assert not np.isfinite(embed[7, 3]) and np.isfinite(np.delete(embed, 7, axis=0)).all()


def test_nonfinite_gguf_tensor_is_refused_by_name(tmp_path):
    path = tmp_path / "nan.gguf"
    reader = gguf.GGUFReader(str(GGUF_PATH))
    offset = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight").data_offset
    data = bytearray(GGUF_PATH.read_bytes())
    data[offset: offset + 4] = np.float32(np.nan).tobytes()  # F32 tensor: its first element
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"nan\.gguf: tensor 'blk\.1\.ffn_down\.weight'"):
        load(path)


def test_cli_inspect_exits_2_on_a_damaged_checkpoint(tmp_path, capsys):
    from svflow_jax.cli import main

    path = tmp_path / "cut.gguf"
    path.write_bytes(GGUF_PATH.read_bytes()[:1000])
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", str(path), "--quick", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert f"{path}: unreadable GGUF header" in capsys.readouterr().err


# ============================================================================================
# Specs: one source to several targets, several sources to one
# ============================================================================================


def test_fused_and_split_specs_load_like_separate_tensors(tmp_path):
    """The llama golden model rewritten with each layer's Q, K, V fused into one tensor
    (GPT-NeoX/Phi-3 style) and each embedding row block split in two files' worth of tensors;
    specs mapping one source to three targets, and two sources to one, give the same
    parameters as the plain folder."""
    from svflow_jax.checkpoints import FAMILIES, Spec
    from svflow_jax.checkpoints.base import convert
    from svflow_jax.checkpoints.hf import SafetensorsFolder
    from svflow_jax.checkpoints.specs import in_heads

    folder, tensors, _ = _copy_folder(tmp_path, "llama_gqa_tied")
    model, cfg, _ = loaded("llama_gqa_tied")
    H, G, dk, d, V = cfg.n_heads, cfg.kv_heads, cfg.d_head, cfg.d_model, cfg.vocab_size
    p = "model.layers.{i}.self_attn."
    for i in range(cfg.n_layers):
        parts = [tensors.pop(p.format(i=i) + f"{x}_proj.weight") for x in "qkv"]
        tensors[p.format(i=i) + "qkv_proj.weight"] = np.concatenate(parts)
    embed = tensors.pop("model.embed_tokens.weight")
    tensors["embed.a"], tensors["embed.b"] = embed[: V // 2], embed[V // 2:]
    save_file(tensors, folder / "model.safetensors")

    def qkv(w):
        q, k, v = np.split(w, [H * dk, (H + G) * dk])
        return in_heads(H, dk)(q), in_heads(G, dk)(k), in_heads(G, dk)(v)

    specs = [
        s for s in FAMILIES["llama"].specs(cfg, "llama")
        if not set(s.targets) & {"wq", "wk", "wv", "embed"}
    ]
    specs += [Spec(p.format(i=i) + "qkv_proj.weight", ((H + 2 * G) * dk, d),
                   ("wq", "wk", "wv"), i, qkv) for i in range(cfg.n_layers)]
    specs.append(Spec(("embed.a", "embed.b"), ((V // 2, d), (V - V // 2, d)), "embed",
                      None, lambda a, b: np.concatenate([a, b])))
    source = SafetensorsFolder(folder)
    layer, outer, emb = convert(specs, source, set(), jnp.float32)
    ref = layer_params(model.transformer)
    for name in ("wq", "wk", "wv", "w_up"):
        np.testing.assert_array_equal(layer[name], np.asarray(ref[name]), err_msg=name)
    np.testing.assert_array_equal(emb["embed"], np.asarray(embedding_params(model)["embed"]))
    np.testing.assert_array_equal(
        outer["final_norm_gain"], np.asarray(outer_norm_params(model.transformer)[
            "final_norm_gain"]))


# ============================================================================================
# Families added through one spec module each
# ============================================================================================


def test_gpt2_config_and_old_style_names(tmp_path):
    """GPT-2: pre-LayerNorm with biases, learned positions, tanh GELU, tied head; a file saved
    from ``GPT2Model`` (no ``transformer.`` prefix, causal-mask buffers) loads the same."""
    model, cfg, _ = loaded("gpt2")
    assert (cfg.norm, cfg.norm_position, cfg.has_norm_bias) == ("layer", "pre", True)
    assert (cfg.n_positions, cfg.ffn_activation, cfg.tie_embeddings) == (64, "gelu_tanh", True)
    folder, tensors, _ = _copy_folder(tmp_path, "gpt2")
    old = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    old["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
    save_file(old, folder / "model.safetensors")
    again = load_hf(folder).model
    for k, v in layer_params(again.transformer).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(
            layer_params(model.transformer)[k]), err_msg=k)


@pytest.mark.parametrize("name", ["phi3"])
def test_to_flow_is_exact_in_float64(name):
    """A pre-RMSNorm family converted by ``to_flow`` reproduces every hidden state of its first
    (unpadded) golden sequence to <= 1e-12 in float64 (states of size O(1-10))."""
    from svflow_jax import inspection

    g = golden(name)
    tokens = g["input_ids"][0][g["attention_mask"][0].astype(bool)]
    result = inspection.exactness(loaded(name), tokens)
    assert result.passed is True
    assert result.figures["max_abs_diff_float64"] <= 1e-12, result.figures
    assert result.figures["relative_float64"] <= 1e-12, result.figures
    assert result.figures["scale"] > 1.0


def test_gemma_gains_embedding_scale_and_geglu():
    """Gemma's stored RMSNorm weights w act as 1 + w, its embeddings are scaled by sqrt(d) and
    its MLP is GeGLU (the flow's score networks take its tanh-GELU gate; exactness in
    ``tests/test_real_flow.py``)."""
    from svflow_jax.bridge.correspondence import to_flow

    model, cfg, _ = loaded("gemma")
    stored = load_file(GOLDEN / "gemma" / "model.safetensors")
    np.testing.assert_array_equal(
        np.asarray(layer_params(model.transformer)["norm_ffn_gain"][1]),
        1 + stored["model.layers.1.post_attention_layernorm.weight"])
    assert cfg.embed_scale == math.sqrt(32) and cfg.ffn_activation == "gelu_tanh"
    assert (cfg.d_head, cfg.kv_heads, cfg.tie_embeddings) == (16, 1, True)
    flow = to_flow(cfg, layer_params(model.transformer))
    assert flow.experts.params.anchors.experts.nonlinearity == "gelu_tanh"
    legacy = json.loads((GOLDEN / "gemma" / "config.json").read_text())
    legacy |= {"hidden_act": "gelu", "hidden_activation": None}  # the released configs' value
    assert config_from_hf(legacy).ffn_activation == "gelu_tanh"


def test_gpt_neox_parallel_block_with_folded_layernorms():
    """Pythia's two LayerNorms per layer: one parameter-free Norm in the parallel block, the
    gains and biases folded into Q/K/V and W_in (checked against the stored tensors in
    float64), RoPE on half of each head."""
    model, cfg, _ = load_hf(GOLDEN / "gpt_neox", dtype=jnp.float64)
    assert (cfg.block, cfg.norm, cfg.rope.rotary_dim, cfg.d_head) == ("parallel", "layer", 4, 8)
    stored = load_file(GOLDEN / "gpt_neox" / "model.safetensors")
    p = "gpt_neox.layers.1."
    params = layer_params(model.transformer)
    np.testing.assert_array_equal(np.asarray(params["norm_gain"]), 1.0)
    np.testing.assert_array_equal(np.asarray(params["norm_bias"]), 0.0)
    w = stored[p + "attention.query_key_value.weight"].astype(np.float64).reshape(4, 3, 8, 32)
    g1 = stored[p + "input_layernorm.weight"].astype(np.float64)
    b1 = stored[p + "input_layernorm.bias"].astype(np.float64)
    k_rows = w[:, 1]  # (H, dk, d): per head, Q then K then V
    np.testing.assert_allclose(np.asarray(params["wk"][1]),
                               (g1[None, None, :] * k_rows).transpose(2, 0, 1), rtol=1e-15)
    bk = stored[p + "attention.query_key_value.bias"].astype(np.float64).reshape(4, 3, 8)[:, 1]
    np.testing.assert_allclose(np.asarray(params["bk"][1]), bk + k_rows @ b1, rtol=1e-12)


def _decoder_without_a_flow():
    """GPT-2's golden model rebuilt with tangent-projected branches behind its pre-LayerNorms:
    a decoder ``to_flow`` refuses (projection is on the sphere of R^d, the LayerNorm reads the
    centred hyperplane), with the golden's weights."""
    from flax import nnx

    from svflow_jax.checkpoints import LoadedModel
    from svflow_jax.transformer import TransformerLM
    from svflow_jax.transformer.params import (
        set_embedding_params,
        set_layer_params,
        set_outer_norm_params,
    )

    model, cfg, tokenizer = loaded("gpt2")
    cfg = dataclasses.replace(cfg, project_branches=True)
    lm = TransformerLM(cfg, rngs=nnx.Rngs(0))
    set_layer_params(lm.transformer, layer_params(model.transformer))
    set_outer_norm_params(lm.transformer, outer_norm_params(model.transformer))
    set_embedding_params(lm, embedding_params(model))
    return LoadedModel(lm, cfg, tokenizer)


def test_refinement_is_skipped_for_a_decoder_to_flow_refuses():
    """svflow inspect on a decoder with no flow reports the refinement as skipped, naming why,
    instead of raising."""
    from svflow_jax import inspection

    g = golden("gpt2")
    result = inspection.refinement(_decoder_without_a_flow(), g["input_ids"][:1, :6])
    assert result.passed is None
    assert "not an SVFlow discretisation" in result.figures["skipped"]
    assert "projected branches" in result.figures["skipped"]


def test_exactness_reports_a_prenorm_decoder_without_a_flow():
    """The exactness measurement of a pre-norm decoder to_flow refuses: undecided, naming why,
    with the token norms' departure from a sphere (a pre-norm state is no Norm's output, so no
    ellipsoid residual)."""
    from svflow_jax import inspection

    g = golden("gpt2")
    result = inspection.exactness(_decoder_without_a_flow(), g["input_ids"][0][:8])
    assert result.passed is None
    assert "not an SVFlow discretisation" in result.figures["not_a_flow"]
    assert result.figures["ellipsoid_residual"] is None
    assert result.figures["sphere_departure"] > 0.01
