"""Reference config.json files of real checkpoints, used to build tiny replicas offline."""

from pathlib import Path

CONFIGS = Path(__file__).parent
