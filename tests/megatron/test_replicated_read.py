"""On CPU under tensor parallelism each rank reads a replicated parameter from the checkpoint itself, through the
family's own mapping class: ERNIE 4.5's squeezes its expert bias ``[1, E]`` to megatron-core's ``[E]``."""

from __future__ import annotations

import torch

from tests.megatron.conftest import require_megatron


def test_a_familys_replicated_mapping_still_converts_the_tensor() -> None:
    require_megatron()
    from megatron.bridge.models.ernie.ernie_45_bridge import _SqueezeBiasMapping

    from model_support.core.megatron.builder import _replicated_read_locally

    mapping = _SqueezeBiasMapping(
        "decoder.layers.*.mlp.router.expert_bias", "model.layers.*.mlp.moe_statics.e_score_correction_bias"
    )
    groups = object(), object()  # a rank's groups as the registry set them
    mapping._tp_group, mapping._etp_group = groups
    module = torch.nn.Linear(4, 8, bias=False)
    stored = torch.randn(1, 8)
    with _replicated_read_locally(mapping, module):
        value = mapping.hf_to_megatron(stored, module)
    torch.testing.assert_close(value, stored[0], rtol=0, atol=0)
    assert (mapping._tp_group, mapping._etp_group) == groups
