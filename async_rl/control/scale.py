"""python -m async_rl.control.scale RUN_DIR --engines K [--timeout S]

Resize the generator pool of a running `async_rl.launch` run. Added engines receive the current
weights before they generate; removed engines drain (finish their requests in flight, hand back the
rest) before they stop. Exit codes: 0 done, 1 refused or failed (one line why), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from async_rl.control.operator_requests import NotRunning, send_scale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m async_rl.control.scale", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="the run directory printed by async_rl.launch ('run directory: ...')")
    ap.add_argument("--engines", type=int, required=True, help="generator engines wanted (>= 1)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the reply")
    args = ap.parse_args(argv)
    if args.engines < 1:
        print(f"error: --engines must be at least 1, not {args.engines}", file=sys.stderr)
        return 2
    try:
        reply = send_scale(Path(args.run_dir), args.engines, args.timeout)
    except (NotRunning, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not reply.ok:
        print(f"error: {reply.message}", file=sys.stderr)
        return 1
    print(f"engines {reply.engines_before} -> {reply.engines_after}: {reply.message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
