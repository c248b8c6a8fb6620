#!/usr/bin/env bash
# What a user with a GPU runs first: does svflow-jax run right on this GPU, and how fast is it?
#
#   bash experiments/gpu_check.sh [--dry-run] [OUT]     # OUT default: results/gpu-check-<UTC>
#
# Run from the repository root, in an environment with the project's dependencies and a CUDA
# build of jaxlib (torch and torchdiffeq too for step 4: pip install -e '.[peer]').
#
# Steps (each one's output in OUT/<step>.log, its exit status in OUT/status.tsv):
#   1. gpu           nvidia-smi, and JAX's default backend must be the GPU (else the checks
#                    below would silently run on the CPU: stop).
#   2. verify-quick  svflow verify --quick: every claim passes on the GPU. The quick run's CPU
#                    compiler flags are not set on a GPU (a GPU jaxlib exits on them).
#   3. verify        svflow verify: every claim passes; exactness/float32 is measured in the
#                    unit round-off of the matrix-multiply precision in force (TF32 under the
#                    GPU's default precision). summary.json records the backend, that precision
#                    and the XLA compilation count of each run.
#   4. peer-large    experiments/peer_benchmark.py --device cuda at the large size (batch 8,
#                    n = d = 1024, 16 heads), float32, TF32 off on both sides: forward RK4 and
#                    Dopri5, the RK4 gradient with its peak GPU memory, torch.compile's field.
#                    Skipped (not failed) without torch and torchdiffeq.
#   5. train         one short svflow train run (100 optimiser steps on the Austen text).
# OUT/summary.txt collects the figures: passes, claims, compilations and wall times of both
# verify runs, the precision in force, the peer table, the training's final loss.
#
# Exit status: 0 when every step passed (or was skipped), 1 when one failed (the later steps
# still run), 2 on bad arguments.
#
# Not run yet on a GPU: written and checked on a CPU only (its dry run is tested).

set -u

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
    dry_run=1
    shift
fi
if [[ $# -gt 1 || "${1:-}" == -* ]]; then
    echo "usage: bash experiments/gpu_check.sh [--dry-run] [OUT]" >&2
    exit 2
fi
out="${1:-results/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}"
python="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset JAX_PLATFORMS  # let JAX pick the GPU (step 1 checks that it did)

steps=(gpu verify-quick verify peer-large train)
declare -A commands=(
    [gpu]="nvidia-smi && $python -c \"import jax; print(jax.devices()); assert jax.default_backend() == 'gpu', jax.default_backend()\""
    [verify-quick]="$python -m svflow_jax verify --quick --no-progress --out $out/verify-quick"
    [verify]="$python -m svflow_jax verify --no-progress --out $out/verify"
    [peer-large]="$python experiments/peer_benchmark.py --device cuda --sizes 8x1024x1024:16 --dtypes float32 --rounds 3 --cases fwd_rk4,fwd_dopri5,grad_rk4,fwd_rk4_compiled --out $out/peer-large"
    [train]="$python -m svflow_jax train --steps 100 --eval-every 50 --no-progress --out $out/train"
)

if [[ $dry_run == 1 ]]; then
    for step in "${steps[@]}"; do
        echo "$step: ${commands[$step]}"
    done
    exit 0
fi

mkdir -p "$out"
printf "step\tstatus\tseconds\n" > "$out/status.tsv"
failed=0
for step in "${steps[@]}"; do
    if [[ $step == peer-large ]] && ! "$python" -c "import torch, torchdiffeq" 2>/dev/null; then
        printf "%s\tskipped (no torch/torchdiffeq)\t0\n" "$step" >> "$out/status.tsv"
        continue
    fi
    echo "== $step: ${commands[$step]}"
    start=$SECONDS
    bash -c "${commands[$step]}" > "$out/$step.log" 2>&1
    status=$?
    printf "%s\t%s\t%s\n" "$step" "$status" "$((SECONDS - start))" >> "$out/status.tsv"
    if [[ $status != 0 ]]; then
        failed=1
        echo "   failed (exit $status): see $out/$step.log"
        if [[ $step == gpu ]]; then
            break  # no GPU for JAX: the other checks would run on the CPU
        fi
    fi
done

"$python" - "$out" > "$out/summary.txt" 2>&1 <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print((out / "status.tsv").read_text())
for name in ("verify-quick", "verify"):
    path = out / name / "summary.json"
    if path.exists():
        s = json.loads(path.read_text())
        c, cfg = s["compile"], s["config"]
        failed = [r["name"] for r in s["claims"] if r["passed"] is False]
        print(f"{name}: passed {s['passed']} ({len(s['claims'])} claims, failed: {failed}); "
              f"{c['xla_compilations']} XLA compilations; {c['total_s']:.1f} s wall, "
              f"{c['compile_total_s']:.1f} s compiling; backend {cfg.get('backend')}, "
              f"matmul {cfg.get('matmul_precision')} ({cfg.get('float32_matmul')})")
peer = out / "peer-large" / "peer_benchmark.md"
if peer.exists():
    print(peer.read_text())
final = out / "train" / "final.json"
if final.exists():
    print("train:", final.read_text()[:2000])
EOF
cat "$out/summary.txt"
exit $failed
