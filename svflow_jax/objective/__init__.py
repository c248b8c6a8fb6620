"""The hybrid objective (``J_align + J_var``), MoE balancing losses and the posterior/score
gradient coupling, read off a :class:`~svflow_jax.transformer.TransformerLM`
(``docs/theory.md``, section 20)."""

from .bridge import DELTA_NAMES, LayerTerms, check_supported, forward_terms, zero_deltas
from .mechanism import Coupling, cosine, gradient_coupling
from .terms import (
    attention_j_var,
    class_logits,
    expert_load,
    expert_log_likelihoods,
    j_align,
    j_var,
    moe_j_var,
    population_kl,
    switch_loss,
    top_k_mask,
    usage_stats,
)

__all__ = [
    "attention_j_var", "class_logits", "expert_load", "expert_log_likelihoods", "j_align",
    "j_var", "moe_j_var", "population_kl", "switch_loss", "top_k_mask", "usage_stats",
    "Coupling", "cosine", "gradient_coupling",
    "DELTA_NAMES", "LayerTerms", "check_supported", "forward_terms", "zero_deltas",
]
