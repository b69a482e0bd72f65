"""What the runtime's vLLM offers that the serving side uses, by the release each came in.

The serving side works with a range of vLLM releases, not one pin: vLLM 0.26 (the newest for torch 2.11, what GPU
images with that torch run) through 0.32 / 0.33 (the CPU build and newer GPU images). Each feature below is used
where the running vLLM has it; a call that needs one the runtime lacks is refused in one line naming the release
(releases read from vLLM's own wheels, 0.26.0 to 0.32.0).
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

from model_support.core.serving.errors import ServingError

# feature -> (the first release that has it, what it is)
FEATURES: dict[str, tuple[str, str]] = {
    # Before 0.30 vLLM serves /inference/v1/generate without the flag (and has no such flag); from 0.30 on it answers
    # 403 unless the server was started with it.
    "scale_out_flag": ("0.30", "the --enable-scale-out flag"),
    "weight_version": ("0.27", "a server-side weight version (/update_weight_version, /weight_info)"),
    "token_weight_versions": ("0.32", "per-token weight versions in /inference/v1/generate"),
    "generate_n": ("0.32", "every one of n choices in a /inference/v1/generate answer"),
    # 0.32 captures routed experts in Model Runner V2 only, and refuses the flag without it; 0.26 in its default runner.
    "routed_experts_mrv2": ("0.32", "routed experts captured by Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1)"),
}


@dataclass(frozen=True)
class VllmFeatures:
    """The features of vLLM ``version`` (see :data:`FEATURES`)."""

    version: str

    def has(self, feature: str) -> bool:
        return Version(self.version).release >= Version(FEATURES[feature][0]).release

    def require(self, feature: str, for_what: str) -> None:
        """Raise a one-line :class:`ServingError` when this vLLM lacks ``feature`` (needed ``for_what``)."""
        if not self.has(feature):
            since, what = FEATURES[feature]
            raise ServingError(
                f"{for_what} needs {what}, which vLLM has from {since} on; the runtime's vLLM is {self.version} "
                "(install a newer one: `model-support runtime install --version`, or `runtime use` another)"
            )
