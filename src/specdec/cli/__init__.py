"""`specdec` command line: one module per command group."""

from __future__ import annotations

import argparse
import os
import sys

from .. import store
from ..data import DataNotInstalledError
from . import bench, certify, generate, models, serve, training
from .common import add_drafter_options, drafter_options

__all__ = ["add_drafter_options", "build_parser", "drafter_options", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.parser(sub)
    models.parser(sub)
    bench.parser(sub)
    training.data_parser(sub)
    training.train_parser(sub)
    training.export_parser(sub)
    serve.parser(sub)
    certify.parser(sub)
    models.info_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    ns.argv = list(argv) if argv is not None else sys.argv[1:]  # as typed (records name their command)
    try:
        return int(ns.func(ns) or 0)
    except (ValueError, OSError, store.ModelNotInstalledError, store.ChecksumError, DataNotInstalledError) as exc:
        # Our errors name the problem and the fix; a traceback would only bury that. (OSError:
        # a missing or unwritable path, a full disk: the message names the path.)
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            ("\r\033[K" if sys.stderr.isatty() else "") + "specdec: interrupted", file=sys.stderr
        )  # (over a progress line)
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug: one line for the user, the traceback on request
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        print(
            f"specdec: internal error: {type(exc).__name__}: {exc}. This is a bug in specdec; rerun with "
            "SPECDEC_DEBUG=1 to see where, and report it.",
            file=sys.stderr,
        )
        return 1
