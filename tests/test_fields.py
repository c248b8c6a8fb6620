"""SVFlow vector fields: tangency, equivariance, and an independent NumPy implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import erf
from scipy.special import softmax as np_softmax

from svflow_jax import flow, sphere

D, N, H, K = 6, 5, 3, 4


def _state(seed=0, shape=(N,), d=D, dtype=jnp.float64):
    return sphere.uniform(jax.random.PRNGKey(seed), shape, d, dtype)


def _attention(seed=1, **kw):
    return flow.AttentionParams.random(jax.random.PRNGKey(seed), D, H, K, concentration=2.0, **kw)


def _experts(seed=2, num_experts=4, activation="gelu"):
    return flow.ExpertsParams.random(jax.random.PRNGKey(seed), D, 7, num_experts, activation)


def _all_fields():
    return {
        "attention": flow.AttentionField(_attention()),
        "attention-causal": flow.AttentionField(_attention(), causal=True),
        "ffn-gelu": flow.ExpertsField(_experts(num_experts=1)),
        "ffn-swiglu": flow.ExpertsField(_experts(num_experts=1, activation="swiglu"), radius=2.0),
        "moe-dense": flow.ExpertsField(_experts()),
        "moe-top2": flow.ExpertsField(_experts(activation="swiglu"), top_k=2, radius=np.sqrt(D)),
        "sum": flow.SumField(flow.AttentionField(_attention()), flow.ExpertsField(_experts())),
    }


# ---- an independent implementation: loops over latents, NumPy, explicit per-latent scores ----

def _np_attention_field(p, x, causal):
    x = np.asarray(x)
    n, d = x.shape
    A, B, kap = np.asarray(p.kernel_query), np.asarray(p.kernel_key), np.asarray(p.concentration)
    Nin, Mout = np.asarray(p.natural_in), np.asarray(p.natural_out)
    v = np.zeros_like(x)
    for i in range(n):
        proj = np.eye(d) - np.outer(x[i], x[i])
        context = range(i + 1) if causal else range(n)
        for h in range(A.shape[1]):
            logits = np.array([kap[h] * (x[i] @ A[:, h]) @ (x[j] @ B[:, h]) for j in context])
            q = np_softmax(logits)
            for weight, j in zip(q, context, strict=True):
                eta = (x[j] @ Nin[:, h]) @ Mout[h]  # natural parameter of component (h, j)
                v[i] += weight * (proj @ eta)  # posterior weight x Riemannian score
    return v


def _np_top_k(logits, k):
    """Indices of the k largest logits, ties to the LOWER index (a stable sort of -logits)."""
    return np.argsort(-np.asarray(logits), kind="stable")[:k]


def _np_router_posterior(logits, k):
    """Softmax renormalised over ``_np_top_k``; exactly k non-zero weights per row."""
    logits = np.asarray(logits, float)
    q = np.zeros_like(logits)
    for row in np.ndindex(logits.shape[:-1]):
        keep = _np_top_k(logits[row], k)
        q[row + (keep,)] = np_softmax(logits[row][keep])
    return q


def _np_experts_field(p, x, top_k, radius):
    x = np.asarray(x)
    e = p.experts
    w1, w2 = np.asarray(e.w1), np.asarray(e.w2)
    v = np.zeros_like(x)
    for i, xi in enumerate(x):
        y = radius * xi
        if e.activation == "gelu":
            hid = [0.5 * (y @ w1[k]) * (1 + erf((y @ w1[k]) / np.sqrt(2))) for k in range(len(w1))]
        else:
            w3 = np.asarray(e.w3)
            pre = [y @ w1[k] for k in range(len(w1))]
            hid = [pre[k] / (1 + np.exp(-pre[k])) * (y @ w3[k]) for k in range(len(w1))]
        scores = [hid[k] @ w2[k] / radius for k in range(len(w1))]
        if p.router is None:
            q = np.ones(1)
        else:
            logits = y @ np.asarray(p.router.weight)
            keep = _np_top_k(logits, top_k or len(logits))
            q = np.zeros(len(logits))
            q[keep] = np_softmax(logits[keep])
        u = sum(q[k] * scores[k] for k in range(len(q)))
        v[i] = u - (xi @ u) * xi
    return v


def test_attention_matches_independent_numpy():
    x = _state()
    for causal in (False, True):
        p = _attention()
        got = flow.AttentionField(p, causal=causal)(0.0, x)
        np.testing.assert_allclose(got, _np_attention_field(p, x, causal), atol=1e-13)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("num_experts,top_k", [(1, None), (4, None), (4, 2), (4, 1)])
def test_experts_match_independent_numpy(activation, num_experts, top_k):
    x = _state(3)
    p = _experts(num_experts=num_experts, activation=activation)
    radius = 1.7
    got = flow.ExpertsField(p, top_k=top_k, radius=radius)(0.0, x)
    np.testing.assert_allclose(got, _np_experts_field(p, x, top_k, radius), atol=1e-13)


@pytest.mark.parametrize("name", list(_all_fields()))
def test_every_field_is_tangent(name):
    field = _all_fields()[name]
    x = _state(4, shape=(2, N))  # a leading batch axis too
    v = field(0.3, x)
    assert v.shape == x.shape
    assert float(jnp.abs(jnp.sum(v * x, -1)).max()) < 1e-14
    assert float(jnp.abs(v).max()) > 1e-3  # not trivially zero


def _rotate_attention(p, q):  # parameters for tokens x q: Q^T on inputs, Q on outputs
    return flow.AttentionParams(
        kernel_query=jnp.einsum("ed,ehk->dhk", q, p.kernel_query),
        kernel_key=jnp.einsum("ed,ehk->dhk", q, p.kernel_key),
        concentration=p.concentration,
        natural_in=jnp.einsum("ed,ehk->dhk", q, p.natural_in),
        natural_out=p.natural_out @ q,
    )


def _rotate_experts(p, q):
    e = p.experts
    experts = flow.ScoreNetworks(
        w1=jnp.einsum("ed,kef->kdf", q, e.w1), w2=e.w2 @ q,
        w3=None if e.w3 is None else jnp.einsum("ed,kef->kdf", q, e.w3),
        activation=e.activation,
    )
    router = None if p.router is None else flow.RouterPosterior(q.T @ p.router.weight)
    return flow.ExpertsParams(experts=experts, router=router)


def test_rotation_equivariance():
    """Rotate tokens (x -> x Q) and parameters together: the field rotates, v -> v Q."""
    q, _ = jnp.linalg.qr(jax.random.normal(jax.random.PRNGKey(5), (D, D)))
    x = _state(6)
    pa, pe = _attention(), _experts(activation="swiglu")
    # (x Q)(Q^T A) = x A: rotated parameters are Q^T on the input side, Q on the output side
    cases = [
        (flow.AttentionField(pa, causal=True), flow.AttentionField(_rotate_attention(pa, q),
                                                                  causal=True)),
        (flow.ExpertsField(pe, top_k=2), flow.ExpertsField(_rotate_experts(pe, q), top_k=2)),
    ]
    for field, rotated in cases:
        np.testing.assert_allclose(rotated(0.0, x @ q), field(0.0, x) @ q, atol=1e-13)


def test_field_is_expectation_of_autodiff_riemannian_scores():
    """v(x_i) = sum q(z|x_i) P_x grad_x log p(x|z), the score by autodiff of kappa mu^T x."""
    p = _attention()
    x = _state(7)
    q = flow.attention_posterior(p, x)  # (H, n, n)
    eta = flow.natural_parameters(p, x)  # (H, n, d)

    def log_lik(xi, e):  # log vMF(x; e/|e|, |e|) up to the normaliser, which has no x
        return jnp.dot(e, xi)

    grads = jax.vmap(jax.vmap(jax.vmap(jax.grad(log_lik), (None, 0)), (None, 0)), (0, None))(
        x, eta
    )  # (n_i, H, n_j, d)
    riem = sphere.project_tangent(x[:, None, None, :], grads)
    expected = jnp.einsum("hij,ihjd->id", q, riem)
    np.testing.assert_allclose(flow.AttentionField(p)(0.0, x), expected, atol=1e-14)


def test_posterior_is_normalised_and_causal():
    q = flow.attention_posterior(_attention(), _state(8), causal=True)
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-15)
    assert float(jnp.abs(jnp.triu(q, k=1)).max()) == 0.0


def test_router_top_k():
    logits = jnp.array([[0.3, -1.0, 2.0, 0.5]])
    q = flow.router_posterior(logits, top_k=2)
    top = np_softmax([2.0, 0.5])  # the two largest logits, renormalised
    np.testing.assert_allclose(q, [[0.0, 0.0, top[0], top[1]]], atol=1e-15)
    np.testing.assert_allclose(flow.router_posterior(logits, 4), np_softmax(logits, -1),
                               atol=1e-15)


# Rows with exact ties, at and across the k-th place (small binary fractions: exact in float).
TIED_LOGITS = np.array([
    [1.0, 2.0, 2.0, 0.0],    # tie for first place
    [3.0, 1.0, 3.0, 1.0],    # two ties
    [0.5, 0.5, 0.5, 0.5],    # all tied
    [-1.0, 0.25, 0.25, 0.25],
    [0.0, -2.0, 0.0, 4.0],
])


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_router_ties_go_to_the_lower_index(top_k):
    """Tied logits: exactly k experts, the k largest with ties to the lowest index (the rule of
    ``jax.lax.top_k`` and of the Transformer's MoE block), against a stable NumPy sort."""
    q = np.asarray(flow.router_posterior(jnp.asarray(TIED_LOGITS), top_k))
    expected = _np_router_posterior(TIED_LOGITS, top_k)
    np.testing.assert_allclose(q, expected, atol=1e-15)
    assert np.all(np.count_nonzero(q, axis=-1) == top_k)
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-15)
    # e.g. row [0.5] * 4, k = 2: experts 0 and 1 at 1/2 each (not all four at 1/4)
    np.testing.assert_array_equal(np.nonzero(q[2])[0], np.arange(top_k))


def _tied_router(p):
    """Router columns 2, 3 copy columns 0, 1: every token's logits tie in pairs, (a, b, a, b)."""
    w = p.router.weight
    return flow.ExpertsParams(experts=p.experts,
                              router=flow.RouterPosterior(jnp.concatenate([w[:, :2]] * 2, 1)))


@pytest.mark.parametrize("top_k", [1, 3])
def test_experts_field_with_tied_router_matches_numpy(top_k):
    p = _tied_router(_experts(num_experts=4))
    x = _state(14)
    radius = 1.7
    logits = np.asarray(radius * x @ p.router.weight)
    assert np.array_equal(logits[:, :2], logits[:, 2:])  # the ties are exact
    got = flow.ExpertsField(p, top_k=top_k, radius=radius)(0.0, x)
    np.testing.assert_allclose(got, _np_experts_field(p, x, top_k, radius), atol=1e-13)


@pytest.mark.parametrize("top_k", [1, 3])
def test_transformer_moe_and_flow_route_ties_alike(top_k):
    """The Transformer's MoE block and the flow's experts field (via ``correspondence.to_flow``)
    give the same output on tokens whose router logits tie exactly at the k-th place."""
    from flax import nnx

    from svflow_jax.bridge import correspondence
    from svflow_jax.transformer import Transformer, TransformerConfig, layer_params

    d = 8
    cfg = TransformerConfig(
        d_model=d, n_layers=1, n_heads=2, d_head=4, d_ff=16, norm="rms", norm_eps=0.0,
        norm_gain=False, use_bias=False, init_std=0.3, param_dtype=jnp.float64, ffn="moe",
        n_experts=4, top_k=top_k,
    )
    params = layer_params(Transformer(cfg, rngs=nnx.Rngs(0)))
    w = params["router"]  # (L, d, E): columns 2, 3 copy columns 0, 1
    params["router"] = jnp.concatenate([w[..., :2]] * 2, axis=-1)
    model = Transformer.from_layer_params(cfg, params)
    rho = np.sqrt(d)
    z = rho * _state(15, shape=(N,), d=d)  # branch inputs on RMSNorm's sphere
    logits = np.asarray(z @ params["router"][0])
    assert np.array_equal(logits[:, :2], logits[:, 2:])
    moe = model.layer(0).ffn
    flow_field = correspondence.to_flow(cfg, params).experts
    # The router weights agree with the flow's posterior (router sees rho u = z) ...
    np.testing.assert_array_equal(np.asarray(moe.router_weights(z)),
                                  np.asarray(flow.router_posterior(jnp.asarray(logits), top_k)))
    assert np.all(np.count_nonzero(np.asarray(moe.router_weights(z)), axis=-1) == top_k)
    # ... and so do the outputs: MoE(z) = rho * u_t(z / rho), the flow's unprojected drift.
    np.testing.assert_allclose(moe(z), rho * flow_field.drift(0.0, z / rho), atol=1e-13)


def test_sum_field_is_linear():
    a, e = flow.AttentionField(_attention()), flow.ExpertsField(_experts())
    x = _state(9)
    np.testing.assert_allclose(flow.SumField(a, e)(0.0, x), a(0.0, x) + e(0.0, x), atol=1e-15)


def test_ambient_extension_is_radially_constant():
    e = flow.ExpertsField(_experts())
    x = _state(10)
    np.testing.assert_allclose(e.ambient(0.0, 3.0 * x), e.drift(0.0, x), atol=1e-14)


# ---- time-dependent parameters ----

def _stacked(num):
    keys = jax.random.split(jax.random.PRNGKey(11), num)
    return flow.stack([flow.AttentionParams.random(k, D, H, K) for k in keys])


def test_piecewise_constant_picks_the_layer_at_its_grid_time():
    num, h = 7, 0.1  # 0.1 is not representable: l * h and sums of h land a few ulps off
    anchors = _stacked(num)
    path = flow.PiecewiseConstant(anchors, h)
    t = 0.0
    for layer in range(num):
        for time in (layer * h, t):  # product and accumulated sum
            np.testing.assert_array_equal(path(time).kernel_query, anchors.kernel_query[layer])
        np.testing.assert_array_equal(path(t + 0.5 * h).kernel_query, anchors.kernel_query[layer])
        t += h
    np.testing.assert_array_equal(path(10.0).kernel_query, anchors.kernel_query[-1])


def test_linear_interpolation():
    anchors = _stacked(3)
    path = flow.LinearInterpolation(anchors, 0.5)
    mid = 0.5 * (anchors.natural_out[1] + anchors.natural_out[2])
    np.testing.assert_allclose(path(0.75).natural_out, mid, atol=1e-15)
    np.testing.assert_allclose(path(0.5).natural_out, anchors.natural_out[1], atol=1e-15)


def test_chebyshev_reproduces_polynomials_and_is_smooth():
    num, t0, t1 = 6, 0.0, 2.0
    ts = flow.chebyshev_points(num, t0, t1)
    coeffs = np.random.default_rng(0).normal(size=(num, 3))
    poly = lambda t: sum(c * t**k for k, c in enumerate(coeffs))  # noqa: E731  degree 5
    path = flow.ChebyshevInterpolation(jnp.stack([poly(t) for t in ts]), t0, t1)
    for t in [0.0, 0.123, 1.0, 1.9, 2.0]:
        np.testing.assert_allclose(path(t), poly(t), atol=1e-12)
    dpoly = sum(k * c * 0.7 ** (k - 1) for k, c in enumerate(coeffs) if k)
    np.testing.assert_allclose(jax.jacobian(path)(0.7), dpoly, atol=1e-11)


def test_time_dependent_field_under_jit():
    path = flow.ChebyshevInterpolation(_stacked(4), 0.0, 1.0)
    field = flow.AttentionField(path)
    x = _state(12)
    v = jax.jit(lambda t, y: field(t, y))(0.4, x)
    np.testing.assert_allclose(v, flow.AttentionField(path(0.4))(0.0, x), atol=1e-14)


def test_float32_path():
    field = flow.SumField(flow.AttentionField(_attention()), flow.ExpertsField(_experts()))
    x64 = _state(13)
    v32 = field(0.0, x64.astype(jnp.float32))
    assert v32.dtype == jnp.float32
    # float32 relative round-off ~1e-7 times O(10) accumulated products
    np.testing.assert_allclose(v32, field(0.0, x64), rtol=0, atol=1e-5)


def test_bad_input():
    field = flow.AttentionField(_attention())
    with pytest.raises(ValueError, match="dimension d=5"):
        field(0.0, _state(shape=(N,), d=5))
    with pytest.raises(ValueError, match=r"\(\.\.\., n, d\)"):
        field(0.0, jnp.ones(D))
    bad = _attention()
    with pytest.raises(ValueError, match="natural_out"):
        flow.AttentionParams(bad.kernel_query, bad.kernel_key, bad.concentration,
                             bad.natural_in, bad.natural_out[:, :, :-1]).check()
    with pytest.raises(ValueError, match="router"):
        flow.ExpertsParams(experts=_experts().experts)
    with pytest.raises(ValueError, match="top_k"):
        flow.ExpertsField(_experts(), top_k=0)
    with pytest.raises(ValueError, match="positive"):
        flow.PiecewiseConstant(_stacked(2), -0.1)
