"""A population of small language models for the diagnostics: checkpoints of ONE training run.

Trains a small byte-level ``TransformerLM`` (pre-norm, RMSNorm, RoPE, SwiGLU, causal; 4 layers,
d = 128, 4 heads; ~0.7 M parameters) with AdamW on a public-domain text, keeps copies at
several steps (models of increasing quality), then runs the prefix-shuffling study of
``svflow diagnose`` (:func:`svflow_jax.diagnose.study.run_shuffle_study`) on each, on the same
windows of the opening of *Emma* (``tests/data/emma_opening.txt``, bytes), and measures
Spearman's rho ACROSS the models (:func:`svflow_jax.diagnose.study.across_models`): does a
metric rank the models by quality (clean perplexity) and by sensitivity to shuffling?

Run by hand (a few minutes on 2 cores)::

    python experiments/diagnose_population.py --train-text PATH [--out results/population]

We trained on Jane Austen's *Persuasion* (public domain; the plain-text edition of the Debian
package r-cran-janeaustenr 1.0.0, from Project Gutenberg), which does not contain the
evaluation text. A tiny byte-level model is not a pretrained LLM: this is the population
reading of the paper's correlation, not its models.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from svflow_jax.cli_types import nonnegative_int, positive_float, positive_int  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-text", required=True, help="UTF-8 training text")
    p.add_argument("--out", default="results/population")
    p.add_argument("--steps", type=positive_int, nargs="+", default=[25, 50, 100, 200, 400, 800],
                   help="training steps at which a checkpoint joins the population")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--batch", type=positive_int, default=16, help="sequences per step")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="peak learning rate")
    p.add_argument("--windows", type=positive_int, default=32, help="evaluation windows")
    args = p.parse_args(argv)
    if not Path(args.train_text).is_file():
        p.error(f"--train-text {args.train_text}: no such file")
    return args


if __name__ == "__main__":
    parse_args()  # a bad option exits here, before JAX is imported (0.2 s instead of 2.7 s)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from svflow_jax.atomic import write_json  # noqa: E402
from svflow_jax.checkpoints import LoadedModel  # noqa: E402
from svflow_jax.diagnose import study  # noqa: E402
from svflow_jax.environment import environment  # noqa: E402
from svflow_jax.training import fit, lm_loss, optimizer  # noqa: E402
from svflow_jax.transformer import RoPE, TransformerConfig, TransformerLM  # noqa: E402


def byte_ids(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)


def tiny_config() -> TransformerConfig:
    return TransformerConfig(
        d_model=128, n_layers=4, n_heads=4, d_head=32, d_ff=256, norm_position="pre",
        causal=True, ffn="swiglu", rope=RoPE(theta=10000.0), vocab_size=256,
        tie_embeddings=True, norm_eps=1e-5, param_dtype=jnp.float32, init_std=0.02)


def train(ids: np.ndarray, steps: list[int], seed: int, batch: int, context: int, lr: float):
    """AdamW without clipping (warm-up min(50, last // 4) steps, cosine decay to lr / 10 at the
    last step) in the project's training loop, on windows at random offsets (a function of
    ``(seed, step)``); a copy of the model at each step of ``steps``. Returns
    ``(config, [(step, model, last loss)])``."""
    config = tiny_config()
    last = max(steps)
    tx = optimizer(lr, min(50, last // 4), last, final_lr_fraction=0.1, weight_decay=0.01,
                   clip=None)

    def data(step: int):
        starts = np.random.default_rng([seed, step]).integers(0, len(ids) - context - 1, batch)
        tokens = np.stack([ids[s: s + context + 1] for s in starts])
        return tokens[:, :-1], tokens[:, 1:], np.ones((batch, context), np.float32)

    out = []

    def keep(info):
        if info.done in steps:
            loss = float(info.loss)
            out.append((info.done, info.model(), loss))
            print(f"step {info.done}: training loss {loss:.3f} nats/byte", flush=True)

    fit(TransformerLM(config, rngs=nnx.Rngs(seed)), lm_loss, tx, data, last, log=keep)
    return config, out


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    cfg = study.StudyConfig(model="byte-lm", context=128, scored=32, windows=args.windows,
                            permutations=3, seed=args.seed, scaling_factors=())
    train_ids = byte_ids(Path(args.train_text).read_text(encoding="utf-8"))
    eval_ids = byte_ids(study.default_text().read_text(encoding="utf-8"))
    config, checkpoints = train(train_ids, sorted(args.steps), args.seed, args.batch,
                                cfg.context, args.lr)
    train_s = time.perf_counter() - t0
    datas, per_model = [], []
    for k, model, loss in checkpoints:
        data = study.run_shuffle_study(LoadedModel(model, config, None), eval_ids, cfg)
        datas.append(data)
        a = study.analyse_shuffle(data, cfg)
        per_model.append({"step": k, "training_loss": loss,
                          "perplexity": a["task"]["perplexity"], "ece": a["task"]["ece"],
                          "depth": {n: e["deep_over_shallow"] for n, e in a["depth"].items()},
                          "rho_levels": {n: e["perplexity"]["rho"] for n, e in a["rho"].items()}})
        print(f"step {k}: perplexity per level {np.round(a['task']['perplexity'], 2)}",
              flush=True)
    across = study.across_models(datas, cfg)
    summary = {"config": cfg.to_dict(), "train": vars(args), "model": "byte-level tiny LM, "
               "4 layers, d=128", "models": per_model, "across_models": across,
               "timings": {"train_s": train_s, "total_s": time.perf_counter() - t0},
               "environment": environment()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "population.json", summary, indent=1)
    print(f"\n{'metric':<16} {'rho(clean value, clean ppl)':<34} rho(change, log-ppl change)")
    for name, e in across["rho"].items():
        q, s = e["quality"], e["sensitivity"]
        print(f"{name:<16} {q['rho']:+.2f} [{q['ci'][0]:+.2f}, {q['ci'][1]:+.2f}]"
              f"{'':<16} {s['rho']:+.2f} [{s['ci'][0]:+.2f}, {s['ci'][1]:+.2f}]")
    print(f"\nclean perplexity per model: {np.round(across['perplexity_clean'], 2)}")
    print(f"log-perplexity change (clean -> shuffled): "
          f"{np.round(across['log_perplexity_change'], 3)}")
    print(f"{summary['timings']['total_s']:.0f} s; {out / 'population.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
