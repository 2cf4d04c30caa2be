"""NumPy forward passes of mlx-lm's ``qwen3_5``, ``qwen3_next`` (hybrid GatedDeltaNet / attention) and
``llama`` models, with the per-layer state, its checkpoint / rollback, and ``keep(m)``.

>>> import tempfile
>>> from reference.models.tiny import write_tiny_model
>>> model = load_model(write_tiny_model(tempfile.mkdtemp(), "qwen3_5", seed=0))
>>> cache = model.make_cache()
>>> logits = model.forward([1, 2, 3, 4], cache)   # a verify forward over S = 4 tokens
>>> logits.shape, cache.offset
((4, 260), 4)
>>> cache.keep(2)                                 # keep the state after the first 2 of them
>>> cache.offset
2
"""
from reference.models.cache import Checkpoint, KVState, ModelCache, RecurrentState
from reference.models.decoder import Model
from reference.models.loading import ARCHITECTURES, load_model

__all__ = ["ARCHITECTURES", "Checkpoint", "KVState", "Model", "ModelCache", "RecurrentState", "load_model"]
