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
    print_kernel_table(rows)
    return 0


# Below this width the five columns no longer fit side by side with room for ``replaces``.
_WIDE_TABLE = 120


def print_kernel_table(rows: list[dict[str, str]], width: int | None = None) -> None:
    """The inventory as a table that fits the terminal (``rich`` wraps the long cells; piped
    output is 80 columns unless ``COLUMNS`` says otherwise). Op names never wrap, so they can be
    copied or grepped; ``--json`` is the form for machines. Narrow terminals get two columns:
    op + backend + contract, and capabilities + what it replaces."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text  # plain text: formulas such as "cat([a, b])" are not markup

    console = Console(width=width, highlight=False, soft_wrap=False)
    wide = console.width >= _WIDE_TABLE
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, show_lines=not wide, pad_edge=False, expand=False)
    if wide:
        table.add_column("op", no_wrap=True)
        table.add_column("backend", no_wrap=True)
        table.add_column("contract", no_wrap=True)
        table.add_column("capabilities", overflow="fold")
        table.add_column("replaces", overflow="fold")
        for r in rows:
            table.add_row(*(Text(r[c]) for c in ("op", "backend", "contract", "capabilities", "replaces")))
    else:
        table.add_column("op / backend / contract", no_wrap=True)
        table.add_column("capabilities / replaces", overflow="fold")
        for r in rows:
            table.add_row(
                Text(f"{r['op']}\n{r['backend']} / {r['contract']}"), Text(f"{r['capabilities']}\n{r['replaces']}")
            )
    console.print(table)


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


# The families `ditfuse bench` names in its help (the parser stays free of torch, so this is a
# list, not models.families.names(); tests/cpu/test_cli.py keeps the two equal).
BENCH_FAMILIES = ("flux", "wan", "flux2", "flux3", "chroma", "sd3", "qwenimage", "qwenimage21", "zimage",
                  "hunyuanvideo15", "hunyuanvideo", "ltx", "chronoedit", "skyreels_v2", "wan_animate")


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.target == "kernels":
        return _run_bench_script("bench_kernels.py", args.rest)
    if args.target == "vae":
        return _run_bench_script("bench_vae.py", args.rest)
    from ..models import families

    if args.target not in families.names():
        print(f"unknown bench target {args.target!r}; targets: kernels, vae, {', '.join(families.names())}",
              file=sys.stderr)
        return 2
    return _run_bench_script("bench_step.py", ["--family", args.target, *args.rest])


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, so nobody has to read the source to learn it;
    except where there is nothing to show (None, False) or the help text already says it."""

    @staticmethod
    def shows_default(action: argparse.Action) -> bool:
        d = action.default
        if action.nargs == 0 or d is None or d is False or d == argparse.SUPPRESS:
            return False  # flags (store_true/false/const, help, version) have no value to show
        return bool(action.option_strings) or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or not self.shows_default(action):
            return text
        return text + " (default: %(default)s)"


def use_help_formatter(parser: argparse.ArgumentParser) -> None:
    """Apply :class:`HelpFormatter` to ``parser`` and every subcommand parser below it (subparsers
    do not inherit the formatter, and some register themselves from other modules)."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if action.help is None and action.option_strings and HelpFormatter.shows_default(action):
            # argparse prints nothing at all for an option without help text, default included
            action.help = "(default: %(default)s)"
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                use_help_formatter(child)


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
        help=f"benchmarks (GPU, from a source checkout): `ditfuse bench {'|'.join(BENCH_FAMILIES)}|vae|kernels`",
        description="`ditfuse bench FAMILY [args]` runs bench/bench_step.py --family FAMILY (one real-size "
        "transformer step: eager / lossless / +CUDA graph / high / torch.compile, profiler breakdown, CSV + "
        "PNG; `ditfuse bench flux --help` lists its options); `ditfuse bench vae [--model flux|flux2|qwenimage|wan|wan22]` runs "
        "bench/bench_vae.py (VAE decode); `ditfuse bench kernels [args]` runs bench/bench_kernels.py.",
    )
    b.add_argument("target", help="a model family (flux, wan), 'vae' or 'kernels'")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark script")
    b.set_defaults(func=_cmd_bench)

    from .commands import register as _register_runtime  # generate, serve (light: no torch)

    _register_runtime(sub)
    for register in _EXTRA_COMMANDS:
        register(sub)
    use_help_formatter(p)
    return p


def _register_drift(sub: argparse._SubParsersAction) -> None:
    from .drift import register  # light: drift imports torch only when it runs

    register(sub)


# Further subcommands register themselves here: callables taking the subparsers object.
_EXTRA_COMMANDS: list = [_register_drift]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The command line as given: `generate --gpus N` re-runs it under torchrun.
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
