"""Length-dependent structures: the rows a check runs cross them, and a build refuses a config feature it ignores."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import transformers

from model_support.core import api
from model_support.core.layout import GDN_CHUNK, ConfigFields, length_structures, long_row_length
from tests.megatron.conftest import require_megatron


def _config(model_dir, **text_fields):
    config = copy.deepcopy(transformers.AutoConfig.from_pretrained(model_dir))
    for name, value in text_fields.items():
        setattr(config.get_text_config(), name, value)
    return config


def test_long_rows_cross_every_structure_the_config_has(tiny_model_dir):
    qwen35 = transformers.AutoConfig.from_pretrained(tiny_model_dir("qwen3.5"))
    layout = api.resolve(tiny_model_dir("qwen3.5")).spec.layout(qwen35)
    assert length_structures(qwen35, layout) == {"gdn_chunks": 3 * GDN_CHUNK + 1}
    qwen3 = tiny_model_dir("qwen3")
    dense = api.resolve(qwen3).spec.layout(transformers.AutoConfig.from_pretrained(qwen3))
    # Qwen3's sliding_window field is no window while use_sliding_window is false.
    windowed = _config(qwen3, sliding_window=100, use_sliding_window=True, layer_types=["sliding_attention"] * 2)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 300, "rope_theta": 1e6}
    scaled = _config(qwen3, rope_parameters=yarn)
    assert length_structures(_config(qwen3, sliding_window=100), dense) == {}
    assert length_structures(windowed, dense) == {"sliding_window": 101}
    assert length_structures(scaled, dense) == {"rope_scaling": 301}
    assert long_row_length(scaled, dense) == 301
    assert long_row_length(_config(qwen3), dense, floor=4096) == 4096


@pytest.mark.slow
def test_a_build_refuses_a_window_or_rope_scaling_the_built_model_ignores(tiny_model_dir):
    """The default layer spec builds no sliding window and the Qwen3 provider sets no rope scaling: a build of such a
    config must name the field instead of returning a model that is wrong past the window or the threshold."""
    require_megatron()
    from model_support.core.megatron.builder import UnimplementedFeatureError
    from model_support.core.megatron.features import unimplemented

    model_dir = tiny_model_dir("qwen3")
    model = api.build_model(model_dir, handler=api.resolve(model_dir))
    assert unimplemented(model.config, model.chunks) == []
    windowed = _config(model_dir, sliding_window=16, use_sliding_window=True, layer_types=["sliding_attention"] * 2)
    (problem,) = unimplemented(windowed, model.chunks)
    assert problem.startswith("config sets sliding_window=16, but the built model's attention ignores it (layer 0: ")
    rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": model.config.rope_parameters["rope_theta"]}
    (problem,) = unimplemented(_config(model_dir, rope_parameters=rope), model.chunks)
    assert problem.startswith("config sets rope_type='linear' (factor=4.0")
    assert "does not apply this rope scaling" in problem
    # A handler that reads sliding layers as full attention ones, on the default layer spec: the build refuses.
    handler = api.resolve(model_dir)
    kinds = {"full_attention": "full_attention", "sliding_attention": "full_attention"}
    sliding = dataclasses.replace(handler.spec, config_fields=ConfigFields(layer_kinds=kinds))
    with pytest.raises(UnimplementedFeatureError, match="sliding_window=16"):
        api.build_model(model_dir, handler=dataclasses.replace(handler, spec=sliding), config=windowed)


def test_a_build_refuses_a_checkpoint_tensor_it_reads_into_no_parameter(tiny_model_dir, tmp_path):
    """A checkpoint tensor no built parameter takes (gpt-oss's attention sinks where the layer spec builds none, a
    bias the spec leaves out) changes what the checkpoint computes: the build names it instead of ignoring it."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    require_megatron()
    from model_support.core.megatron.builder import UnimplementedFeatureError

    model_dir = shutil.copytree(tiny_model_dir("qwen3"), tmp_path / "sinks")
    tensors = load_file(model_dir / "model.safetensors")
    heads = transformers.AutoConfig.from_pretrained(model_dir).num_attention_heads
    # Tensors a model computes nothing from are no problem: a rotary inverse-frequency buffer some checkpoints keep.
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    api.build_model(model_dir, handler=api.resolve(model_dir))
    tensors["model.layers.1.self_attn.sinks"] = torch.zeros(heads)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    unread = r"reads 1 checkpoint tensor\(s\) into no parameter: model\.layers\.1\.self_attn\.sinks; the layer spec"
    with pytest.raises(UnimplementedFeatureError, match=unread):
        api.build_model(model_dir, handler=api.resolve(model_dir))
