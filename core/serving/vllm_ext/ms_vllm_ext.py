"""Loaded into the vLLM server process (``--middleware ms_vllm_ext.served_name``); standard library + vLLM only.

``POST /model_support/served_model_name {"name": "model@3"}`` renames the served base model in place: after it,
``/v1/models`` lists the new name, requests must use it, and the old name is answered with vLLM's own
"model does not exist" error. The server keeps running (same process, same weights).
"""

from __future__ import annotations

import dataclasses
import json

from fastapi.responses import JSONResponse

ROUTE = "/model_support/served_model_name"


async def served_name(request, call_next):
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
