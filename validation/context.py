"""What every stage of one ``model-support check`` run sees."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import selectors
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model_support.validation.state import Resource, RunState, stop_value

# Limits of one rendering of the check's conversations by a checkpoint's chat template (CheckContext.chat_prompts).
CHAT_RENDER_LIMIT_S = 60  # loading the tokenizer included
CHAT_RENDER_MAX_CHARS = 1_000_000
# The child's data (heap and private mappings: RLIMIT_DATA), not its address space: that counts the shared libraries
# of torch, which transformers imports (3.5 GB for the CPU build, gigabytes more for a CUDA build's).
CHAT_RENDER_MAX_BYTES = 8 * 2**30

if TYPE_CHECKING:
    from model_support.core.layout import ModelLayout
    from model_support.core.parallel import ParallelLayout
    from model_support.core.registry import RegisteredHandler, Registry


@dataclass
class CheckContext:
    """The model under check, its handler, and a place for stages to share what they built.

    ``model_dir`` holds config.json, weights and tokenizer (a tiny replica under ``--tiny``).
    ``state`` holds what the stages build and share (typed resources, ``validation/state.py``), so e.g. the
    Megatron model is converted once per run.
    """

    target: str
    model_dir: Path
    handler: RegisteredHandler
    config: Any
    layout: ModelLayout
    registry: Registry
    workdir: Path
    tiny: bool = False
    seed: int = 0
    # The Megatron model's dtype ("bf16" or "fp32"); None: the device's (bf16 on a GPU, fp32 on a CPU).
    dtype: str | None = None
    # Parallel layouts for `parallel_parity` ("tp2", "tp2-sp", "ep2", ...); None: the stage's default for the model.
    layouts: tuple[str, ...] | None = None
    # The layout the Megatron stages' model is sharded in across this run's ranks (``check --parallel``); None: one
    # process, the whole model on its device.
    parallel: ParallelLayout | None = None
    # Seconds any stage's run may take (``check --stage-timeout``); None: each stage's own ``time_limit_s``.
    stage_timeout_s: float | None = None
    state: RunState = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.state = RunState(self)

    @property
    def training_dtype(self) -> str:
        """The Megatron model's dtype, "bf16" or "fp32": ``check --dtype``, else the device's (bf16 on a GPU, what
        trainers run; fp32 on a CPU)."""
        import torch

        return self.dtype or ("bf16" if torch.cuda.is_available() else "fp32")

    @property
    def spec(self):  # -> HandlerSpec
        return self.handler.spec

    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (the ``tokenizer`` resource: loaded once; a one-line error when none loads)."""
        return self.state.get(TOKENIZER)

    def chat_prompts(self, conversations: list[list[dict[str, str]]]) -> list[str]:
        """Each conversation rendered by the checkpoint's chat template (``add_generation_prompt=True``), as
        ``tokenizer.apply_chat_template(..., tokenize=False)`` renders it, by :class:`ChatRenderer` (the
        ``chat_renderer`` resource): in a child process held to ``CHAT_RENDER_LIMIT_S`` seconds,
        ``CHAT_RENDER_MAX_CHARS`` characters a prompt and ``CHAT_RENDER_MAX_BYTES`` of memory, since a template's
        loops and output are bounded by nothing else."""
        return self.state.get(CHAT_RENDERER).render(conversations)


class ChatRenderer:
    """A child process (``validation/chat_render.py``) that renders conversations with the chat template of
    ``model_dir``: transformers is imported and the tokenizer loaded once, when it starts, and each request is held
    to ``CHAT_RENDER_LIMIT_S`` seconds (the first one's from the start: loading included). A request over the limit
    kills the child (the next starts another); so does :meth:`stop`."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._proc: subprocess.Popen[bytes] | None = None
        self._since = 0.0

    def start(self) -> ChatRenderer:
        def limit_memory() -> None:
            resource.setrlimit(resource.RLIMIT_DATA, (CHAT_RENDER_MAX_BYTES, CHAT_RENDER_MAX_BYTES))

        if self._proc is None:
            script = Path(__file__).with_name("chat_render.py")
            self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (open as long as the child: closed by stop)
            self._proc = subprocess.Popen(
                [sys.executable, "-P", str(script), str(self.model_dir), str(CHAT_RENDER_MAX_CHARS)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                preexec_fn=limit_memory,
            )
            self._since = time.monotonic()
        return self

    def render(self, conversations: list[list[dict[str, str]]]) -> list[str]:
        from model_support.core.errors import ModelSupportError

        what = f"the chat template of {self.model_dir}"
        proc = self.start()._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        deadline = max(self._since, time.monotonic()) + CHAT_RENDER_LIMIT_S
        line = b""
        try:
            proc.stdin.write(json.dumps(conversations).encode() + b"\n")
            proc.stdin.flush()
            with selectors.DefaultSelector() as selector:
                selector.register(proc.stdout, selectors.EVENT_READ)
                while not line.endswith(b"\n"):
                    if not selector.select(deadline - time.monotonic()):
                        self.stop()
                        raise ModelSupportError(
                            f"{what} did not render {len(conversations)} short conversation(s) in "
                            f"{CHAT_RENDER_LIMIT_S} s; fix its loops (a correct template renders them in milliseconds)"
                        )
                    chunk = os.read(proc.stdout.fileno(), 1 << 20)
                    if not chunk:
                        break
                    line += chunk
        except BrokenPipeError:
            pass
        if not line.endswith(b"\n"):  # the child ended: its last error line says why
            code = proc.wait()
            self._stderr.seek(0)
            lines = self._stderr.read().decode(errors="replace").strip().splitlines() or [f"exit status {code}"]
            self.stop()
            raise ModelSupportError(f"{what} failed to render: {lines[-1]}")
        self._since = 0.0
        answer = json.loads(line)
        if "error" in answer:
            raise ModelSupportError(f"{what} failed to render: {answer['error']}")
        return answer["prompts"]

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(BrokenPipeError):  # stdin's unsent bytes, to a child that is gone
                        pipe.close()
            self._stderr.close()
            self._proc = None


def _load_tokenizer(ctx: CheckContext) -> Any:
    """The checkpoint's tokenizer; a one-line error when there is none that loads."""
    from transformers import AutoTokenizer

    from model_support.core.errors import ModelSupportError

    try:
        tokenizer = AutoTokenizer.from_pretrained(ctx.model_dir)
    except Exception as exc:  # transformers raises OSError, ValueError or TypeError here
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelSupportError(
            f"no usable tokenizer in {ctx.model_dir} ({type(exc).__name__}: {reason}); add the checkpoint's "
            "tokenizer files"
        ) from None
    # Without tokenizer files transformers builds the family's tokenizer class with an empty vocabulary.
    if len(tokenizer) <= len(tokenizer.all_special_ids):
        raise ModelSupportError(
            f"no tokenizer files in {ctx.model_dir}: transformers' {type(tokenizer).__name__} from it has "
            f"{len(tokenizer)} token(s); add the checkpoint's tokenizer files (e.g. tokenizer.json)"
        )
    return tokenizer


TOKENIZER: Resource[Any] = Resource("tokenizer", "the checkpoint's tokenizer", _load_tokenizer)
CHAT_RENDERER: Resource[ChatRenderer] = Resource(
    "chat_renderer",
    "a child process rendering conversations with the checkpoint's chat template (CheckContext.chat_prompts)",
    lambda ctx: ChatRenderer(ctx.model_dir).start(),
    stop=stop_value,
)
