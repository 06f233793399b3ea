"""The `hf-paged` command."""

from __future__ import annotations

import sys

USAGE = """usage: hf-paged COMMAND ...   (hf-paged COMMAND --help for its options)

  serve MODEL_DIR_OR_ID [options]
      an OpenAI-compatible server (needs: pip install 'hf-paged[serve]')
  run-batch -i REQUESTS.jsonl -o RESULTS.jsonl MODEL_DIR_OR_ID [options]
      runs a file of OpenAI batch requests offline, through the server's endpoints
      (needs: pip install 'hf-paged[serve]')"""


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    if argv[0] == "serve":
        from .serve import main as command
    elif argv[0] == "run-batch":
        from .batch import main as command
    else:
        print(f"hf-paged: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    command(argv[1:])


if __name__ == "__main__":
    main()
