"""Writes ``tests/golden/peer/``: PyTorch's and torchdiffeq's outputs of the peer benchmark's
agreement cases, so that the agreement test runs in CI without torch.

``experiments/peer_benchmark.py`` computes every case (forward solves with Euler, RK4 and
Dopri5, their gradients by five adjoints, a Transformer forward and one training step) in the
project and in an independent PyTorch implementation, and refuses to time a case whose outputs
disagree beyond :data:`peer_benchmark.TOLERANCES`. This script stores the torch side of that
comparison at the ``--quick`` size (``n = 8, d = 16``, 8 steps, 2 layers, Dopri5 tolerance
1e-6), in float64 and float32, with the inputs both sides read; ``tests/test_peer_benchmark.py``
computes the project's side and compares, with the same tolerances.

Run it from the project's environment (it draws the inputs: the Transformer's weights come from
``experiments/benchmark.py``) and point ``--torch-python`` at an interpreter that has torch and
torchdiffeq (the torch worker needs only those and NumPy)::

    python3 -m venv /tmp/venv-torch
    /tmp/venv-torch/bin/pip install torch==2.13.0 torchdiffeq numpy
    python experiments/make_peer_golden.py --torch-python /tmp/venv-torch/bin/python

Files: ``inputs.npz`` (float64 weights and data, :func:`peer_benchmark.make_inputs`),
``torch_float64.npz`` and ``torch_float32.npz`` (``case/output`` arrays, stored as float64 as
the worker returns them) and ``provenance.json`` (sizes, versions of torch, torchdiffeq, NumPy).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import peer_benchmark  # noqa: E402

OUT = HERE.parent / "tests" / "golden" / "peer"
SIZE = dict(n=8, d=16)
SETTINGS = dict(steps=peer_benchmark.MODES["quick"]["steps"],
                layers=peer_benchmark.MODES["quick"]["layers"],
                tol=peer_benchmark.MODES["quick"]["tol"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-python", default=sys.executable,
                        help="a Python with torch and torchdiffeq (default: this one)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    inputs_path = args.out / "inputs.npz"
    np.savez_compressed(inputs_path, **peer_benchmark.make_inputs(
        SIZE["n"], SIZE["d"], SETTINGS["layers"]))
    worker = peer_benchmark.Worker("torch", python=args.torch_python)
    try:
        for dtype in peer_benchmark.DTYPES:
            worker(op="setup", key=dtype, inputs=str(inputs_path), dtype=dtype, **SETTINGS)
            path = args.out / f"torch_{dtype}.npz"
            worker(op="outputs", key=dtype, path=str(path), cases=list(peer_benchmark.CASES))
            with np.load(path) as stored:  # the worker wrote it uncompressed
                arrays = dict(stored)
            np.savez_compressed(path, **arrays)
    finally:
        worker.close()
    versions = subprocess.run(
        [args.torch_python, "-c", "import json, numpy, torch, torchdiffeq; print(json.dumps("
         "{'torch': torch.__version__, 'torchdiffeq': torchdiffeq.__version__, "
         "'numpy': numpy.__version__}))"], capture_output=True, text=True, check=True).stdout
    provenance = {"size": SIZE, **SETTINGS, "dtypes": list(peer_benchmark.DTYPES),
                  "cases": list(peer_benchmark.CASES), "versions": json.loads(versions),
                  "written_by": "experiments/make_peer_golden.py"}
    (args.out / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
    print(f"wrote {args.out}: {sorted(p.name for p in args.out.iterdir())}")


if __name__ == "__main__":
    main()
