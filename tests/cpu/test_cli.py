"""The command line as a new user meets it: --help shows defaults, the kernel table fits the
terminal, the README documents every subcommand, the package metadata builds without warnings."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ditfuse.runtime import cli

ROOT = Path(__file__).resolve().parents[2]


def _help(*argv: str) -> str:
    parser = cli.build_parser()
    for name in argv:  # walk down to the subcommand's parser
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = sub.choices[name]
    return parser.format_help()


@pytest.mark.parametrize(
    "argv,needles",
    [
        (("serve",), ["--port PORT           TCP port (default: 30000)", "(default: 4)", "(default: 256)", "(default: lossless)"]),
        (("generate",), ["denoising steps (default: the pipeline's: FLUX.1 / SD3 28,", "(default: the pipeline's: FLUX.1 3.5, SD3 7.0,", "seed + i (default: 0)", "(default: tiny-flux)"]),
    ],
)
def test_help_shows_defaults(argv, needles):
    # argparse re-wraps with the terminal width (and may break after a hyphen)
    text = re.sub(r"-\s+", "-", " ".join(_help(*argv).split()))
    for needle in needles:
        assert " ".join(needle.split()) in text, needle


def test_help_does_not_repeat_a_default_the_text_already_gives_or_show_none():
    text = " ".join(_help("serve").split())
    assert "(default: cuda if available)" in text and "(default: None)" not in text
    assert "(default: False)" not in text  # flags
    assert "available) (default:" not in text  # no second default after the text's own


def test_every_subcommand_parser_uses_the_defaults_formatter():
    seen = []

    def walk(parser):
        assert parser.formatter_class is cli.HelpFormatter, parser.prog
        seen.append(parser.prog)
        for a in parser._actions:
            if a.__class__.__name__ == "_SubParsersAction":
                for child in a.choices.values():
                    walk(child)

    walk(cli.build_parser())
    assert {"ditfuse drift", "ditfuse bench", "ditfuse serve"} <= set(seen)


def test_bench_script_help_shows_defaults(capsys):
    """`ditfuse bench flux --help` is bench/bench_step.py's parser: defaults shown too."""
    assert cli.main(["bench", "flux", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--family" in out and "(default: flux)" in out and "(default: 10)" in out


def test_bench_vae_is_the_vae_decode_benchmark(capsys):
    assert cli.main(["bench", "vae", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--model" in out and "{flux,flux2,qwenimage,wan,wan22}" in out and "--frames" in out


def test_bench_unknown_target_lists_the_targets(capsys):
    assert cli.main(["bench", "sdxl"]) == 2
    err = capsys.readouterr().err
    assert "unknown bench target 'sdxl'" in err and "vae" in err and "flux" in err and "wan" in err


def _rows():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["kernels", "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("width", [80, 100, 160])
def test_kernel_table_fits_the_terminal_and_keeps_op_names_whole(width, capsys):
    rows = _rows()
    cli.print_kernel_table(rows, width=width)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= width
    for r in rows:
        assert r["op"] in out  # never wrapped
        # every word of the long cells is there (wrapped, not cut)
        for word in r["replaces"].split():
            assert word in out, (r["op"], word)
    assert "replaces" in out and "contract" in out


def test_kernel_json_is_unchanged_for_machines():
    rows = _rows()
    assert rows and all(set(r) == {"op", "domain", "backend", "contract", "capabilities", "replaces", "summary", "target"} for r in rows)


def test_readme_documents_every_subcommand_and_the_test_commands():
    readme = (ROOT / "README.md").read_text()
    sub = next(a for a in cli.build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in sub.choices:
        assert f"ditfuse {name}" in readme, name
    assert "make test-quick" in readme and "make test" in readme


def test_package_metadata_builds_without_deprecation_warnings(tmp_path):
    """``project.license`` as a table made setuptools print a deprecation banner on every install."""
    code = (
        "import warnings, sys; warnings.simplefilter('error', DeprecationWarning)\n"
        "from setuptools import build_meta\n"
        f"build_meta.prepare_metadata_for_build_wheel({str(tmp_path)!r})\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Deprecat" not in r.stderr, r.stderr[-3000:]
    meta = next(tmp_path.glob("*.dist-info")) / "METADATA"
    assert "License-Expression: Apache-2.0" in meta.read_text()


def test_model_help_lists_every_preset_by_what_it_makes():
    from ditfuse.runtime.commands import MODEL_HELP
    from ditfuse.runtime.presets import PRESET_TABLE

    for name, p in PRESET_TABLE.items():
        assert f" {name}," in MODEL_HELP or f" {name};" in MODEL_HELP or f" {name})" in MODEL_HELP, name
    assert "videos from an image: tiny-wan-i2v" in MODEL_HELP and "images or edits: tiny-flux-kontext" in MODEL_HELP


def test_bench_help_names_every_family():
    """The bench subcommand's help lists every model family a step benchmark exists for."""
    from ditfuse.models import families

    assert set(cli.BENCH_FAMILIES) == set(families.names())
