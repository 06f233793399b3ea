"""The `hf-paged` command."""

from __future__ import annotations

import sys

USAGE = """usage: hf-paged serve MODEL_DIR_OR_ID [options]   (hf-paged serve --help for options)

  serve   an OpenAI-compatible server (needs: pip install 'hf-paged[serve]')"""


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    if argv[0] != "serve":
        print(f"hf-paged: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    from .serve import main as serve

    serve(argv[1:])
