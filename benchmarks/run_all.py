"""Run every benchmark on the best device present, then regenerate RESULTS.md.

    python benchmarks/run_all.py            # full runs (minutes on a CPU)
    python benchmarks/run_all.py --quick    # smoke runs: fewer repeats, smaller sizes

Each ``bench_*.py`` picks CUDA itself when ``torch.cuda.is_available()``; this script
runs them one after another in separate processes (so one's peak memory does not count
against the next), stops at the first failure, and calls ``collect_results.py`` at the
end. ``--quick`` is a smoke run: the recorded ``results/*.md`` are put back as they were
afterwards, so a smoke run never replaces measured figures.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke runs of every benchmark")
    parser.add_argument("--only", nargs="*", help="names such as losses kl (default: all)")
    args = parser.parse_args()
    device = f"cuda ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "cpu"
    scripts = sorted(HERE.glob("bench_*.py"))
    if args.only:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in args.only]
    recorded = {p: p.read_bytes() for p in (HERE / "results").glob("*.md")}
    try:
        for script in scripts:
            command = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
            print(f"== {script.name} on {device}: {' '.join(command[1:])}", flush=True)
            if subprocess.run(command).returncode != 0:
                print(f"error: {script.name} failed; RESULTS.md not regenerated", file=sys.stderr)
                return 1
    finally:
        if args.quick:
            for path, content in recorded.items():
                path.write_bytes(content)
    if args.quick:
        return 0
    return subprocess.run([sys.executable, str(HERE / "collect_results.py")]).returncode


if __name__ == "__main__":
    sys.exit(main())
