"""Training small language models with the hybrid objective and MoE balancing losses.

A run trains a causal, pre-norm :class:`~svflow_jax.transformer.TransformerLM` (byte-level, on
the Austen split of :class:`svflow_jax.training.tasks.AustenBytes`) on

    loss = J_align + coef * R,    R = 0 (method "none"),
                                  mean_t Switch_t ("switch"),
                                  mean_t KL(qbar_t || uniform) ("popkl"),
                                  J_var = mean over layers t and posterior-bearing branches of
                                  mean_{tokens, heads} KL(q || p) ("jvar"),

with the optimiser of :func:`svflow_jax.training.make_optimizer` (global-norm clipping, AdamW,
warm-up then cosine decay), in the project's training loop :func:`svflow_jax.training.fit`.
Batches and initial weights are functions of the seed. Every
``eval_every`` steps the validation text is read: loss (nats per byte, and bits per character),
ECE of the top-1 prediction (:func:`svflow_jax.diagnose.stats.expected_calibration_error`, 15
equal-mass bins), the per-layer collapse measures (:func:`usage_stats` of the expert load over
all validation tokens), router and attention entropies, J_var of each branch, and the gradient
coupling (:func:`gradient_coupling`) on the first validation batch.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..diagnose.stats import expected_calibration_error
from ..next_token import token_scores
from ..training import StepInfo, TrainConfig, fit, make_optimizer
from ..training.tasks import AustenBytes
from ..transformer import TransformerConfig, TransformerLM
from .bridge import LayerTerms, forward_terms
from .mechanism import gradient_coupling
from .terms import j_align, usage_stats

__all__ = ["RunConfig", "RunResult", "METHODS", "model_config", "regulariser", "HybridLoss",
           "train_run"]

METHODS = ("none", "switch", "popkl", "jvar")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One training run. ``ffn="moe"`` (``n_experts``, ``top_k``) or ``"gelu"`` (dense);
    ``qk_stop_gradient``: the attention control of :class:`TransformerConfig` (queries and keys
    read the token states through a stop-gradient)."""

    ffn: str = "moe"
    n_experts: int = 8
    top_k: int = 1
    gate: str = "renormalised"
    method: str = "none"
    coef: float = 0.01
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 64
    context: int = 64
    batch_size: int = 16
    steps: int = 300
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    qk_stop_gradient: bool = False
    eval_every: int = 50
    eval_sequences: int = 64

    def __post_init__(self):
        if self.ffn not in ("moe", "gelu"):
            raise ValueError(f"ffn must be 'moe' or 'gelu', got {self.ffn!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.ffn == "gelu" and self.method in ("switch", "popkl"):
            raise ValueError(f"method {self.method!r} needs a MoE model")
        if self.ffn == "moe" and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in [1, n_experts], got {self.top_k}")
        if self.gate not in ("renormalised", "switch"):
            raise ValueError(f"gate must be 'renormalised' or 'switch', got {self.gate!r}")
        for name in ("steps", "batch_size", "eval_every", "eval_sequences", "context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def name(self) -> str:
        arch = f"moe{self.n_experts}-top{self.top_k}" if self.ffn == "moe" else "dense"
        arch += "-qksg" if self.qk_stop_gradient else ""
        return f"{arch}/{self.method}-{self.coef:g}/seed{self.seed}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class RunResult:
    """What :func:`train_run` returns: the evaluation rows (one per evaluated step, with
    per-layer lists), the final row and the wall-clock seconds."""

    config: RunConfig
    history: list[dict[str, Any]]
    final: dict[str, Any]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config.to_json(), "history": self.history, "final": self.final,
                "seconds": self.seconds}


def model_config(run: RunConfig) -> TransformerConfig:
    """The causal pre-norm byte-level LM of a run (learned positions, GELU experts)."""
    moe = (dict(n_experts=run.n_experts, top_k=run.top_k, router_gate=run.gate)
           if run.ffn == "moe" else {})
    return TransformerConfig(
        d_model=run.d_model, n_layers=run.n_layers, n_heads=run.n_heads,
        d_head=run.d_model // run.n_heads, d_ff=run.d_ff, norm_position="pre", causal=True,
        ffn=run.ffn, vocab_size=256, n_positions=run.context,
        qk_stop_gradient=run.qk_stop_gradient, **moe)


def regulariser(method: str, t: LayerTerms) -> jax.Array:
    """``R`` of the module docstring from one batch's :class:`LayerTerms`."""
    if method == "none":
        return jnp.zeros(())
    if method == "switch":
        return jnp.mean(t.switch)
    if method == "popkl":
        return jnp.mean(t.population_kl)
    parts = [t.attn_j_var] + ([t.moe_j_var] if t.moe_j_var is not None else [])
    return jnp.mean(jnp.concatenate(parts))


@dataclasses.dataclass(frozen=True)
class HybridLoss:
    """The training loss ``J_align + coef * R`` (module docstring); ``aux = (J_align, R)``.
    Frozen, hence hashable: runs with equal settings share one compiled step."""

    method: str
    coef: float

    def __call__(self, model: TransformerLM, inputs, targets, weights=None):
        logits, t = forward_terms(model, inputs)
        ce = j_align(logits.astype(jnp.float32), targets)
        reg = regulariser(self.method, t)
        return ce + self.coef * reg, (ce, reg)


@functools.partial(jax.jit, static_argnums=0)
def _eval_batch(graphdef, params, inputs, targets):
    logits, t = forward_terms(nnx.merge(graphdef, params), inputs)
    nll, conf, correct = token_scores(logits, targets)
    return nll, conf, correct, t


def evaluate_run(model: TransformerLM, task: AustenBytes, run: RunConfig) -> dict[str, Any]:
    """The evaluation row of a model (module docstring); per-layer measures are lists."""
    graphdef, params = nnx.split(model)
    nll, conf, corr, terms = [], [], [], []
    batches = task.eval_batches(run.eval_sequences, run.batch_size)
    for inputs, targets, _ in batches:
        a, b, c, t = _eval_batch(graphdef, params, jnp.asarray(inputs), jnp.asarray(targets))
        nll.append(np.asarray(a)), conf.append(np.asarray(b)), corr.append(np.asarray(c))
        terms.append(jax.tree.map(np.asarray, t))
    nll, conf, corr = (np.concatenate([x.ravel() for x in v]) for v in (nll, conf, corr))
    weights = np.array([len(b[0]) for b in batches], float)
    weights /= weights.sum()

    def avg(field):
        vals = [getattr(t, field) for t in terms]
        return None if vals[0] is None else np.tensordot(weights, np.stack(vals), axes=1)

    loss = float(nll.mean())
    row: dict[str, Any] = {
        "val_loss": loss, "val_bpc": loss / np.log(2),
        "ece": float(expected_calibration_error(conf, corr, bins=15)),
        "attn_j_var": avg("attn_j_var").tolist(), "attn_entropy": avg("attn_entropy").tolist(),
        "attn_log_evidence": avg("attn_log_evidence").tolist(),
    }
    n = run.context
    row["attn_entropy_uniform"] = float(np.mean(np.log(np.arange(1, n + 1))))
    if run.ffn == "moe":
        load = avg("load")  # (L, E): the batches have equal sizes except the last
        stats = [{k: float(v) for k, v in usage_stats(jnp.asarray(f)).items()} for f in load]
        row.update({
            "load": load.tolist(),
            "usage_entropy": [s["usage_entropy"] for s in stats],
            "max_load": [s["max_load"] for s in stats],
            "dead": [s["dead"] for s in stats],
            "router_entropy": avg("router_entropy").tolist(),
            "moe_j_var": avg("moe_j_var").tolist(),
            "population_kl": avg("population_kl").tolist(),
            "switch": avg("switch").tolist(),
        })
    inputs, targets, _ = batches[0]
    c = gradient_coupling(model, inputs, targets)
    row.update({f"coupling_{k}": v for k, v in c.to_json().items()})
    return row


def train_run(run: RunConfig, *, progress=None) -> RunResult:
    """Trains one run and evaluates it at step 0, every ``eval_every`` steps and at the end;
    ``train_loss``/``train_reg`` are the means over the steps since the previous evaluation.
    ``progress``: a callable ``progress(n_steps_done)`` (e.g. a tqdm ``update``)."""
    start = time.perf_counter()
    task = AustenBytes(context=run.context)
    model = TransformerLM(model_config(run), rngs=nnx.Rngs(run.seed))
    tx = make_optimizer(TrainConfig(steps=run.steps, lr=run.lr, warmup=run.warmup,
                                    weight_decay=run.weight_decay, clip=run.clip))
    history = [{"step": 0, "train_loss": 0.0, "train_reg": 0.0,
                **evaluate_run(model, task, run)}]
    acc = {"ce": 0.0, "reg": 0.0, "count": 0}

    def log(info: StepInfo) -> dict[str, Any] | None:
        ce, reg = info.aux
        acc["ce"] += float(ce)
        acc["reg"] += float(reg)
        acc["count"] += 1
        if progress is not None:
            progress(1)
        if info.done % run.eval_every and info.done != run.steps:
            return None
        row = {"train_loss": acc["ce"] / acc["count"], "train_reg": acc["reg"] / acc["count"]}
        acc.update(ce=0.0, reg=0.0, count=0)
        return {**row, **evaluate_run(info.model(), task, run)}

    result = fit(model, HybridLoss(run.method, run.coef), tx,
                 lambda step: task.batch(run.seed, step, run.batch_size), run.steps, log=log)
    history += result.history
    return RunResult(run, history, history[-1], time.perf_counter() - start)
