"""Code that runs inside the vLLM server process (put on its PYTHONPATH, imported without model_support)."""
