"""Renders conversations with a checkpoint's chat template, in a child process the harness can stop.

A chat template is code from the checkpoint (Jinja in transformers' sandbox, which bounds no loop's time nor the
output's size), so the harness renders it here, under a time limit it enforces from outside and a size limit this
script enforces: ``python -P chat_render.py MODEL_DIR MAX_CHARS`` reads a JSON list of conversations on stdin and
writes a JSON list of rendered prompts (``add_generation_prompt=True``) on stdout, or one line on stderr and exit
status 3 when a prompt is larger than MAX_CHARS.

It is run by path (not ``-m``) so that it imports only transformers, not this project.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    from transformers import AutoTokenizer

    model_dir, max_chars = sys.argv[1], int(sys.argv[2])
    conversations = json.load(sys.stdin)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rendered = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        if len(text) > max_chars:
            print(f"a prompt rendered to {len(text)} characters (limit {max_chars})", file=sys.stderr)
            return 3
        rendered.append(text)
    json.dump(rendered, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
