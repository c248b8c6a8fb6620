"""Training layer designs: every design learns, a checkpoint resumes exactly, the batch shards
over several devices, a trained Euler design is still the Transformer, the tasks are sound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from svflow_jax.designs import DESIGNS, DesignConfig
from svflow_jax.training import AustenBytes, MultiHopRecall, TrainConfig, train

ROOT = Path(__file__).resolve().parent.parent
TINY = DesignConfig(d_model=16, n_heads=2, d_head=8, d_ff=32, num_steps=2, num_anchors=2,
                    duration=2.0, context=16, remat=False)


def _config(design: str, steps: int = 10, **changes) -> TrainConfig:
    weights = "per_layer" if design == "euler" else "linear"
    settings = dict(batch_size=8, lr=1e-2, warmup=2, eval_every=steps, eval_sequences=8,
                    log_every=1)
    return TrainConfig(model=TINY.replace(design=design, weights=weights), steps=steps,
                       **{**settings, **changes})


@pytest.mark.parametrize("design", list(DESIGNS))
def test_training_reduces_the_loss(design):
    """On byte-level Austen, 10 AdamW steps lower the training loss of every design (mean of
    the last 3 logged losses below the first 3; from ~ln 256 = 5.5 nats at init)."""
    result = train(_config(design, eval_every=0), progress=False)
    losses = np.array([row["loss"] for row in result.history])
    assert len(losses) == 10 and result.final == {}
    assert losses[-3:].mean() < losses[:3].mean() - 0.3, losses


def test_resume_is_exact(tmp_path):
    """Stopped at step 5 and resumed from its orbax checkpoint, a run logs the same losses (bit
    for bit, same device) and ends with the same weights as an uninterrupted run."""
    config = _config("heun", steps=10, checkpoint_every=5)
    whole = train(config, tmp_path / "whole", progress=False)
    train(config, tmp_path / "split", progress=False, stop_after=5)
    resumed = train(config, tmp_path / "split", progress=False)
    assert resumed.resumed_from == 5
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history]
    a, b = nnx.state(whole.model, nnx.Param), nnx.state(resumed.model, nnx.Param)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    lines = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 11))
    assert (tmp_path / "split" / "metrics.csv").read_text().startswith("step,")
    with pytest.raises(ValueError, match="another configuration"):
        train(_config("heun", steps=10, lr=2e-2), tmp_path / "split", progress=False)


def test_trained_euler_design_is_the_transformer():
    """After training, the Euler post-norm design with per-layer weights equals the project's
    TransformerLM holding the same weights (float32: 1e-5 of the logits' scale)."""
    model = train(_config("euler"), progress=False).model
    tokens = AustenBytes(context=16).eval_batches(4, 4)[0][0]
    ours = nnx.jit(lambda m, t: m(t))(model, tokens)
    theirs = nnx.jit(lambda m, t: m(t))(model.to_transformer(), tokens)
    scale = float(np.max(np.abs(theirs)))
    np.testing.assert_allclose(ours, theirs, atol=1e-5 * scale, rtol=0)


SHARDED = textwrap.dedent("""
    import json
    import jax
    from svflow_jax.designs import DesignConfig
    from svflow_jax.training import TrainConfig, train
    model = DesignConfig(d_model=16, n_heads=2, d_head=8, d_ff=32, num_steps=2, num_anchors=2,
                         duration=2.0, context=16)
    config = TrainConfig(model=model, steps=4, batch_size=8, warmup=1, eval_every=0,
                         log_every=1)
    runs = {n: train(config, progress=False, devices=jax.devices()[:n]) for n in (4, 1)}
    print(json.dumps({"devices": len(jax.devices()),
                      "losses": {n: [r["loss"] for r in run.history] for n, run in runs.items()}}))
""")


def test_data_parallel_on_four_host_devices():
    """The same run with its batch sharded over 4 forced CPU host devices (2 sequences each)
    and on 1 device: the loss curves agree to float32 round-off of the reordered reductions
    (1e-5 relative)."""
    # (backend optimisations off: compile time is most of this test; both runs alike)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4 "
               "--xla_backend_optimization_level=0")
    out = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    four, one = result["losses"]["4"], result["losses"]["1"]
    assert len(four) == 4
    np.testing.assert_allclose(four, one, rtol=1e-5)


def test_tasks_are_sound():
    austen = AustenBytes(context=32)
    inputs, targets, weights = austen.batch(seed=3, step=7, batch_size=4)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])  # next-byte targets
    np.testing.assert_array_equal(austen.batch(3, 7, 4)[0], inputs)  # a function of (seed, step)
    assert not np.array_equal(austen.batch(3, 8, 4)[0], inputs)
    assert weights.sum() == 4 * 32
    train_text, valid_text = austen.text("train").tobytes(), austen.text("valid").tobytes()
    assert train_text.startswith(b"PRIDE AND PREJUDICE") and valid_text.startswith(b"Persuasion")
    recall = MultiHopRecall(symbols=8, hops=2, queries=4)
    x, y, w = recall.batch(0, 0, 16)
    assert x.shape == (16, 21) and (x[:, 16] == 8).all()
    for b in range(16):  # an independent reading of the problem: follow the pairs twice
        pairs = dict(zip(x[b, 0:16:2], x[b, 1:16:2], strict=True))
        for i in range(17, 21):
            assert y[b, i] == pairs[pairs[x[b, i]]]
    assert w.sum() == 16 * 4 and w[:, 17:].all()
    with pytest.raises(ValueError, match="unknown task"):
        TrainConfig(task="wiki")
    with pytest.raises(ValueError, match="divisible"):
        train(TrainConfig(model=TINY, batch_size=3, steps=1), progress=False,
              devices=[jax.devices()[0]] * 2)


def test_svflow_train_cli(tmp_path, capsys):
    """``svflow train``: bad options exit with code 2 before anything compiles; a tiny run
    writes its files and resumes (nothing left to do) when run again."""
    from svflow_jax.cli import main

    for bad in (["--steps", "0"], ["--design", "nope"], ["--weights", "cubic"],
                ["--design", "geodesic-euler", "--norm", "pre"], ["--config", "missing.json"]):
        with pytest.raises(SystemExit) as err:
            main(["train", *bad])
        assert err.value.code == 2, bad
    assert main(["train", "--list-designs"]) == 0
    assert "crouch-grossman3" in capsys.readouterr().out
    argv = ["train", "--design", "lie-trotter", "--num-steps", "2", "--anchors", "2",
            "--duration", "2", "--d-model", "16", "--heads", "2", "--d-head", "8", "--d-ff",
            "32", "--context", "16", "--steps", "3", "--batch-size", "4", "--eval-every", "0",
            "--out", str(tmp_path / "run"), "--no-progress"]
    assert main(argv) == 0
    final = json.loads((tmp_path / "run" / "final.json").read_text())
    assert final["design"] == "lie-trotter" and final["resumed_from"] is None
    assert final["environment"]["cpu_count"] == os.cpu_count()
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["num_steps"] == 2 and saved["steps"] == 3
    assert main(argv) == 0  # resumes from the step-3 checkpoint: nothing left to train
    assert json.loads((tmp_path / "run" / "final.json").read_text())["resumed_from"] == 3
