"""A population of independently trained language models for the diagnostics: does a metric
track perplexity ACROSS MODELS?

Trains small byte-level ``TransformerLM``s (pre-norm, RMSNorm, RoPE, SwiGLU, causal, tied
embeddings), each from its own initialisation and its own stream of batches (both functions of
the seed), with the project's training loop (:func:`svflow_jax.training.fit`, AdamW from
:func:`svflow_jax.training.optimizer`, :func:`svflow_jax.training.lm_loss`): every size of
``--sizes`` (width d, depth L; default three, 32/1, 64/2, 96/3) with every seed of ``--seeds``
(default 0, 1, 2), for ``--steps`` steps each, so the models differ in quality mainly by size.

Training and evaluation text are disjoint. The training text is the first ``1 - held_out``
(default 80%) of each of the five novels of ``svflow_jax/data/austen/train.txt`` (cut at a line
end); the documents evaluated are the remaining 20% of each of those five and *Persuasion*
(``valid.txt``, never trained on): six held-out documents, ``--windows / 6`` passages of
128 bytes from each (:func:`svflow_jax.diagnose.study.document_windows`).

Every model goes through the prefix-shuffling study
(:func:`svflow_jax.diagnose.study.run_shuffle_study`) at the clean level and ONE shuffle level
(``--level``, default 1.0: the whole 96-byte prefix permuted, 3 permutations per passage), on
the same passages; then :func:`svflow_jax.diagnose.study.across_models` gives, per metric,
Spearman's rho across the models of the metric at that level against the perplexity there
(the tested claim), of the clean values and of the changes, with a cluster bootstrap over the
six documents for the intervals (enough resamples for 40 beyond each end of the Bonferroni
interval, at least ``--bootstrap``), a one-sided permutation p-value over the models in the
expected direction (:data:`svflow_jax.diagnose.study.EXPECTED_SIGN`), the same within sizes
(the control: the exact test over the permutations of the models of each size, since a text
statistic is the same for every model and the size is what else separates them), and a
verdict with Bonferroni over the ``m`` metrics tested that needs both. Each model's
validation perplexity (every position of 16 windows of 128 bytes per held-out document) is
reported beside it.

Run by hand (about 10 minutes with the defaults: 9 min 47 s on a loaded 2-core CPU, most of it
training the three d = 96 models)::

    python experiments/diagnose_population.py [--out results/population]

writes ``population.json`` to ``--out``. Tiny byte-level models are not pretrained LLMs: this
is the population reading of the paper's correlation, not its models.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from svflow_jax.cli.types import nonnegative_int, positive_float, positive_int  # noqa: E402

#: size name -> (d_model, layers, heads); d_head 16, d_ff 2 d
SIZES = {"d32-L1": (32, 1, 2), "d64-L2": (64, 2, 4), "d96-L3": (96, 3, 6)}
DOCUMENTS = 6  # the five novels' held-out ends and Persuasion


def _level(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return v


def _held_out(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0.05 <= v <= 0.5:
        raise argparse.ArgumentTypeError(f"must be a number in [0.05, 0.5], got {text!r}")
    return v


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/population")
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=list(SIZES),
                   help="model sizes (d, layers)")
    p.add_argument("--seeds", type=nonnegative_int, nargs="+", default=[0, 1, 2],
                   help="one model per size and seed")
    p.add_argument("--steps", type=positive_int, default=600, help="training steps per model")
    p.add_argument("--batch", type=positive_int, default=16, help="sequences per step")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="peak learning rate")
    p.add_argument("--level", type=_level, default=1.0,
                   help="the one shuffle level compared with the clean passages")
    p.add_argument("--windows", type=positive_int, default=36,
                   help=f"evaluation passages (a multiple of the {DOCUMENTS} documents)")
    p.add_argument("--held-out", type=_held_out, default=0.2,
                   help="fraction of each training novel held out (its end) for evaluation")
    p.add_argument("--bootstrap", type=positive_int, default=1000)
    args = p.parse_args(argv)
    if args.windows % DOCUMENTS:
        p.error(f"argument --windows: must be a multiple of {DOCUMENTS}, got {args.windows}")
    if len(args.sizes) * len(set(args.seeds)) < 3:
        p.error("the population needs at least 3 models (sizes x seeds)")
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
from svflow_jax.data import austen_novels  # noqa: E402
from svflow_jax.diagnose import study  # noqa: E402
from svflow_jax.environment import environment  # noqa: E402
from svflow_jax.training import fit, lm_loss, optimizer  # noqa: E402
from svflow_jax.training.compare import count_parameters  # noqa: E402
from svflow_jax.transformer import RoPE, TransformerConfig, TransformerLM  # noqa: E402

CONTEXT = 128


def byte_ids(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)


def split_novels(held_out: float) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(training bytes, {document: held-out bytes})``: the first ``1 - held_out`` of each of
    the five training novels (cut at the line end before that point), joined by blank lines,
    and the rest of each, with *Persuasion* whole (never in the training text)."""
    train, held = [], {}
    for name, text in austen_novels().items():
        if name == "persuasion":
            held[name] = byte_ids(text)
            continue
        cut = text.rindex("\n", 0, int(len(text) * (1 - held_out))) + 1
        train.append(text[:cut])
        held[name] = byte_ids(text[cut:])
    return byte_ids("\n\n\n".join(train)), held


def model_config(size: str) -> TransformerConfig:
    d, layers, heads = SIZES[size]
    return TransformerConfig(
        d_model=d, n_layers=layers, n_heads=heads, d_head=d // heads, d_ff=2 * d,
        norm_position="pre", causal=True, ffn="swiglu", rope=RoPE(theta=10000.0),
        vocab_size=256, tie_embeddings=True, norm_eps=1e-5, param_dtype=jnp.float32,
        init_std=0.02)


def train(ids: np.ndarray, config: TransformerConfig, seed: int, steps: int, batch: int,
          lr: float) -> tuple[TransformerLM, float]:
    """AdamW without clipping (warm-up min(50, steps // 4) steps, cosine decay to lr / 10),
    initialised by ``seed``, on windows at random offsets (a function of ``(seed, step)``).
    Returns the model and its last training loss (nats/byte)."""
    tx = optimizer(lr, min(50, steps // 4), steps, final_lr_fraction=0.1, weight_decay=0.01,
                   clip=None)

    def data(step: int):
        starts = np.random.default_rng([seed, step]).integers(0, len(ids) - CONTEXT - 1, batch)
        tokens = np.stack([ids[s: s + CONTEXT + 1] for s in starts])
        return tokens[:, :-1], tokens[:, 1:], np.ones((batch, CONTEXT), np.float32)

    last = []

    def keep(info):
        if info.done == steps:
            last.append(float(info.loss))

    model = fit(TransformerLM(config, rngs=nnx.Rngs(seed)), lm_loss, tx, data, steps,
                log=keep).model
    assert isinstance(model, TransformerLM)
    return model, last[-1]


def validation_perplexity(model: TransformerLM, held: dict[str, np.ndarray],
                          per_document: int = 16) -> float:
    """exp(mean NLL) over every position of ``per_document`` windows of ``CONTEXT`` bytes
    evenly spaced through each held-out document (equal weight per window)."""
    losses = []
    for doc in held.values():
        starts = np.linspace(0, len(doc) - CONTEXT - 1, per_document).astype(int)
        w = np.stack([doc[s: s + CONTEXT + 1] for s in starts])
        loss, _ = lm_loss(model, w[:, :-1], w[:, 1:], np.ones((len(w), CONTEXT), np.float32))
        losses.append(float(loss))
    return float(np.exp(np.mean(losses)))


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    cfg = study.StudyConfig(model="byte-lm", corpus="austen", context=CONTEXT, scored=32,
                            windows=args.windows, levels=(0.0, args.level), permutations=3,
                            seed=0, bootstrap=args.bootstrap, scaling_factors=())
    train_ids, held = split_novels(args.held_out)
    datas, models = [], []
    for size in args.sizes:
        config = model_config(size)
        for seed in dict.fromkeys(args.seeds):
            t1 = time.perf_counter()
            model, loss = train(train_ids, config, seed, args.steps, args.batch, args.lr)
            t2 = time.perf_counter()
            data = study.run_shuffle_study(LoadedModel(model, config, None), held, cfg)
            datas.append(data)
            n_params = count_parameters(model)
            row = {"size": size, "d_model": config.d_model, "layers": config.n_layers,
                   "heads": config.n_heads, "parameters": n_params, "seed": seed,
                   "steps": args.steps, "training_loss": loss,
                   "validation_perplexity": validation_perplexity(model, held),
                   "train_s": t2 - t1, "study_s": time.perf_counter() - t2}
            models.append(row)
            print(f"{size} seed {seed}: {n_params} parameters, training loss {loss:.3f}, "
                  f"validation perplexity {row['validation_perplexity']:.2f} "
                  f"({row['train_s']:.0f} s + {row['study_s']:.0f} s)", flush=True)
    sizes = [row["size"] for row in models]
    # the control across models: the size (a text statistic is the same for every model)
    strata = sizes if len(set(sizes)) < len(sizes) else None
    across = study.across_models(datas, cfg, args.level, strata=strata)
    for row, p0, p1 in zip(models, across["perplexity_clean"], across["perplexity_level"],
                           strict=True):
        row["study_perplexity_clean"], row["study_perplexity_level"] = p0, p1
    summary = {"config": cfg.to_dict(), "train": vars(args), "models": models,
               "data": {"training_bytes": int(len(train_ids)),
                        "held_out_bytes": {k: int(len(v)) for k, v in held.items()}},
               "across_models": across,
               "timings": {"total_s": time.perf_counter() - t0}, "environment": environment()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "population.json", summary, indent=1)
    print(f"\n{len(models)} models; level {args.level}; m = {across['tested']}; bootstrap over "
          f"{across['bootstrap_unit']}; {across['permutations']} permutations")
    print(f"{'metric':<18} {'rho at level [95%] [Bonferroni]':<44} {'p':>7}  "
          f"{'within sizes: rho, p':<22} {'verdict':<16} {'rho clean':<22} rho change")
    for name, e in across["rho"].items():
        lv, cl, ch = e["level"], e["clean"], e["change"]
        w = lv.get("within")
        within = f"{w['rho']:+.2f}, {w['p']:.4f}" if w else "n/a"
        print(f"{name:<18} {lv['rho']:+.2f} [{lv['ci'][0]:+.2f}, {lv['ci'][1]:+.2f}] "
              f"[{lv['ci_bonferroni'][0]:+.2f}, {lv['ci_bonferroni'][1]:+.2f}]{'':<14} "
              f"{lv['p']:7.4f}  {within:<22} {str(e['verdict']):<16} {cl['rho']:+.2f} "
              f"[{cl['ci'][0]:+.2f}, {cl['ci'][1]:+.2f}]  {ch['rho']:+.2f} "
              f"[{ch['ci'][0]:+.2f}, {ch['ci'][1]:+.2f}]")
    print(f"{summary['timings']['total_s']:.0f} s; {out / 'population.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
