"""Stage `chat_template_rollout`: a chat rollout through the server keeps the token ids the trainer will score.

The tokenizer's chat template renders a conversation locally; the server (the merged policy) renders and
generates from the same messages. Checked: the server's prompt ids equal the local rendering; vLLM's
``/tokenize`` of the messages agrees; vLLM's ``/detokenize`` of the generated ids equals the local decode (the
streamed text itself can differ where sampling split a UTF-8 character across tokens); and
scoring prompt + completion ids as a plain token prompt gives back the generation's own log-probabilities,
so the ids a trainer receives are the ids the policy sampled.
"""

from __future__ import annotations

import re

from model_support.core.serving.errors import ServingError
from model_support.validation.context import CHAT_RENDERER, TOKENIZER, CheckContext
from model_support.validation.megatron_session import HF_REFERENCES
from model_support.validation.serving_session import POLICY, POLICY_SERVER, SERVER
from model_support.validation.stage import Stage, StageResult
from model_support.validation.stages.merged_serving import calibrated_tolerance, cannot_serve, logprob_tolerance

CONVERSATION = [
    {"role": "system", "content": "You answer with one word."},
    {"role": "user", "content": "Is the sky blue?"},
    {"role": "assistant", "content": "yes"},
    {"role": "user", "content": "Is fire cold?"},
]


# vLLM's answer to a prompt token its model's vocabulary lacks.
_OUT_OF_VOCABULARY = re.compile(r"Token id (\d+) is out of vocabulary")


class ChatTemplateRolloutStage(Stage):
    name = "chat_template_rollout"
    title = "Chat-template rendering, server generation and token ids round-trip between tokenizer and server."
    order = 90
    requires = ("merged_serving",)
    needs = (*POLICY, SERVER, POLICY_SERVER, TOKENIZER, CHAT_RENDERER, HF_REFERENCES)
    max_tokens = 12

    def prepare(self, ctx: CheckContext) -> None:
        ctx.state.get(CHAT_RENDERER)  # loads the tokenizer in its child while earlier stages run
        from model_support.validation.serving_session import prestart_policy

        prestart_policy(ctx)

    def run(self, ctx: CheckContext) -> StageResult:
        import torch

        from model_support.validation import serving_session as session

        tokenizer = ctx.tokenizer()
        if not tokenizer.chat_template:
            return self.skipped(f"the tokenizer in {ctx.model_dir} has no chat template")
        # apply_chat_template(tokenize=True) encodes its rendering without added special tokens.
        local = tokenizer.encode(ctx.chat_prompts([CONVERSATION])[0], add_special_tokens=False)
        try:
            server = session.serve_policy(ctx)
            chat = server.chat(CONVERSATION, max_tokens=self.max_tokens, temperature=1.0, seed=ctx.seed, logprobs=True)
            tokenized = server.request(
                "/tokenize", {"model": server.served_name, "messages": CONVERSATION, "add_generation_prompt": True}
            )["tokens"]
            prompt_ids, choice = chat["prompt_token_ids"], chat["choices"][0]
            completion = list(choice["token_ids"])
            detokenized = server.request("/detokenize", {"model": server.served_name, "tokens": completion})["prompt"]
            rescored = server.completion(prompt_ids + completion, max_tokens=1, temperature=0.0, prompt_logprobs=0)
        except ServingError as exc:
            beyond = _OUT_OF_VOCABULARY.search(str(exc))
            if beyond and int(beyond[1]) >= len(tokenizer):
                # vLLM renders gpt-oss chats with its own Harmony encoding, whatever the tokenizer's template says.
                arch = (getattr(ctx.config, "architectures", None) or ["the model"])[0]
                return self.skipped(
                    f"vLLM renders {arch} chats with an encoding of its own, not the tokenizer's chat template, whose "
                    f"token id {beyond[1]} lies past this checkpoint's {len(tokenizer)} tokens (a tiny replica's "
                    f"tokenizer) ({exc})"
                )
            return cannot_serve(self, ctx, exc)
        generated_lp = torch.tensor([t["logprob"] for t in choice["logprobs"]["content"]], dtype=torch.float64)
        rescored_lp = session.served_prompt_logprobs(rescored, prompt_ids + completion)[len(prompt_ids) - 1 :]
        text = choice["message"]["content"] or ""
        metrics = {
            "prompt_ids_mismatch": int(prompt_ids != local),
            "tokenize_ids_mismatch": int(tokenized != local),
            "detokenize_mismatch": int(detokenized != tokenizer.decode(completion)),
            "rescore_logprob_max_abs_err": (generated_lp - rescored_lp).abs().max().item() if completion else 0.0,
            "prompt_tokens": len(local),
            "completion_tokens": len(completion),
        }
        details = [f"rendered prompt: {tokenizer.decode(local)!r}", f"completion: {text!r} ids {completion}"]
        tol, own = self._rescore_limit(ctx, prompt_ids + completion, server.options.dtype)
        metrics |= own
        thresholds = {
            "prompt_ids_mismatch": 0,
            "tokenize_ids_mismatch": 0,
            "detokenize_mismatch": 0,
            "rescore_logprob_max_abs_err": tol,
        }
        return self.judge(
            metrics, thresholds, f"{len(local)} prompt + {len(completion)} completion ids round-trip", details, ctx=ctx
        )

    @staticmethod
    def _rescore_limit(ctx: CheckContext, sequence: list[int], dtype: str) -> tuple[float, dict[str, float]]:
        """The limit of the server's log-probs of its completion as generated against as rescored, and what it was
        derived from: two runs of one model in ``dtype`` (decode, then prefill), each within
        ``calibrated_tolerance``'s measured part of the fp32 reference (``LOWP_TOLERANCE_FACTOR`` times transformers'
        own distance in that dtype on the same tokens), so at most twice that apart; never less than the fixed
        ``logprob_tolerance`` (the whole limit in fp32)."""
        from model_support.core.megatron.compare import LOWP_TOLERANCE_FACTOR
        from model_support.validation import serving_session as session

        floor = logprob_tolerance(dtype)
        if dtype == "float32":
            return floor, {}
        adapter, _ = session.policy_adapter(ctx)
        _, own = calibrated_tolerance(
            ctx, adapter, [sequence], session.trainer_logprobs(ctx, adapter, [sequence]), dtype
        )
        return max(floor, 2 * LOWP_TOLERANCE_FACTOR * max(own.values())), own
