"""Training layer designs: every design learns, a checkpoint resumes exactly, the batch shards
over several devices, a trained Euler design is still the Transformer, the tasks are sound."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from svflow_jax.claims.measure import exactness_tolerance
from svflow_jax.designs import DesignConfig, SolverLM
from svflow_jax.solvers.catalogue import CATALOGUE as DESIGNS
from svflow_jax.training import AustenBytes, MultiHopRecall, TrainConfig, get_task, train
from svflow_jax.training.compare import throughput
from svflow_jax.training.loop import AdamW, train_step

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


@pytest.mark.parametrize(("lr", "warmup", "steps", "fraction"), [
    (2e-3, 50, 1800, 0.1), (1e-2, 2, 10, 0.0), (3e-3, 1, 4, 1.0), (0.0, 5, 20, 0.1),
    (1e-3, 0, 7, 0.3), (4e-3, 9, 3, 0.1)])  # last: schedule shorter than the warm-up
def test_schedule_is_optaxs_warmup_cosine_decay(lr, warmup, steps, fraction):
    """AdamW.schedule, jitted with its numbers as arguments, is optax's
    warmup_cosine_decay_schedule (built from Python numbers, evaluated in float64) at every
    step and past the end: to float64 round-off for float64 steps, to float32 round-off for the
    int32 step counts of the optimiser's state (a few ulps of lr, which bounds both)."""
    reference = optax.warmup_cosine_decay_schedule(
        0.0, lr, warmup, max(steps, warmup + 1), lr * fraction)
    schedule = jax.jit(lambda tx, c: tx.schedule(c))
    tx = AdamW(lr, warmup, steps, fraction)
    counts = np.arange(steps + 5)
    expected = reference(jnp.asarray(counts, jnp.float64))
    ours64 = schedule(tx, jnp.asarray(counts, jnp.float64))
    ours32 = schedule(tx, jnp.asarray(counts, jnp.int32))
    assert ours64.dtype == jnp.float64 and ours32.dtype == jnp.float32
    np.testing.assert_allclose(ours64, expected, rtol=0, atol=4 * np.finfo(np.float64).eps * lr)
    np.testing.assert_allclose(ours32, expected, rtol=0, atol=4 * np.finfo(np.float32).eps * lr)


def test_adamw_update_equals_optaxs_with_the_numbers_traced():
    """Four updates of float32 weights by AdamW (clipping, weight decay, schedule) with its
    numbers as traced arguments equal optax's chain built from Python numbers, bit for bit (as
    measured on the CPU)."""
    tx = AdamW(3e-3, 2, 6, 0.1, weight_decay=0.05, clip=0.5)
    reference = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 3e-3, 2, 6, 3e-4), weight_decay=0.05))
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)}
    update = jax.jit(lambda tx, g, s, p: tx.transformation().update(g, s, p))
    state, ref_state, ref_params = tx.transformation().init(params), reference.init(params), params
    for _ in range(4):
        grads = {"w": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)}
        u, state = update(tx, grads, state, params)
        r, ref_state = reference.update(grads, ref_state, ref_params)
        params, ref_params = optax.apply_updates(params, u), optax.apply_updates(ref_params, r)
        assert params["w"].dtype == jnp.float32
    np.testing.assert_array_equal(params["w"], ref_params["w"])


def test_runs_with_other_rates_and_schedules_share_one_compiled_step():
    """A learning-rate sweep compiles the training step once: another rate, warm-up, length,
    weight decay, clipping norm or final fraction reuses the program, and so does the
    throughput measurement of the same model."""
    config = _config("euler", steps=2, eval_every=0)
    train(config, progress=False)
    programs = train_step._cache_size()
    for change in (dict(lr=3e-3), dict(warmup=1, steps=3), dict(weight_decay=0.1),
                   dict(clip=0.3), dict(final_lr_fraction=0.5)):
        train(dataclasses.replace(config, **change), progress=False)
    assert train_step._cache_size() == programs
    # and the throughput measurement times that very program
    throughput({"m": SolverLM(config.model, rngs=nnx.Rngs(1))}, config.batch_size,
               TINY.context, 1)
    assert train_step._cache_size() == programs


def test_fit_takes_any_optax_optimiser():
    """fit with a plain optax.sgd: two steps equal the hand-written update w - lr * grad, in
    float64 (both sides cast up), so that only the update rule is compared."""
    from svflow_jax.training import fit, lm_loss

    def model64():
        graphdef, state = nnx.split(SolverLM(TINY, rngs=nnx.Rngs(0)))
        return nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.float64), state))

    task = get_task("austen", TINY.context)
    batches = [tuple(map(jax.numpy.asarray, task.batch(0, step, 4))) for step in range(2)]
    graphdef, expected, rest = nnx.split(model64(), nnx.Param, ...)
    grad = jax.jit(jax.grad(lambda w, batch: lm_loss(nnx.merge(graphdef, w, rest), *batch)[0]))
    for batch in batches:
        expected = jax.tree.map(lambda w, g: w - 0.1 * g, expected, grad(expected, batch))
    trained = fit(model64(), lm_loss, optax.sgd(0.1), lambda step: batches[step], 2).model
    # Both sides round the same float64 operations in other orders: the gradients' sums of
    # at most 4 x 16 tokens' terms differ by ~64 eps64 |g|, times lr, and each update adds
    # eps64 |w|: below 1e-13 for weights and gradients of size O(1). A wrong update (another
    # rate, sign or step count) moves a weight by lr |g| ~ 1e-3.
    for x, y in zip(jax.tree.leaves(nnx.state(trained, nnx.Param)), jax.tree.leaves(expected),
                    strict=True):
        assert x.dtype == jnp.float64
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-13)


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
    TransformerLM holding the same weights (float32: the exactness claims' rule C L eps s, the
    head counted as one more layer)."""
    model = train(_config("euler"), progress=False).model
    tokens = AustenBytes(context=16).eval_batches(4, 4)[0][0]
    ours = nnx.jit(lambda m, t: m(t))(model, tokens)
    theirs = nnx.jit(lambda m, t: m(t))(model.to_transformer(), tokens)
    scale = float(np.max(np.abs(theirs)))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=exactness_tolerance(
        jnp.float32, TINY.num_steps + 1, scale))


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
    one = get_task("recall1")
    x, y, w = one.batch(0, 0, 16)
    assert one.vocab_size == 17 and x.shape == (16, 25) and (x[:, 16] == 16).all()
    for b in range(16):  # keys 0..7 each once, values 8..15 each once, one look-up per query
        keys, values = x[b, 0:16:2], x[b, 1:16:2]
        assert sorted(keys) == list(range(8)) and sorted(values) == list(range(8, 16))
        for i in range(17, 25):
            assert y[b, i] == x[b, 1 + list(x[b, :16]).index(x[b, i])]
    assert w[:, 17:].all() and w.sum() == 16 * 8
    with pytest.raises(ValueError, match="separate_values needs hops=1"):
        MultiHopRecall(hops=2, separate_values=True)
    with pytest.raises(ValueError, match="unknown task"):
        TrainConfig(task="wiki")
    with pytest.raises(ValueError, match="divisible"):
        train(TrainConfig(model=TINY, batch_size=3, steps=1), progress=False,
              devices=[jax.devices()[0]] * 2)


def test_svflow_train_runs_the_recipe_by_default(capsys):
    """``svflow train`` with no options is the tuned baseline of
    :mod:`svflow_jax.training.recipes` (a pre-norm Transformer), ``--task recall1`` the recall
    recipe; explicit options win, and ``--help`` states the recipe's values."""
    from svflow_jax.cli import build_parser
    from svflow_jax.cli.train import config_from_args
    from svflow_jax.training.recipes import BASELINE, MODEL, RECALL, recipe

    parser = build_parser()
    config = config_from_args(parser.parse_args(["train"]))
    assert config == recipe("austen")
    assert config.model.norm_position == "pre" and config.model.weights == "per_layer"
    assert (config.model.d_model, config.steps, config.lr) == (
        MODEL["d_model"], BASELINE["steps"], BASELINE["lr"])
    recall = config_from_args(parser.parse_args(["train", "--task", "recall1", "--lr", "1e-2"]))
    assert recall.task == "recall1" and recall.steps == RECALL["steps"] and recall.lr == 1e-2
    # the recall recipe's model starts at the scale d^(-1/2) (the Austen recipe's at 0.02)
    assert recall.model.init_std == pytest.approx(MODEL["d_model"] ** -0.5, rel=1e-3)
    assert config.model.init_std == 0.02
    with pytest.raises(SystemExit, match="^0$"):
        parser.parse_args(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for text in (f"width (default {MODEL['d_model']})", f"(default {BASELINE['steps']})",
                 f"(default {MODEL['norm_position']})", f"(default {BASELINE['lr']:g})"):
        assert text in shown, text


def test_svflow_train_cli(tmp_path, capsys):
    """``svflow train``: bad options exit with code 2 before anything compiles; a tiny run
    writes its files and resumes (nothing left to do) when run again."""
    from svflow_jax.cli import build_parser, main
    from svflow_jax.cli.train import config_from_args

    for bad, named in (
            (["--steps", "0"], "argument --steps: must be a positive integer, got '0'"),
            (["--method", "nope"], "--method: unknown method 'nope'"),
            (["--weights", "cubic"], "argument --weights: invalid choice: 'cubic'"),
            (["--method", "geodesic-euler", "--norm", "pre"], "has no pre-norm form"),
            (["--method", "geodesic-euler"], "pre-norm by default: add --norm post"),
            (["--update", "ngpt"], "pre-norm by default: add --norm post"),
            (["--config", "missing.json"], "--config: no such file missing.json"),
            (["--extra-depths", "0"], "argument --extra-depths: must be a positive integer"),
            (["--extra-depths", "8"], "extra_depths needs weights continuous in depth"),
            (["--random-depths", "8"], "random_depths needs weights continuous in depth"),
            (["--embed-norm", "--norm", "post"], "embed_norm is a pre-norm option")):
        with pytest.raises(SystemExit, match="^2$") as err:  # SystemExit's text is its code
            main(["train", *bad])
        assert err.value.code == 2, bad
        assert named in capsys.readouterr().err, bad
    assert main(["train", "--list-methods"]) == 0
    assert "crouch-grossman3" in capsys.readouterr().out
    argv = ["train", "--method", "lie-trotter", "--norm", "post", "--update", "ngpt",
            "--num-steps", "2", "--anchors", "2",
            "--duration", "2", "--d-model", "16", "--heads", "2", "--d-head", "8", "--d-ff",
            "32", "--context", "16", "--steps", "3", "--batch-size", "4", "--eval-every", "0",
            "--out", str(tmp_path / "run"), "--no-progress"]
    assert main(argv) == 0
    final = json.loads((tmp_path / "run" / "final.json").read_text())
    assert final["design"] == "lie-trotter" and final["resumed_from"] is None
    assert final["environment"]["cpu_count"] == os.cpu_count()
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["num_steps"] == 2 and saved["steps"] == 3
    assert saved["model"]["update"] == "ngpt"
    assert main(argv) == 0  # resumes from the step-3 checkpoint: nothing left to train
    assert json.loads((tmp_path / "run" / "final.json").read_text())["resumed_from"] == 3
    # --extra-depths reaches the config the run trains and records
    parser = build_parser()
    config = config_from_args(parser.parse_args(["train", "--weights", "linear",
                                                 "--extra-depths", "8", "16"]))
    assert config.extra_depths == (8, 16) and config.model.weights == "linear"
    assert config.model.embed_norm is False
    assert config_from_args(parser.parse_args(["train", "--embed-norm"])).model.embed_norm
    assert config_from_args(parser.parse_args(["train"])).extra_depths == ()
    config = config_from_args(parser.parse_args(["train", "--weights", "linear",
                                                 "--random-depths", "8", "16"]))
    assert config.random_depths == (8, 16) and config.extra_depths == ()


def test_a_kill_while_logging_loses_no_metrics(tmp_path, monkeypatch):
    """A kill in the middle of appending step 6's metrics (injected in the append helper):
    the resumed run cuts the half line and the rows logged after the step-4 checkpoint, and
    ends with the uninterrupted run's metrics, each line a complete record."""
    from svflow_jax import atomic

    config = _config("euler", steps=8, checkpoint_every=4, eval_every=0)
    append = atomic.append_line

    def killed_at_step_6(path, line):
        if json.loads(line)["step"] == 6:
            with open(path, "a") as f:
                f.write(line[: len(line) // 2])
            raise KeyboardInterrupt
        append(path, line)

    monkeypatch.setattr(atomic, "append_line", killed_at_step_6)
    with pytest.raises(KeyboardInterrupt):
        train(config, tmp_path / "run", progress=False)
    monkeypatch.undo()
    log = tmp_path / "run" / "metrics.jsonl"
    assert not log.read_text().endswith("\n")  # the cut line is there
    resumed = train(config, tmp_path / "run", progress=False)
    assert resumed.resumed_from == 4
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    whole = train(config, progress=False)
    assert [r["loss"] for r in rows] == [r["loss"] for r in whole.history]


def test_resume_refuses_other_devices_or_an_edited_design(tmp_path, monkeypatch):
    """``run.json`` records the device count and a hash of a ``module:Attr`` design's file; a
    resume under another of either is refused (or warned about, when asked)."""
    (tmp_path / "my_tableau.py").write_text(textwrap.dedent("""
        import diffrax
        import numpy as np
        RALSTON = diffrax.ButcherTableau(c=np.array([2 / 3]), b_sol=np.array([0.25, 0.75]),
                                         b_error=np.zeros(2), a_lower=(np.array([2 / 3]),))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = _config("my_tableau:RALSTON", steps=3, eval_every=0)
    out = tmp_path / "run"
    train(config, out, progress=False, stop_after=1)
    run = json.loads((out / "run.json").read_text())
    assert run["devices"] == 1 and run["design_source"].startswith("sha256:")
    with open(tmp_path / "my_tableau.py", "a") as f:
        f.write("# edited between the interruption and the resume\n")
    with pytest.raises(ValueError, match="design_source"):
        train(config, out, progress=False)
    (out / "run.json").write_text(json.dumps({**run, "devices": 2}))
    with pytest.raises(ValueError, match="devices: 2 then, 1 now"):
        train(config, out, progress=False)
    with pytest.warns(UserWarning, match="other conditions"):
        result = train(config, out, progress=False, on_mismatch="warn")
    assert result.resumed_from == 1 and [r["step"] for r in result.history] == [1, 2, 3]


def test_more_steps_extend_a_finished_run_at_the_final_learning_rate(tmp_path):
    """A finished 4-step run asked for 6 steps continues from its checkpoint; the schedule
    keeps its 4-step length, so steps 5 and 6 run at lr * final_lr_fraction. An unfinished
    run cannot be extended."""
    config = _config("euler", steps=4, eval_every=0)
    train(config, tmp_path / "done", progress=False)
    longer = dataclasses.replace(config, steps=6)
    result = train(longer, tmp_path / "done", progress=False)
    assert result.resumed_from == 4 and result.config.schedule_steps == 4
    assert [r["step"] for r in result.history] == [1, 2, 3, 4, 5, 6]
    final_lr = config.lr * config.final_lr_fraction
    np.testing.assert_allclose([r["lr"] for r in result.history[4:]], [final_lr] * 2,
                               rtol=1e-6)
    assert json.loads((tmp_path / "done" / "config.json").read_text())["schedule_steps"] == 4
    train(config, tmp_path / "cut", progress=False, stop_after=2)
    with pytest.raises(ValueError, match="unfinished run of 4 steps"):
        train(longer, tmp_path / "cut", progress=False)


def test_a_diverging_run_stops_with_exit_1(tmp_path, capsys):
    """``svflow train --lr 1e30``: exit 1 at the first non-finite loss, a message on stderr,
    and a strict ``final.json`` (no bare NaN) saying where it stopped."""
    from svflow_jax.cli import main

    out = tmp_path / "run"
    argv = ["train", "--method", "euler", "--num-steps", "2", "--anchors", "2", "--duration",
            "2", "--d-model", "16", "--heads", "2", "--d-head", "8", "--d-ff", "32",
            "--context", "16", "--steps", "20", "--batch-size", "4", "--eval-every", "0",
            "--warmup", "0", "--lr", "1e30", "--out", str(out), "--no-progress"]
    assert main(argv) == 1
    assert "diverged" in capsys.readouterr().err

    def refuse(name):
        raise AssertionError(f"bare {name} in final.json")

    final = json.loads((out / "final.json").read_text(), parse_constant=refuse)
    assert 1 <= final["diverged_at"] < 20 and final["loss"] is None
    assert final["non_finite"] == [f"loss: {final['stopped'].split()[4]}"]
    rows = [json.loads(line, parse_constant=refuse)
            for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == final["diverged_at"] and rows[-1]["loss"] is None


def test_a_run_that_crashed_before_its_first_checkpoint_can_be_rerun(tmp_path, monkeypatch):
    """Killed before any checkpoint, a folder holds nothing to resume: a corrected rerun (here
    another learning rate) starts afresh there instead of being refused, and its log holds only
    its own rows."""
    from svflow_jax import atomic

    def killed(path, line):
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic, "append_line", killed)
    with pytest.raises(KeyboardInterrupt):
        train(_config("euler", steps=3, eval_every=0), tmp_path / "run", progress=False)
    monkeypatch.undo()
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        p.name.isdigit() for p in (tmp_path / "run" / "checkpoints").iterdir())
    result = train(_config("euler", steps=3, eval_every=0, lr=5e-3), tmp_path / "run",
                   progress=False)
    assert result.resumed_from is None
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["lr"] == 5e-3
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def test_a_run_resumes_with_another_remat_choice_but_not_another_model(tmp_path):
    """``remat`` (what the backward pass recomputes) gives the same gradient, so a run saved
    with one choice resumes with another; a change of the model itself is refused."""
    import json

    from svflow_jax.training.trainer import _settle_config

    saved = TrainConfig(model=DesignConfig(remat=True), steps=10)
    (tmp_path / "config.json").write_text(json.dumps(saved.to_json()))
    dots = dataclasses.replace(saved, model=saved.model.replace(remat="dots"))
    assert _settle_config(tmp_path, dots, latest=5).model.remat == "dots"
    wider = dataclasses.replace(saved, model=saved.model.replace(d_model=128))
    with pytest.raises(ValueError, match="another configuration"):
        _settle_config(tmp_path, wider, latest=5)
