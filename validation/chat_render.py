"""Renders conversations with a checkpoint's chat template, in a child process the harness can stop.

A chat template is code from the checkpoint (Jinja in transformers' sandbox, which bounds no loop's time nor the
output's size), so the harness renders it here, under a time limit it enforces from outside and a size limit this
script enforces: ``python -P chat_render.py MODEL_DIR MAX_CHARS`` loads the tokenizer, then for each line on stdin
(a JSON list of conversations) writes one line on stdout: ``{"prompts": [...]}`` (rendered with
``add_generation_prompt=True``) or ``{"error": "..."}`` when a prompt is larger than MAX_CHARS. Any other failure
ends the process with the error's last line on stderr. One child serves a whole check (transformers is imported
once); it ends when its stdin closes.

It is run by path (not ``-m``) so that it imports only transformers, not this project.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    from transformers import AutoTokenizer

    model_dir, max_chars = sys.argv[1], int(sys.argv[2])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for line in sys.stdin:
        rendered = []
        for conversation in json.loads(line):
            text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
            if len(text) > max_chars:
                rendered = None
                answer = {"error": f"a prompt rendered to {len(text)} characters (limit {max_chars})"}
                break
            rendered.append(text)
        if rendered is not None:
            answer = {"prompts": rendered}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
