"""Start-up time of the declaration commands: ``model-support list``, ``show qwen3`` and ``--help``.

Each run is a fresh interpreter (``python -m model_support.core.cli ...``) timed from spawn to exit, so it counts
what a user waits for: interpreter start, imports, plugin loading and printing. It also reports which heavy
packages the command imported (it should be none)::

    python -m benchmarks.cli_startup                 # 5 runs of each command
    python -m benchmarks.cli_startup --runs 10 --out startup.json

The first run of a command can be slower (cold file cache); the median is the figure to compare.
No threshold is applied.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = {"list": ["list"], "show qwen3": ["show", "qwen3"], "--help": ["--help"]}
HEAVY = ("torch", "transformers", "megatron", "numpy")
# Runs the CLI like the console script does, then prints which heavy packages ended up imported.
_PROBE = (
    "import sys\n"
    "from model_support.core.cli import app\n"
    "try:\n"
    "    app(sys.argv[1:])\n"
    "except SystemExit:\n"
    "    pass\n"
    f"print('HEAVY', ','.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\n"
)


def time_command(args: list[str], runs: int) -> dict[str, object]:
    """Wall seconds of ``runs`` fresh runs of the CLI with ``args``, and the heavy packages it imported."""
    seconds: list[float] = []
    heavy = ""
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, check=True)
        seconds.append(time.perf_counter() - start)
        heavy = proc.stderr.rsplit("HEAVY", 1)[-1].strip()
    return {
        "median_s": round(statistics.median(seconds), 3),
        "min_s": round(min(seconds), 3),
        "max_s": round(max(seconds), 3),
        "runs": runs,
        "imported": heavy.split(",") if heavy else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh interpreters per command")
    parser.add_argument("--out", type=Path, help="also write the results as JSON")
    args = parser.parse_args()
    results = {name: time_command(argv, args.runs) for name, argv in COMMANDS.items()}
    for name, r in results.items():
        imported = ", ".join(r["imported"]) or "none"  # type: ignore[arg-type]
        print(
            f"{name:12} median {r['median_s']:.2f} s  (min {r['min_s']:.2f}, max {r['max_s']:.2f}, "
            f"{r['runs']} runs)  heavy imports: {imported}"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
