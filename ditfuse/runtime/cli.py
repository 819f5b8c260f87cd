"""The ``ditfuse`` command line.

Subcommand handlers import their heavy modules lazily: ``ditfuse --help`` and ``ditfuse kernels``
import no triton and no kernel module.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _cmd_kernels(args: argparse.Namespace) -> int:
    from ..kernels import registry

    rows = [
        {
            "op": s.op,
            "domain": s.domain,
            "backend": s.backend.value,
            "contract": s.contract.value,
            "capabilities": s.describe_capabilities(),
            "replaces": s.replaces,
            "summary": s.summary,
            "target": s.target,
        }
        for s in registry.specs()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = ("op", "domain", "backend", "contract", "capabilities", "replaces")
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) if rows else len(c) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    print("  ".join("-" * widths[c] for c in cols))
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) for c in cols))
    return 0


def _cmd_docs(args: argparse.Namespace) -> int:
    from . import docs

    if args.check:
        target = docs.DEFAULT_PATH if args.out is None else args.out
        current = target.read_text() if target.exists() else ""
        if current != docs.render():
            print(f"{target} is out of date; run `ditfuse docs`", file=sys.stderr)
            return 1
        print(f"{target} is up to date")
        return 0
    path = docs.write(args.out)
    print(f"wrote {path}")
    return 0


def _run_bench_script(name: str, argv: list[str]) -> int:
    """Benchmarks live in the checkout's bench/ (they are not part of the installed package)."""
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / name
    if not script.is_file():
        print(f"{script} not found: run from a source checkout", file=sys.stderr)
        return 2
    sys.argv = [str(script), *argv]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else (print(e.code, file=sys.stderr) or 1)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.target == "kernels":
        return _run_bench_script("bench_kernels.py", args.rest)
    from ..models import families

    if args.target not in families.names():
        print(f"unknown bench target {args.target!r}; targets: kernels, {', '.join(families.names())}",
              file=sys.stderr)
        return 2
    return _run_bench_script("bench_step.py", ["--family", args.target, *args.rest])


def build_parser() -> argparse.ArgumentParser:
    from pathlib import Path

    from .. import __version__

    p = argparse.ArgumentParser(
        prog="ditfuse",
        description="Fused, by default bit-exact, kernels for diffusers pipelines.",
    )
    p.add_argument("--version", action="version", version=f"ditfuse {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    k = sub.add_parser("kernels", help="list the kernel inventory")
    k.add_argument("--json", action="store_true", help="print JSON instead of a table")
    k.set_defaults(func=_cmd_kernels)

    d = sub.add_parser("docs", help="regenerate docs/fused_kernels.md from the registry")
    d.add_argument("--out", type=Path, default=None, help="output path (default: docs/fused_kernels.md)")
    d.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    d.set_defaults(func=_cmd_docs)

    b = sub.add_parser(
        "bench",
        help="benchmarks (GPU, from a source checkout): `ditfuse bench flux|wan`, `ditfuse bench kernels`",
        description="`ditfuse bench FAMILY [args]` runs bench/bench_step.py --family FAMILY (one real-size "
        "transformer step: eager / lossless / +CUDA graph / high / torch.compile, profiler breakdown, CSV + "
        "PNG; `ditfuse bench flux --help` lists its options); `ditfuse bench kernels [args]` runs "
        "bench/bench_kernels.py.",
    )
    b.add_argument("target", help="a model family (flux, wan) or 'kernels'")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark script")
    b.set_defaults(func=_cmd_bench)

    from .commands import register as _register_runtime  # generate, serve (light: no torch)

    _register_runtime(sub)
    for register in _EXTRA_COMMANDS:
        register(sub)
    return p


def _register_drift(sub: argparse._SubParsersAction) -> None:
    from .drift import register  # light: drift imports torch only when it runs

    register(sub)


# Further subcommands register themselves here: callables taking the subparsers object.
_EXTRA_COMMANDS: list = [_register_drift]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
