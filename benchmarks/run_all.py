"""Run every benchmark on the best device present, then regenerate RESULTS.md.

    python benchmarks/run_all.py                    # full runs (minutes on a CPU)
    python benchmarks/run_all.py --quick            # smoke runs: fewer repeats, smaller sizes
    python benchmarks/run_all.py --only losses kl_approx

Every results file has one invocation, the ``script`` column of
``collect_results.BENCHMARKS`` (``bench_kl.py --approx`` writes ``kl_approx.md``,
``bench_loop.py --multi-turn`` writes ``loop_multi_turn.md``): this script runs each of them
once, in separate processes (so one's peak memory does not count against the next), stops
at the first failure, and calls ``collect_results.py`` at the end. Each ``bench_*.py`` picks
CUDA itself when ``torch.cuda.is_available()``. ``--quick`` is a smoke run: the recorded
``results/*.md`` are put back as they were afterwards, so a smoke run never replaces
measured figures. A full run rewrites each results file whole: the history of a result and
its explanations live in ``benchmarks/notes/<name>.md``, which no script writes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch
from collect_results import BENCHMARKS

HERE = Path(__file__).resolve().parent


def invocations(only: list[str] | None = None) -> dict[str, list[str]]:
    """Results file name -> the script and arguments that write it (every one, or ``only``)."""
    unknown = sorted(set(only or ()) - set(BENCHMARKS))
    if unknown:
        raise SystemExit(f"error: --only {' '.join(unknown)}: unknown; expected some of {' '.join(BENCHMARKS)}")
    return {name: script.split() for name, (script, _, _) in BENCHMARKS.items() if not only or name in only}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke runs of every benchmark")
    parser.add_argument("--only", nargs="*", help="results names such as losses kl_approx (default: all)")
    args = parser.parse_args()
    runs = invocations(args.only)
    device = f"cuda ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "cpu"
    recorded = {p: p.read_bytes() for p in (HERE / "results").glob("*.md")}
    try:
        for name, (script, *script_args) in runs.items():
            command = [sys.executable, str(HERE / script), *script_args] + (["--quick"] if args.quick else [])
            print(f"== {name}.md on {device}: {' '.join(command[1:])}", flush=True)
            if subprocess.run(command).returncode != 0:
                print(f"error: {script} failed; RESULTS.md not regenerated", file=sys.stderr)
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
