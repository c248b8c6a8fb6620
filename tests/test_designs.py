"""Solvers as layer designs: the stacks agree with the project's Transformer and with
independently written solvers; costs are counted; bad input fails clearly.

Reference values come from elsewhere than the code under test: the Transformer of
:mod:`svflow_jax.transformer` (written in deep-learning words, with no solver in it), diffrax's
own Heun and midpoint methods, and a hand-written midpoint step.
"""

from __future__ import annotations

import json
import math
from typing import ClassVar

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from diffrax import RESULTS
from flax import nnx

from svflow_jax import sphere
from svflow_jax.claims.measure import exactness_tolerance
from svflow_jax.designs import DesignConfig, SolverLM, evaluations, from_tableau
from svflow_jax.solvers import AbstractSphereSolver, within_step
from svflow_jax.solvers.catalogue import CATALOGUE as DESIGNS
from svflow_jax.solvers.catalogue import Method as LayerDesign
from svflow_jax.solvers.catalogue import get as get_design

SMALL = DesignConfig(d_model=16, n_heads=2, d_head=8, d_ff=32, context=12, num_steps=3,
                     num_anchors=3, duration=3.0, init_std=0.3)
TOKENS = jax.random.randint(jax.random.key(7), (2, 12), 0, 256)


def _logits(config: DesignConfig, seed: int = 0, steps: int | None = None) -> jax.Array:
    model = SolverLM(config, rngs=nnx.Rngs(seed))
    return nnx.jit(lambda m, t: m(t, num_steps=steps))(model, TOKENS)


@pytest.mark.parametrize(
    ("design", "norm_position", "head_bias"),
    [("euler", "post", False), ("euler", "pre", False), ("lie-trotter", "post", False),
     ("strang", "post", False), ("lie-trotter", "post", True)],
)
def test_euler_designs_equal_the_transformer(design, norm_position, head_bias):
    """Per-layer weights, one step per layer: the design IS the Transformer block (parallel,
    sequential or macaron; post-norm with projected branches or pre-norm), same weights; with
    a head bias too."""
    model = SolverLM(SMALL.replace(design=design, norm_position=norm_position,
                                   head_bias=head_bias), rngs=nnx.Rngs(1))
    if head_bias:
        model.unembed_bias[...] = jax.random.normal(jax.random.key(2), (SMALL.vocab_size,),
                                                    jnp.float32)
    ours = nnx.jit(lambda m, t: m(t))(model, TOKENS)
    theirs = nnx.jit(lambda m, t: m(t))(model.to_transformer(), TOKENS)
    scale = float(jnp.max(jnp.abs(theirs)))
    assert scale > 1.0  # the stack moves the logits: the comparison means something
    # two orderings of float32 operations: the exactness claims' rule C L eps s, the head
    # counted as one more layer (measured C = 0.6-1.5 on CPUs with and without FMA)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=exactness_tolerance(
        jnp.float32, SMALL.num_steps + 1, scale))


def test_embed_norm_is_a_norm_on_the_embeddings():
    """``embed_norm`` (pre-norm): the stack starts at ``R(e)``, i.e. the Transformer's hidden
    state starts at ``RMSNorm(e) = rho R(e)``. Checked against the model without the option,
    bridged to a ``TransformerLM`` whose stack and head run on the embeddings normalised by
    hand (NumPy); the two models differ, and the option is refused where it has no meaning or
    no Transformer."""
    pre = SMALL.replace(norm_position="pre")
    ours = SolverLM(pre.replace(embed_norm=True), rngs=nnx.Rngs(1))
    lm = SolverLM(pre, rngs=nnx.Rngs(1)).to_transformer()  # the same weights
    e = np.asarray(lm.embeddings(TOKENS), np.float64)
    x0 = e / np.sqrt(np.mean(e ** 2, axis=-1, keepdims=True))
    y0 = np.asarray(ours.initial_state(TOKENS))
    np.testing.assert_allclose(np.linalg.norm(y0, axis=-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(y0 * pre.radius, x0, rtol=1e-5, atol=1e-5)
    theirs = lm.logits(lm.transformer(jnp.asarray(x0, jnp.float32)))
    logits = nnx.jit(lambda m, t: m(t))(ours, TOKENS)
    scale = float(jnp.max(jnp.abs(theirs)))
    np.testing.assert_allclose(logits, theirs, rtol=0, atol=exactness_tolerance(
        jnp.float32, SMALL.num_steps + 1, scale))  # the rule above
    plain = nnx.jit(lambda m, t: m(t))(lm, TOKENS)
    assert float(jnp.max(jnp.abs(plain - theirs))) > 1e-2 * scale  # the option matters
    with pytest.raises(ValueError, match="embed_norm is a pre-norm option"):
        SMALL.replace(embed_norm=True)
    with pytest.raises(ValueError, match="embed_norm .* has no TransformerLM equivalent"):
        ours.to_transformer()


def test_user_tableau_equals_diffrax_heun():
    """A tableau written by a user (Heun's) builds the same stack as diffrax's Heun."""
    heun = diffrax.ButcherTableau(c=np.array([1.0]), b_sol=np.array([0.5, 0.5]),
                                  b_error=np.array([0.5, -0.5]), a_lower=(np.array([1.0]),))
    mine = from_tableau(heun, "my-heun", order=2)
    config = SMALL.replace(weights="linear")
    ours = _logits(config.replace(design=mine))
    reference = _logits(config.replace(design="heun"))
    np.testing.assert_allclose(ours, reference, atol=1e-5, rtol=1e-5)
    assert evaluations(mine, 4) == 8
    assert mine.adaptive is not None  # it has an error estimate: adaptive depth can use it


def test_readme_example_ralston_tableau_trains():
    """The README's example: Ralston's tableau as a design, trained with the Python API; it
    equals a design built on diffrax's own Ralston and its training loss falls."""
    from svflow_jax.designs import DesignConfig, from_tableau
    from svflow_jax.solvers import Retracted
    from svflow_jax.training import TrainConfig, train

    tableau = diffrax.ButcherTableau(
        c=np.array([2 / 3]), b_sol=np.array([1 / 4, 3 / 4]), b_error=np.zeros(2),
        a_lower=(np.array([2 / 3]),))
    ralston = from_tableau(tableau, "ralston", order=2)
    model = DesignConfig(design=ralston, weights="linear", num_steps=2, num_anchors=2,
                         duration=2.0, d_model=16, n_heads=2, d_head=8, d_ff=32, context=16)
    result = train(TrainConfig(model=model, steps=10, batch_size=8, lr=1e-2, warmup=2,
                               eval_every=10, eval_sequences=8, log_every=1), progress=False)
    losses = [row["loss"] for row in result.history]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3
    assert ralston.adaptive is None  # b_error = 0: no estimate, no adaptive depth
    reference = LayerDesign("diffrax-ralston", Retracted(diffrax.Ralston()))
    tokens = TOKENS[:, :16]
    ours = nnx.jit(lambda m, t: m(t))(result.model, tokens)
    theirs = nnx.jit(lambda m, t: m(t))(
        nnx.merge(nnx.graphdef(SolverLM(model.replace(design=reference), rngs=nnx.Rngs(0))),
                  nnx.state(result.model)), tokens)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)


class HandMidpoint(AbstractSphereSolver):
    """A user's own solver: ``y1 = R(y + h v(t + h/2, R(y + h/2 v(t, y))))``."""

    marker: ClassVar[str] = "user"

    def order(self, terms):
        return 2

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        terms, _ = within_step(terms, t0, t1)
        h = t1 - t0
        k1 = terms.vf(t0, y0, args)
        k2 = terms.vf(t0 + h / 2, sphere.retract(y0 + h / 2 * k1), args)
        y1 = sphere.retract(y0 + h * k2)
        return y1, None, dict(y0=y0, y1=y1), None, RESULTS.successful


def test_user_subclass_equals_diffrax_midpoint():
    mine = LayerDesign("hand-midpoint", HandMidpoint())
    for weights in ("per_layer", "chebyshev"):
        config = SMALL.replace(weights=weights)
        np.testing.assert_allclose(_logits(config.replace(design=mine)),
                                   _logits(config.replace(design="midpoint")),
                                   atol=1e-5, rtol=1e-5)


def test_evaluations_are_counted():
    expected = {"euler": 1, "heun": 2, "midpoint": 2, "rk4": 4, "geodesic-euler": 1,
                "crouch-grossman3": 3, "lie-trotter": 1, "strang": 1.5}
    for name, per_step in expected.items():
        assert evaluations(DESIGNS[name], 4) == 4 * per_step, name


@pytest.fixture
def float32_matmuls():
    """Float32 matrix multiplies on every backend (a GPU's default rounds their inputs to
    TF32): the tests that use it compare two float32 computations of one quantity at a float32
    tolerance. On the CPU it changes nothing (XLA's CPU backend computes in float32)."""
    with jax.default_matmul_precision("highest"):
        yield


def test_continuous_weights_converge_in_depth():
    """Continuous-in-depth weights run at any step count; RK4 stacks approach the flow fast
    (differences between N and 2N steps shrink by about 2^4)."""
    config = SMALL.replace(design="rk4", weights="chebyshev", init_std=0.2)
    outs = [_logits(config, steps=n) for n in (2, 4, 8)]
    d1 = float(jnp.max(jnp.abs(outs[0] - outs[1])))
    d2 = float(jnp.max(jnp.abs(outs[1] - outs[2])))
    assert d1 > 1e-4  # the flow is not trivial
    assert d2 < d1 / 6, (d1, d2)


@pytest.mark.usefixtures("float32_matmuls")
def test_adaptive_depth_of_a_pre_norm_stack_approaches_a_tight_solve():
    """Adaptive depth on a pre-norm stack (the embedded pair in R^d; here Heun's with its Euler
    estimate, run on a model whose own design, Euler, has no estimate), in float64 so that only
    the methods' errors are compared: each sequence's loss is within the controller's promise
    of that of 2048 fixed Heun steps of the same field (an independent solve through
    ``integrate``), and the distance shrinks with the tolerance as the controller's error does;
    a looser tolerance spends fewer evaluations and moves the loss; without ``method`` the
    Euler model is refused, and so is a splitting's pair."""
    import diffrax

    from svflow_jax.designs import adaptive_evaluate
    from svflow_jax.designs.design import integrate
    from svflow_jax.next_token import next_token_nll
    from svflow_jax.solvers import WithinStep

    config = SMALL.replace(weights="chebyshev", norm_position="pre", init_std=0.3)
    graphdef, state = nnx.split(SolverLM(config, rngs=nnx.Rngs(2)))
    model = nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.float64), state))
    tokens = np.asarray(TOKENS)
    inputs, targets = tokens[:, :-1], jnp.asarray(tokens[:, 1:])
    weights = np.ones(targets.shape)

    def loss(y):  # each sequence's mean next-token loss, from a final state
        return jnp.mean(next_token_nll(model.head(y), targets), axis=-1)

    def reference(steps):
        return integrate(WithinStep(diffrax.Heun()), model.terms(),
                         model.initial_state(jnp.asarray(inputs)), 0.0, config.duration, steps)

    y = reference(2048)
    tight = np.asarray(loss(y))
    assert tight.dtype == np.float64
    # Heun is second order: the 2048-step loss is off by about |L_2048 - L_1024| / 3
    reference_error = np.abs(tight - np.asarray(loss(reference(1024)))) / 3
    coarse = np.asarray(loss(model.final_state(jnp.asarray(inputs), num_steps=1)))
    assert np.max(np.abs(coarse - tight)) > 1e-3  # the depth matters on this field

    fine = adaptive_evaluate(model, inputs, targets, weights, rtol=1e-4, method="heun")
    finer = adaptive_evaluate(model, inputs, targets, weights, rtol=1e-6, method="heun",
                              max_steps=4096)
    loose = adaptive_evaluate(model, inputs, targets, weights, rtol=1e-1, method="heun")
    assert fine.ok.all() and finer.ok.all() and loose.ok.all()
    # The controller's promise, carried to the loss: every accepted step's local error is at
    # most tol = atol + rtol |y| in each component (atol = rtol here), so n steps move the final
    # state by at most n tol per component (first order, a flow that does not expand errors)
    # and the loss by at most ||dL/dy_T||_1 n tol (the gradient by autodiff at the reference).
    # Measured: 5.5e-5 / 1.0e-4 against bounds of 0.30 at rtol 1e-4 (a bound of 1e-4 on the
    # float32 figure, fitted to one CPU, failed on another by 1e-7).
    gradient = jax.grad(lambda y: jnp.sum(loss(y)))(y)
    sensitivity = np.sum(np.abs(np.asarray(gradient)).reshape(len(inputs), -1), axis=-1)
    size = np.max(np.abs(np.asarray(y)).reshape(len(inputs), -1), axis=-1)
    error = np.abs(fine.loss - tight)
    assert np.all(error <= sensitivity * fine.steps * fine.rtol * (1 + size) + reference_error)
    # This pair (Euler's estimate, Heun's step) keeps h^2 ~ tol, so its global error is
    # proportional to tol; an error-per-step controller without that extrapolation would give
    # tol^(1/2) at worst: 100 times the tolerance is at least 10 times the error. A solve that
    # converges to another field's loss does not shrink, and fails here.
    assert np.all(np.abs(finer.loss - tight) <= error / 10 + reference_error)
    assert np.all(loose.evaluations < fine.evaluations)
    assert np.max(np.abs(loose.loss - tight)) > np.max(error)
    with pytest.raises(ValueError, match="no embedded error estimate"):
        adaptive_evaluate(model, inputs, targets, weights, rtol=1e-3)
    with pytest.raises(ValueError, match="a splitting"):
        adaptive_evaluate(model, inputs, targets, weights, rtol=1e-3, method="strang")


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown design"):
        DesignConfig(design="nope")
    with pytest.raises(ValueError, match="no pre-norm form"):
        DesignConfig(design="geodesic-euler", norm_position="pre")
    with pytest.raises(ValueError, match="weights"):
        DesignConfig(weights="cubic")
    with pytest.raises(ValueError, match="num_anchors"):
        DesignConfig(weights="linear", num_anchors=1)
    with pytest.raises(TypeError, match="diffrax solver"):
        LayerDesign("x", solver="euler")
    with pytest.raises(ValueError, match="context"):
        SolverLM(SMALL, rngs=nnx.Rngs(0))(jnp.zeros((1, 13), jnp.int32))
    path = "svflow_jax.designs.design:CLASSICAL_RK4"
    assert get_design(path).name == path and get_design(path).order == 4
    with pytest.raises(ValueError, match="needs norm_position='post'"):
        DesignConfig(update="ngpt", norm_position="pre")
    with pytest.raises(ValueError, match="update must be"):
        DesignConfig(update="normalised")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no TransformerLM equivalent"):
        SolverLM(SMALL.replace(update="ngpt"), rngs=nnx.Rngs(0)).to_transformer()


def test_per_layer_stages_read_their_layer():
    """Per-layer weights, pre-norm: every stage of a Heun block (also its stage at c = 1)
    reads the weights of the block's own layer (plain diffrax Heun would read the next
    layer's). Reference: each layer run alone, as a one-anchor model (constant weights) for
    one step of length h, one after the other."""
    from svflow_jax.designs import integrate

    config = SMALL.replace(design="heun", norm_position="pre", init_std=0.3)
    model = SolverLM(config, rngs=nnx.Rngs(3))
    h = config.duration / config.num_anchors
    solver = config.layer_design.solver_for("pre")
    singles = []
    for layer in range(config.num_anchors):
        single = SolverLM(config.replace(num_anchors=1, num_steps=1, duration=h),
                          rngs=nnx.Rngs(0))
        for name in ("wq", "wk", "wv", "wo", "w_in", "w_out"):
            getattr(single, name)[...] = getattr(model, name)[...][layer:layer + 1]
        singles.append(single)

    @nnx.jit
    def reference(model, singles, tokens):
        y = model.initial_state(tokens)
        for single in singles:
            y = integrate(solver, single.terms(), y, 0.0, h, 1)
        return model.head(y)

    expected = reference(model, singles, TOKENS)
    ours = nnx.jit(lambda m, t: m(t))(model, TOKENS)
    np.testing.assert_allclose(ours, expected, atol=1e-5 * float(jnp.max(jnp.abs(expected))))


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_ngpt_design_is_the_published_normalised_step():
    """nGPT's block (Loshchilov et al., 2024): ``h <- Norm(h + alpha_A (Norm(h_A) - h))``, then
    the same with the MLP branch, with learned per-dimension ``alpha``. The Lie-Trotter design
    with ``update="ngpt"`` and per-layer weights equals that update written as a NumPy loop,
    with ``h_A``, ``h_M`` the model's attention and FFN branches of each layer and
    ``alpha = h a_l`` (random rates, so each dimension moves at its own rate); the rates get a
    finite, non-zero gradient from the loss."""
    config = SMALL.replace(design="lie-trotter", update="ngpt")
    model = SolverLM(config, rngs=nnx.Rngs(2))
    d, h = config.d_model, config.duration / config.num_steps
    model.step_rates[...] = (d ** -0.5) * jax.random.uniform(
        jax.random.key(0), model.step_rates[...].shape, jnp.float32, minval=0.5, maxval=3.0)
    alpha = h * np.asarray(model.step_rates[...], np.float64) * math.sqrt(d) / config.duration
    attention, experts = model.fields()
    branch = eqx.filter_jit(lambda field, t, y: field.drift(t, y))  # one program per field
    y = np.asarray(model.initial_state(TOKENS), np.float64)
    for layer in range(config.num_anchors):
        t = jnp.float32(layer * h)
        h_a = np.asarray(branch(attention, t, jnp.asarray(y, jnp.float32)), np.float64)
        y = _unit(y + alpha[layer, 0] * (_unit(h_a) - y))
        h_m = np.asarray(branch(experts, t, jnp.asarray(y, jnp.float32)), np.float64)
        y = _unit(y + alpha[layer, 1] * (_unit(h_m) - y))
    ours = np.asarray(nnx.jit(lambda m, x: m.final_state(x))(model, TOKENS), np.float64)
    np.testing.assert_allclose(ours, y, atol=2e-5)
    assert not np.allclose(ours, np.asarray(SolverLM(SMALL.replace(design="lie-trotter"),
                                                      rngs=nnx.Rngs(2)).final_state(TOKENS)),
                           atol=1e-2)  # the residual update of the same weights differs

    grads = nnx.grad(lambda m: jnp.mean(m(TOKENS) ** 2))(model)
    grad = np.asarray(jax.tree.leaves(grads["step_rates"])[0])
    assert np.all(np.isfinite(grad)) and float(jnp.max(jnp.abs(grad))) > 0


def test_token_collapse_against_a_pairwise_loop():
    """The collapse measure equals the mean over sequences of the pairwise cosine loop in NumPy
    on the model's final states; a model whose tokens all start at one point (equal
    embeddings, no positions) is collapsed (1 to float32 round-off), an untrained one is not."""
    from svflow_jax.training.compare import COLLAPSED, token_collapse
    from svflow_jax.training.tasks import AustenBytes

    task = AustenBytes(context=12)
    config = DesignConfig(d_model=16, n_heads=2, d_head=8, d_ff=32, num_steps=3, num_anchors=3,
                          duration=3.0, context=12)
    model = SolverLM(config, rngs=nnx.Rngs(1))
    inputs = np.concatenate([b[0] for b in task.eval_batches(5, 2)])
    y = np.asarray(model.final_state(jnp.asarray(inputs)), np.float64)
    per_sequence = []
    for seq in y:
        pairs = [seq[i] @ seq[j] / np.linalg.norm(seq[i]) / np.linalg.norm(seq[j])
                 for i in range(len(seq)) for j in range(len(seq)) if i != j]
        per_sequence.append(np.mean(pairs))
    measured = token_collapse(model, task, 5, batch_size=2)
    np.testing.assert_allclose(measured, np.mean(per_sequence), atol=1e-5)
    assert measured < 0.5

    model.embed[...] = jnp.broadcast_to(model.embed[...][0], model.embed[...].shape)
    model.pos_embed[...] = jnp.zeros_like(model.pos_embed[...])
    assert token_collapse(model, task, 5, batch_size=2) == pytest.approx(1.0, abs=1e-5)
    assert COLLAPSED < 1.0


@pytest.mark.parametrize("design", ["geodesic-euler", "euler"])
def test_step_lengths_are_the_angles_one_block_turns(design):
    """One block from ``y_0``: geodesic Euler turns each token by the measured step length
    ``theta``, post-norm Euler by ``atan(theta)`` (the angle read from ``y_0`` and ``y_1`` of
    the model's own forward pass, in float64); ``theta`` is linear in the step ``h = T`` (the
    field at ``t = 0`` does not depend on ``T``), which takes tokens past half a turn; a
    pre-norm stack is refused."""
    from svflow_jax.training.compare import step_lengths
    from svflow_jax.training.tasks import AustenBytes

    task = AustenBytes(context=12)

    def model(duration, norm="post"):
        return SolverLM(DesignConfig(design=design, norm_position=norm, d_model=16, n_heads=2,
                                     d_head=8, d_ff=32, num_steps=1, num_anchors=2,
                                     duration=duration, context=12),
                        rngs=nnx.Rngs(3))

    one = model(1.0)
    measured = step_lengths(one, task, 6, batch_size=3)
    inputs = jnp.asarray(np.concatenate([b[0] for b in task.eval_batches(6, 3)]))
    y0 = np.asarray(one.initial_state(inputs), np.float64).reshape(-1, 16)
    y1 = np.asarray(one.final_state(inputs), np.float64).reshape(-1, 16)
    dot = np.sum(y0 * y1, axis=-1)
    angle = np.arctan2(np.linalg.norm(y1 - dot[:, None] * y0, axis=-1), dot)
    theta = angle if design == "geodesic-euler" else np.tan(angle)
    assert theta.max() < np.pi  # below half a turn the angle says theta
    np.testing.assert_allclose(measured["median"], [np.median(theta)], rtol=1e-4)
    np.testing.assert_allclose(measured["p99"], [np.quantile(theta, 0.99)], rtol=1e-4)
    np.testing.assert_allclose(measured["max"], [theta.max()], rtol=1e-4)
    assert measured["above_pi"] == [0.0]

    scale = 2 * np.pi / np.median(theta)  # the median token then turns by a whole turn
    far = step_lengths(model(scale), task, 6, batch_size=3)
    np.testing.assert_allclose(far["max"], [scale * theta.max()], rtol=1e-4)
    assert far["above_pi"][0] == pytest.approx(np.mean(scale * theta > np.pi))
    assert far["above_pi"][0] > 0.5
    with pytest.raises(ValueError, match="norm_position='post'"):
        step_lengths(model(1.0, "pre"), task, 6, batch_size=3)


def test_head_bias_starts_at_the_log_prior_of_the_training_text():
    """With ``head_bias`` the trainer starts the bias at the task's log prior: the add-one
    smoothed byte frequencies of the training text, counted here with ``collections.Counter``;
    with the head's matrix at zero the model's logits are that prior at every position."""
    import collections

    from svflow_jax.training import TrainConfig, train
    from svflow_jax.training.tasks import AustenBytes

    task = AustenBytes(context=8)
    counts = collections.Counter(task.text("train").tobytes())
    total = sum(counts.values()) + 256
    expected = np.array([math.log((counts.get(v, 0) + 1) / total) for v in range(256)])
    np.testing.assert_allclose(task.log_prior(), expected, rtol=1e-6, atol=1e-6)

    config = TrainConfig(model=SMALL.replace(head_bias=True, context=8), steps=1, lr=1e-12,
                         warmup=0, batch_size=2, eval_every=0)
    model = train(config, None, progress=False).model
    np.testing.assert_allclose(model.unembed_bias[...], expected, atol=1e-5)
    model.unembed[...] = jnp.zeros_like(model.unembed[...])
    logits = model(jnp.asarray(task.batch(0, 0, 2)[0]))
    np.testing.assert_allclose(logits, np.broadcast_to(expected, logits.shape), atol=1e-5)
    assert SolverLM(SMALL, rngs=nnx.Rngs(0)).unembed_bias is None  # off by default


@pytest.mark.parametrize(("design", "order", "multiples"),
                         [("euler", 1, (2, 4, 8, 16)), ("heun", 2, (2, 4, 8, 16)),
                          ("rk4", 4, (1, 2, 4))])  # RK4 reaches float32 round-off past 16 blocks
def test_richardson_ratios_of_a_smooth_flow_are_two_to_the_order(design, order, multiples):
    """Weights smooth in depth (Chebyshev path), untrained: the stack discretises one flow, so
    the differences between the final states at N, 2N, 4N, ... blocks shrink by 2^p for a
    method of order p (Richardson), post-norm and pre-norm."""
    from svflow_jax.training.compare import richardson
    from svflow_jax.training.tasks import AustenBytes

    task = AustenBytes(context=12)
    for norm in ("post", "pre"):
        config = SMALL.replace(design=design, weights="chebyshev", norm_position=norm,
                               num_steps=4, init_std=0.1)
        model = SolverLM(config, rngs=nnx.Rngs(3))
        r = richardson(model, task, multiples=multiples, eval_sequences=4, batch_size=4)
        assert len(r["differences"]) == len(multiples) - 1
        assert all(d > 0 for d in r["differences"])
        # the finest ratio within 15% of 2^p (the coarser ones approach it from either side)
        assert r["ratios"][-1] == pytest.approx(2.0 ** order, rel=0.15), (norm, r["ratios"])


def _first_step_nll(model, seed: int, depths) -> list[float]:
    """The mean next-token NLL of the first training batch (2 sequences of 8 bytes) under the
    initial weights of ``seed``, at each of ``depths`` blocks, computed from the logits in
    float64."""
    from svflow_jax.training.tasks import AustenBytes

    first = SolverLM(model, rngs=nnx.Rngs(seed))  # the initial weights
    inputs, targets, _ = AustenBytes(context=8).batch(seed, 0, 2)
    nll = []
    for n in depths:
        logp = jax.nn.log_softmax(np.asarray(first(jnp.asarray(inputs), num_steps=n),
                                             np.float64), axis=-1)
        nll.append(-np.mean(np.take_along_axis(np.asarray(logp), targets[..., None], -1)))
    return nll


@pytest.mark.usefixtures("float32_matmuls")
def test_training_at_several_depths_takes_the_mean_loss():
    """``extra_depths``: the first logged loss (before any update) is the mean of the
    model's next-token NLL at its own depth and at the extra ones, each computed here from the
    logits; per-layer weights are refused; the setting survives config.json."""
    from svflow_jax.training import TrainConfig, train

    model = SMALL.replace(weights="chebyshev", context=8, init_std=0.1)
    config = TrainConfig(model=model, steps=1, batch_size=2, lr=1e-3, warmup=0, eval_every=0,
                         log_every=1, extra_depths=(6, 12))
    result = train(config, None, progress=False)
    nll = _first_step_nll(result.config.model, config.seed, (3, 6, 12))
    assert len({round(v, 4) for v in nll}) == 3  # the depths differ: the mean means something
    assert result.history[0]["loss"] == pytest.approx(np.mean(nll), rel=1e-5)
    assert TrainConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    with pytest.raises(ValueError, match="continuous in depth"):
        TrainConfig(model=SMALL, extra_depths=(6,))
    with pytest.raises(ValueError, match="positive ints"):
        TrainConfig(model=model, extra_depths=(0,))


@pytest.mark.usefixtures("float32_matmuls")
def test_training_at_a_random_depth_takes_the_drawn_depths_loss():
    """``random_depths``: a step's loss is the NLL at the one depth drawn for it (here the
    first step's, before any update, computed from the logits at each depth, for a seed that
    draws each extra depth); the draws are uniform over the depths (a chi-square test over
    3000 steps) and a function of the seed and the step; the setting is refused with
    per-layer weights and together with ``extra_depths``."""
    from scipy import stats

    from svflow_jax.training import TrainConfig, train
    from svflow_jax.training.trainer import draw_depth

    draws = [draw_depth(7, step, 3) for step in range(3000)]
    assert stats.chisquare(np.bincount(draws, minlength=3)).pvalue > 1e-4
    assert draws == [draw_depth(7, step, 3) for step in range(3000)]
    assert draws != [draw_depth(8, step, 3) for step in range(3000)]
    model = SMALL.replace(weights="chebyshev", context=8, init_std=0.1)
    for drawn in (1, 2):  # depth 6, depth 12
        seed = next(s for s in range(100) if draw_depth(s, 0, 3) == drawn)
        config = TrainConfig(model=model, steps=1, batch_size=2, lr=1e-3, warmup=0,
                             eval_every=0, log_every=1, seed=seed, random_depths=(6, 12))
        result = train(config, None, progress=False)
        nll = _first_step_nll(result.config.model, seed, (3, 6, 12))
        assert len({round(v, 4) for v in nll}) == 3  # the depths differ
        assert result.history[0]["loss"] == pytest.approx(nll[drawn], rel=1e-5)
        assert TrainConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    with pytest.raises(ValueError, match="random_depths needs weights continuous in depth"):
        TrainConfig(model=SMALL, random_depths=(6,))
    with pytest.raises(ValueError, match="not both"):
        TrainConfig(model=model, extra_depths=(6,), random_depths=(12,))


def test_what_the_backward_pass_recomputes_does_not_change_the_gradient():
    """``remat=True`` (every block recomputed), ``"dots"`` (only the elementwise work between
    stored matrix products) and ``False`` (nothing): the same function, so the same gradient up
    to the float32 re-association of XLA's fusions, bounded by ``(d_ff + n) eps`` times the
    gradient's scale per block (the longest sums, d_ff = 32 and n = 12 terms), and a malformed
    choice is refused."""
    from svflow_jax.training.tasks import AustenBytes

    inputs, targets, weights = AustenBytes(context=12).batch(0, 0, 2)
    grads = {}
    for remat in (True, "dots", False):
        model = SolverLM(SMALL.replace(remat=remat), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)

        def loss(state, graphdef=graphdef):
            logits = nnx.merge(graphdef, state)(jnp.asarray(inputs))
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], -1))

        grads[remat] = jax.tree.leaves(jax.grad(loss)(state))
    eps = float(jnp.finfo(jnp.float32).eps)
    scale = max(float(jnp.max(jnp.abs(g))) for g in grads[True])
    bound = SMALL.num_steps * (SMALL.d_ff + SMALL.context) * eps * scale
    for remat in ("dots", False):
        worst = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(grads[True], grads[remat],
                                                                    strict=True))
        assert worst <= bound, (remat, worst, bound)
    with pytest.raises(ValueError, match="remat"):
        SMALL.replace(remat="everything")
