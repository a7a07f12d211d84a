"""Export a trained model: `python -m vit_jax.export --format=NAME`.

One module per format, each registering itself (`registry.py`):

  * `savedmodel.py`: TensorFlow SavedModel via jax2tf (TF Serving), with the
    pre-processing in the graph on request;
  * `stablehlo.py`: `jax.export` serialisation, for JAX serving;
  * `onnx.py`: ONNX via jax2onnx, checked with onnxruntime;
  * `hf.py`: a Hugging Face `save_pretrained` directory (PyTorch).

`export_model` writes the format, checks the exported model's logits
against ours on a few images, and writes `MODEL_CARD.md`, `labels.txt` and
`export.json` next to it (`run.py`).
"""

from vit_jax.export import hf, onnx, savedmodel, stablehlo  # noqa: F401
from vit_jax.export.registry import (FORMATS, Format, Options, get, names,
                                     register)
from vit_jax.export.run import ExportError, export_model

__all__ = ['ExportError', 'FORMATS', 'Format', 'Options', 'export_model',
           'get', 'names', 'register']
