"""Megatron side of model-support: bridge-built megatron-core models, LoRA, and the CPU/GPU glue.

Importing this package needs megatron-core and megatron-bridge (``pip install 'model-support[megatron]'``
plus megatron-bridge with ``--no-deps``, see ``.ci/requirements-megatron.txt``). The LoRA codecs live in
:mod:`model_support.core.codecs` and import without Megatron.
"""
