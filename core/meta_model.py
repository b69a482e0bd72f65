"""A transformers model built on the meta device: the modules and parameter names of a config's model, no memory.

Its own module, below ``validate.py`` and ``codecs.py``, which both read such a model (``validate`` re-exports it).
"""

from __future__ import annotations

from typing import Any


def build_meta_model(config: Any) -> Any:
    """The model class named by the config's architectures, built without allocating weights."""
    import torch
    import transformers

    cls = getattr(transformers, config.architectures[0])
    with torch.device("meta"):
        return cls(config)
