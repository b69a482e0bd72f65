"""Loaded into the vLLM server process (``--middleware ms_vllm_ext.middleware``); standard library + vLLM only.

Owner only: when ``MODEL_SUPPORT_SERVER_KEY`` is set in the server's environment (``api.serve`` sets a fresh one
for every server), every request but ``/health`` must carry ``Authorization: Bearer <key>``, else 401 and nothing
runs. vLLM's own ``--api-key`` guards ``/v1`` only; its development routes (``/collective_rpc``, ``/pause``,
``/update_weights`` ...), which the project turns on, would answer any local process. The key travels in the
environment, which only the owner can read, not on the command line.

``POST /model_support/served_model_name {"name": "model@3"}`` renames the served base model in place: after it,
``/v1/models`` lists the new name, requests must use it, and the old name is answered with vLLM's own
"model does not exist" error. The server keeps running (same process, same weights).
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import os

from fastapi.responses import JSONResponse

ROUTE = "/model_support/served_model_name"
KEY_ENV = "MODEL_SUPPORT_SERVER_KEY"
OPEN = ("/health",)  # readiness probes say nothing and change nothing


async def middleware(request, call_next):
    key = os.environ.get(KEY_ENV)
    if key and request.url.path not in OPEN:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return JSONResponse({"error": "this server answers its owner only: send its key"}, status_code=401)
    if request.url.path != ROUTE or request.method != "POST":
        return await call_next(request)
    name = json.loads(await request.body()).get("name")
    if not isinstance(name, str) or not name:
        return JSONResponse({"error": "body must be {'name': '<new served model name>'}"}, status_code=400)
    paths = request.app.state.openai_serving_models.base_model_paths
    previous = paths[0].name
    # The list is shared by vLLM's model registry and its OpenAI handlers: replace the entry in place.
    paths[0] = dataclasses.replace(paths[0], name=name)
    return JSONResponse({"served_model_name": name, "previous": previous})
