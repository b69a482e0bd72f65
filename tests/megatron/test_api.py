"""The training-time API on a tiny model: what a trainer calls, with the outcomes it relies on."""

from __future__ import annotations

import re

import pytest
import torch

from model_support.core import api
from model_support.core.codecs import CodecError
from model_support.core.errors import ModelSupportError
from model_support.core.megatron.dist import ParallelLayoutError
from model_support.core.megatron.lora import LoraError, load_lora_state, lora_state, random_lora_state
from tests.megatron.conftest import require_megatron

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen35(tiny_model_dir) -> api.TrainingModel:
    require_megatron()
    model_dir = tiny_model_dir("qwen3.5")
    model = api.build_model(model_dir, handler=api.resolve(model_dir))
    api.apply_lora(model, rank=4, alpha=8.0)
    return model


def test_resolve_and_build_describe_what_runs(qwen35):
    assert qwen35.handler.spec.name == "qwen3.5"
    assert "float32 on cpu" in qwen35.describe() and "LocalGatedDeltaNet" in qwen35.describe()
    assert qwen35.built.model is qwen35.module
    with pytest.raises(LoraError, match="already applied"):
        api.apply_lora(qwen35)


def test_apply_lora_leaves_the_model_unchanged_and_draws_the_seeds_canonical_adapter(tiny_model_dir):
    from model_support.core.megatron.forward import logits
    from model_support.core.megatron.lora import fresh_lora

    require_megatron()
    model_dir = tiny_model_dir("qwen3")
    model = api.build_model(model_dir, handler=api.resolve(model_dir))
    tokens = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = logits(model.module, tokens)
        api.apply_lora(model, rank=4, alpha=8.0, seed=7)
        assert torch.equal(logits(model.module, tokens), base)  # B = 0: bit for bit
    state = lora_state(model.module)
    a = {k: v for k, v in state.items() if k.endswith("lora_A.weight")}
    assert len(a) == 8 and all((v == 0).all() for k, v in state.items() if k.endswith("lora_B.weight"))
    # PEFT's (and torch.nn.Linear's) draw: uniform in +-1/sqrt(in), each module its own.
    assert all(0.9 < v.abs().max() * v.shape[1] ** 0.5 <= 1 for v in a.values())
    qkv = [v for k, v in a.items() if k.endswith("linear_qkv.lora_A.weight")]
    assert len(qkv) == 2 and not torch.equal(*qkv)
    fresh_lora(model.module, seed=7)
    assert all(torch.equal(lora_state(model.module)[k], v) for k, v in a.items())
    fresh_lora(model.module, seed=8)
    assert not any(torch.equal(lora_state(model.module)[k], v) for k, v in a.items())


def test_a_layout_that_disagrees_with_the_callers_groups_is_refused(qwen35):
    with pytest.raises(ParallelLayoutError, match="initialised with tensor parallel 1, the model asks for 2"):
        api.build_model(qwen35.model_dir, handler=qwen35.handler, parallel=api.ParallelLayout(tensor_parallel=2))


def test_adapter_export_and_load_round_trip_exactly(qwen35, tmp_path):
    state = random_lora_state(qwen35.module, seed=5, b_std=0.05)
    load_lora_state(qwen35.module, state)
    adapter = api.export_adapter(qwen35, tmp_path / "adapter")
    load_lora_state(qwen35.module, {k: torch.zeros_like(v) for k, v in state.items()})
    api.load_adapter(qwen35, adapter)
    back = lora_state(qwen35.module)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c, t: c.update(lora_alpha=32), "has lora_alpha=32, the model's LoRA 8: loading it would scale every"),
        (
            lambda c, t: c.update(lora_alpha=float("nan")),
            "has r=4, lora_alpha=nan; the model's LoRA has r=4, lora_alpha=8",
        ),
        (lambda c, t: c.update(use_rslora=True), "is an rsLoRA adapter (scale alpha / sqrt(r))"),
        (lambda c, t: t[next(iter(t))].view(-1).__setitem__(0, float("nan")), "holds non-finite values; nothing was"),
        (lambda c, t: t.__setitem__(next(k for k in t if "lora_B" in k), torch.zeros(3, 4)), "does the LoRA match"),
    ],
)
def test_an_adapter_that_does_not_fit_is_refused_before_the_lora_changes(qwen35, tmp_path, edit, message):
    import json

    from safetensors.torch import load_file, save_file

    load_lora_state(qwen35.module, random_lora_state(qwen35.module, seed=5, b_std=0.05))
    adapter = api.export_adapter(qwen35, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    edit(config, tensors)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    kept = random_lora_state(qwen35.module, seed=11, b_std=0.05)
    load_lora_state(qwen35.module, kept)
    with pytest.raises((LoraError, CodecError), match=re.escape(message)):
        api.load_adapter(qwen35, adapter)
    now = lora_state(qwen35.module)
    assert all(torch.equal(now[k], kept[k]) for k in kept)  # nothing loaded


def test_packed_token_logprobs_equal_separate_runs_and_carry_gradients(qwen35):
    load_lora_state(qwen35.module, random_lora_state(qwen35.module, seed=6, b_std=0.05))
    sequences = [[5, 9, 33, 71, 2, 8], [40, 41, 42], [300, 12, 7, 7]]
    packed = api.token_logprobs(qwen35, sequences)
    for seq, rows in zip(sequences, packed, strict=True):
        alone = api.token_logprobs(qwen35, [seq])[0]
        assert rows.shape == (len(seq), alone.shape[-1])
        assert (rows - alone).abs().max().item() < 1e-5
    packed[0][-1, 3].backward()
    grads = [p.grad for p in qwen35.module.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    qwen35.module.zero_grad(set_to_none=True)


def test_lora_disabled_scores_the_base_model_and_leaves_the_adapter(qwen35):
    """The reference policy of a KL term: inside ``api.lora_disabled`` the model is its base (the same as with every
    B zeroed); outside, the adapter computes again (across layouts: parallel_parity's ``reference_logprobs_err``)."""
    state = random_lora_state(qwen35.module, seed=8, b_std=0.05)
    load_lora_state(qwen35.module, state)
    rows = [[5, 9, 33, 71, 2, 8, 40, 41]]
    with torch.no_grad():
        tuned = api.token_logprobs(qwen35, rows)[0]
        with api.lora_disabled(qwen35):
            reference = api.token_logprobs(qwen35, rows)[0]
        after = api.token_logprobs(qwen35, rows)[0]
        load_lora_state(qwen35.module, {k: v if "lora_A" in k else torch.zeros_like(v) for k, v in state.items()})
        base = api.token_logprobs(qwen35, rows)[0]
    load_lora_state(qwen35.module, state)
    assert torch.equal(reference, base) and torch.equal(after, tuned)
    assert (tuned - base).abs().max().item() > 1e-3  # the adapter does change the model


def test_lora_merged_scores_the_pushed_policy_and_puts_the_base_back(qwen35):
    """Inside ``api.lora_merged`` each update is merged into its base weight in the base's dtype (fp32 here: the
    same policy as base + LoRA up to rounding) and the adapter is off; on exit the base weights are bitwise what
    they were and the adapter computes again."""
    from model_support.core.megatron.lora import lora_modules

    state = random_lora_state(qwen35.module, seed=9, b_std=0.05)
    load_lora_state(qwen35.module, state)
    rows = [[5, 9, 33, 71, 2, 8, 40, 41]]
    weights = {name: m.base.weight.detach().clone() for name, m in lora_modules(qwen35.module).items()}
    with torch.no_grad():
        tuned = api.token_logprobs(qwen35, rows)[0]
        with api.lora_merged(qwen35):
            merged = api.token_logprobs(qwen35, rows)[0]
            moved = [n for n, m in lora_modules(qwen35.module).items() if not torch.equal(m.base.weight, weights[n])]
            with api.lora_disabled(qwen35):
                base_with_merge = api.token_logprobs(qwen35, rows)[0]
        after = api.token_logprobs(qwen35, rows)[0]
    assert len(moved) == len(weights)  # every wrapped linear held its merged weight inside
    assert all(torch.equal(m.base.weight, weights[n]) for n, m in lora_modules(qwen35.module).items())
    assert (merged - tuned).abs().max().item() < 1e-5 and torch.equal(after, tuned)
    assert torch.equal(base_with_merge, merged)  # the adapter was off: the merged weights alone


def test_lora_grad_norm_and_clipping_on_one_rank_are_torch_s(qwen35):
    """On one rank the whole model's LoRA gradient norm is torch's over every LoRA gradient, and clipping scales
    them as ``torch.nn.utils.clip_grad_norm_`` would (across ranks: parallel_parity's ``grad_norm_rel_err``)."""
    load_lora_state(qwen35.module, random_lora_state(qwen35.module, seed=7, b_std=0.05))
    api.token_logprobs(qwen35, [[5, 9, 33, 71, 2, 8, 40, 41]])[0][:, 3].sum().backward()
    api.reduce_lora_grads(qwen35)
    params = [p for p in qwen35.module.parameters() if p.requires_grad]
    grads = [p.grad.clone() for p in params]
    want = torch.nn.utils.get_total_norm(grads).item()
    assert want > 0 and api.lora_grad_norm(qwen35) == pytest.approx(want, rel=1e-6)
    assert api.clip_lora_grads(qwen35, want * 2) == pytest.approx(want, rel=1e-6)  # under the limit: unchanged
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
    assert api.clip_lora_grads(qwen35, want / 4) == pytest.approx(want, rel=1e-6)
    assert api.lora_grad_norm(qwen35) == pytest.approx(want / 4, rel=1e-5)
    assert all(torch.allclose(p.grad, g / 4, rtol=1e-5, atol=0) for p, g in zip(params, grads, strict=True))
    qwen35.module.zero_grad(set_to_none=True)


def test_group_logprobs_computes_the_prompt_once_and_equals_each_full_row(qwen35):
    load_lora_state(qwen35.module, random_lora_state(qwen35.module, seed=9, b_std=0.05))
    prompt, completions = [11, 12, 13, 14, 15, 16, 17], [[21, 22, 23], [31, 32], [41, 42, 43, 44]]
    with torch.no_grad():
        group = api.group_logprobs(qwen35, prompt, completions)
        for completion, rows in zip(completions, group, strict=True):
            full = api.token_logprobs(qwen35, [prompt + completion])[0]
            assert rows.shape == (len(completion), full.shape[-1])
            assert (rows - full[len(prompt) - 1 : -1]).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="non-empty prompt"):
        api.group_logprobs(qwen35, prompt, [[]])


def test_merged_weights_come_in_bounded_buckets(qwen35):
    sizes = [
        sum(t.numel() * t.element_size() for t in b.values()) for b in api.merged_weights(qwen35, bucket_bytes=1 << 20)
    ]
    assert len(sizes) > 1
    assert all(size <= 1 << 20 for size in sizes)  # no tensor of the tiny model is larger than a bucket


def test_resolve_names_what_is_wrong(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"}')
    with pytest.raises(ModelSupportError, match="NoSuchForCausalLM"):
        api.resolve(tmp_path)


def test_save_merged_writes_a_servable_checkpoint_of_the_live_weights(qwen35, tmp_path):
    from safetensors import safe_open

    from model_support.core.serving.errors import ExportError

    load_lora_state(qwen35.module, random_lora_state(qwen35.module, seed=8, b_std=0.05))
    out = api.save_merged(qwen35, tmp_path / "merged", bucket_bytes=1 << 20)
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    live = {k: v for bucket in api.merged_weights(qwen35) for k, v in bucket.items()}
    saved = {}
    for shard in out.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            saved |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    assert set(saved) == set(live) and all(torch.equal(saved[k], live[k]) for k in live)
    with pytest.raises(ExportError, match="already exists"):
        api.save_merged(qwen35, out)
    assert not list(tmp_path.glob(".merged.partial"))


def test_lora_state_of_a_wrong_shape_loads_nothing(qwen35):
    kept = random_lora_state(qwen35.module, seed=12, b_std=0.05)
    load_lora_state(qwen35.module, kept)
    wrong = random_lora_state(qwen35.module, seed=13, b_std=0.05)
    last = sorted(k for k in wrong if k.endswith("lora_B.weight"))[-1]
    wrong[last] = torch.zeros(wrong[last].shape[0] + 1, wrong[last].shape[1])
    with pytest.raises(LoraError, match=rf"{re.escape(last)} is \[\d+, \d+\], the model's is"):
        load_lora_state(qwen35.module, wrong)
    now = lora_state(qwen35.module)
    assert all(torch.equal(now[k], kept[k]) for k in kept)  # not half-loaded


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"micro_batches": 0}, "micro_batches is a count of micro-batches (1 or more), got 0"),
        ({"micro_batches": 3}, "a batch of 2 rows does not split into 3 micro-batches"),
        ({"input_ids": torch.ones(2, 6)}, "input_ids is an integer tensor [B, S], got [2, 6]"),
        ({"input_ids": torch.ones(6, dtype=torch.long)}, "input_ids is an integer tensor [B, S], got [6]"),
        ({"input_ids": torch.ones(2, 1, dtype=torch.long)}, "a step needs a row and two tokens"),
        ({"position_ids": torch.zeros(1, 6, dtype=torch.long)}, "position_ids is [B, S] = [2, 6] like input_ids"),
    ],
)
def test_bad_step_arguments_are_refused_in_one_line(qwen35, kwargs, message):
    args = {"input_ids": torch.ones(2, 6, dtype=torch.long)} | kwargs
    with pytest.raises(ValueError, match=re.escape(message)):
        api.forward_backward(qwen35, args.pop("input_ids"), lambda out, micro: out.sum(), **args)


@pytest.mark.parametrize(("rank", "alpha"), [(0, 8.0), (-2, 8.0), (2.5, 8.0), (4, 0.0), (4, float("nan"))])
def test_bad_lora_arguments_are_refused_in_one_line(tiny_model_dir, rank, alpha):
    model_dir = tiny_model_dir("qwen3")
    model = api.build_model(model_dir, handler=api.resolve(model_dir))
    with pytest.raises(LoraError, match=r"^(rank is the LoRA's rank|alpha is the LoRA's positive)"):
        api.apply_lora(model, rank=rank, alpha=alpha)
    assert model.lora is None


def test_parallel_parity_scores_the_adapter_every_layout_shares(qwen35, tmp_path):
    """The worker's forward-only rows (scoring calls, shared-prefix row) are taken on the adapter before the step:
    after it each layout's adapter carries its own gradients' round-off, which a real-width model carries on to its
    log-probs past the fp32 limit. The single-rank run's rows equal this model's on that adapter."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from model_support.validation.parallel_worker import SEED, _scored

    out = tmp_path / "job"
    subprocess.run(
        [sys.executable, "-m", "model_support.validation.parallel_worker", "--world", "1", str(out),
         str(qwen35.model_dir), "qwen3.5", "single"],
        check=True, capture_output=True,
    )  # fmt: skip
    written = load_file(str(out / "single.safetensors"))
    kept = lora_state(qwen35.chunks)
    try:
        load_lora_state(qwen35.chunks, random_lora_state(qwen35.chunks, seed=SEED, b_std=0.05))
        rows = _scored(qwen35)
    finally:
        load_lora_state(qwen35.chunks, kept)
    scored = [k for k in rows if k.endswith("logprobs." + k.rsplit(".", 1)[-1])]
    assert len(scored) == 6
    for key in scored:
        torch.testing.assert_close(written[key], rows[key], rtol=0, atol=1e-6)
