"""Claims, their results, the registry and the shared context of a run.

A *claim* is a statement the project checks with numbers ("the post-norm Transformer is the
retracted Euler solve of its flow, to 1e-12"). It is a function ``measure(ctx) -> Evidence``
registered under a name with :func:`claim`; running it gives a :class:`ClaimResult`: the
statement, the figures, the tolerance that decides, ``passed`` and table rows for reports.
``svflow verify`` runs every registered claim; the tests run the same claims on small options
and assert on the same result objects; nothing measures twice.

The :class:`Context` holds the options of a run and what several claims share (the random
test problem, its reference solution), built once, lazily.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "Options",
    "QUICK",
    "Context",
    "Evidence",
    "ClaimResult",
    "Claim",
    "claim",
    "claim_family",
    "all_claims",
    "get",
    "select",
    "run_claims",
]


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _positive_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value > 0
    ):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Options:
    """The knobs of a run (the ``svflow verify`` options), validated on construction.

    Attributes:
        seed: non-negative seed of every random draw (NumPy ``default_rng``).
        dtype: ``"float64"`` or ``"float32"``: states and parameters of the measured solves
            (references are always float64).
        tokens: number of tokens ``n``.
        dim: width ``d`` (the sphere is S^{d-1}); ``>= 2``, even (two heads of width d/2).
        layers: depth of the Transformers of the exactness claims.
        t1: final time ``T`` of the flow (the stacks integrate ``[0, T]``).
        strength: scale of the random weights, the speed of the flow.
        repeats: timed repetitions per solve (the median is reported).
        step_scale: multiplies every sweep's step counts.
        depths: depths ``L`` of the Transformer stacks whose convergence is measured.
        num_sizes: step sizes per solver sweep (``None``: each solver's registered number).
    """

    seed: int = 0
    dtype: str = "float64"
    tokens: int = 8
    dim: int = 16
    layers: int = 8
    t1: float = 1.0
    strength: float = 1.0
    repeats: int = 3
    step_scale: float = 1.0
    depths: tuple[int, ...] = (8, 16, 32, 64, 128)
    num_sizes: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.dtype not in ("float64", "float32"):
            raise ValueError(f"dtype must be 'float64' or 'float32', got {self.dtype!r}")
        for name in ("tokens", "dim", "layers", "repeats"):
            _positive_int(name, getattr(self, name))
        if self.dim < 2 or self.dim % 2:
            raise ValueError(f"dim must be even and >= 2 (two heads of width dim/2), got "
                             f"{self.dim}")
        for name in ("t1", "strength", "step_scale"):
            _positive_float(name, getattr(self, name))
        if len(self.depths) < 3 or any(
            isinstance(L, bool) or not isinstance(L, int) or L < 1 for L in self.depths
        ) or list(self.depths) != sorted(set(self.depths)):
            raise ValueError(f"depths must be >= 3 increasing positive integers, got {self.depths}")
        if self.num_sizes is not None:
            _positive_int("num_sizes", self.num_sizes)
            if self.num_sizes < 3:
                raise ValueError(f"num_sizes must be >= 3 to fit an order, got {self.num_sizes}")

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp  # here: the options are checked before JAX is imported

        return jnp.dtype(self.dtype)

    @property
    def float64(self) -> bool:
        return self.dtype == "float64"


# `svflow verify --quick`: small sizes, fewer depths, one timing repeat.
QUICK = dict(tokens=4, dim=8, layers=4, repeats=1, depths=(16, 32, 64))


class Context:
    """Options plus the objects several claims share, each built once on first use.

    ``ctx.shared(key, build)`` returns ``build()`` the first time and the same object after;
    the cache lives and dies with the context (no module-level state).
    """

    def __init__(self, options: Options | None = None, **changes: Any):
        self.options = dataclasses.replace(options or Options(), **changes)
        self._shared: dict[Any, Any] = {}
        self._locks: dict[Any, threading.RLock] = {}
        self._guard = threading.Lock()

    def shared(self, key: Any, build: Callable[[], Any]) -> Any:
        # One lock per key: claims running in threads (run_claims(workers=...)) build each
        # shared object once, and wait for each other only on the same key.
        with self._guard:
            lock = self._locks.setdefault(key, threading.RLock())
        with lock:
            if key not in self._shared:
                self._shared[key] = build()
        return self._shared[key]


@dataclasses.dataclass
class Evidence:
    """What a measurement returns: the verdict, the figures behind it, the rows of its table.

    ``passed`` is ``None`` when the measurement cannot decide (e.g. an order hidden by float32
    round-off); ``tolerance`` states the criterion in words and numbers; ``headline`` names the
    one figure that decides (a key of ``figures``; ``"fitted_order"`` is shown with its
    ``order_ci``), the figure reports print beside the verdict.
    """

    passed: bool | None
    figures: dict[str, Any]
    tolerance: str
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    headline: str | None = None


@dataclasses.dataclass
class ClaimResult:
    """One claim, measured: what a report prints and a test asserts on."""

    name: str
    section: str
    statement: str
    passed: bool | None
    figures: dict[str, Any]
    tolerance: str
    rows: list[dict[str, Any]]
    seconds: float
    headline: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Claim:
    """A registered claim: ``run(ctx)`` measures it and times the measurement."""

    name: str
    section: str
    statement: str
    measure: Callable[[Context], Evidence]

    def run(self, ctx: Context) -> ClaimResult:
        start = time.perf_counter()
        evidence = self.measure(ctx)
        return ClaimResult(
            name=self.name, section=self.section, statement=self.statement,
            passed=evidence.passed, figures=evidence.figures, tolerance=evidence.tolerance,
            rows=evidence.rows, seconds=time.perf_counter() - start, headline=evidence.headline,
        )


# Registered claims and claim families, in registration order (= report order). A family is a
# function returning claims made at selection time (one order claim per registered solver).
_ENTRIES: list[Claim | Callable[[], list[Claim]]] = []


def claim(name: str, section: str, statement: str):
    """Decorator: register ``measure(ctx) -> Evidence`` as the claim ``name``."""

    def register(measure: Callable[[Context], Evidence]) -> Callable[[Context], Evidence]:
        if any(isinstance(e, Claim) and e.name == name for e in _ENTRIES):
            raise ValueError(f"a claim named {name!r} is already registered")
        _ENTRIES.append(Claim(name, section, statement, measure))
        return measure

    return register


def claim_family(factory: Callable[[], list[Claim]]) -> Callable[[], list[Claim]]:
    """Decorator: register a function whose claims are made when claims are selected."""
    _ENTRIES.append(factory)
    return factory


def all_claims() -> dict[str, Claim]:
    """Every registered claim, by name, in report order."""
    out: dict[str, Claim] = {}
    for entry in _ENTRIES:
        for c in ([entry] if isinstance(entry, Claim) else entry()):
            if c.name in out:
                raise ValueError(f"two claims are named {c.name!r}")
            out[c.name] = c
    return out


def get(name: str) -> Claim:
    """The registered claim ``name``."""
    claims = all_claims()
    if name not in claims:
        raise ValueError(f"no claim named {name!r}; claims: {list(claims)}")
    return claims[name]


def select(patterns: Iterable[str] | None = None, extra: Iterable[Claim] = ()) -> list[Claim]:
    """The registered claims, and ``extra``, whose name starts with one of ``patterns`` (all
    when ``None``).

    Args:
        patterns: name prefixes, e.g. ``["exactness/", "order/rk4"]``.
        extra: claims not in the registry, after the registered ones (``svflow verify
            --methods``: the order claims of a user's methods).

    Returns:
        The matching claims, in registry order, then ``extra``'s.

    Raises:
        ValueError: a pattern matches no claim, or two claims have one name.
    """
    claims = list(all_claims().values())
    for c in extra:
        if any(c.name == other.name for other in claims):
            raise ValueError(f"two claims are named {c.name!r}")
        claims.append(c)
    if patterns is None:
        return claims
    patterns = list(patterns)
    unknown = [p for p in patterns if not any(c.name.startswith(p) for c in claims)]
    if unknown:
        raise ValueError(f"no claim matches {unknown}; claims: {[c.name for c in claims]}")
    return [c for c in claims if any(c.name.startswith(p) for p in patterns)]


def run_claims(
    ctx: Context, claims: Iterable[Claim] | None = None,
    progress: Callable[[str], None] | None = None, workers: int = 1,
) -> list[ClaimResult]:
    """Runs ``claims`` (default: every registered claim) on one context; results in the claims'
    order.

    ``workers > 1`` runs that many claims at once in threads: XLA compiles and runs programs
    without holding Python's lock, so on a run that is mostly compilation (``svflow verify
    --quick``) one claim's tracing overlaps another's compilation. Each claim's ``seconds`` (and
    any timing it reports) is then measured on a shared machine. ``progress`` is called with a
    claim's name when it finishes.
    """
    claims = select() if claims is None else list(claims)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1:
        results = []
        for c in claims:
            results.append(c.run(ctx))
            if progress:
                progress(c.name)
        return results
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(c.run, ctx): c for c in claims}
        try:
            for done in concurrent.futures.as_completed(futures):
                done.result()  # a claim that raised raises here
                if progress:
                    progress(futures[done].name)
        except BaseException:  # Ctrl-C or a failure: the claims not started yet never start
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return [f.result() for f in futures]
