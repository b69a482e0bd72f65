"""The staged validation harness behind ``model-support check``."""
