"""`ddserve` command line: the top of the import graph (it imports everything; nothing in
the package imports it). Bad input exits non-zero with one readable line.

ddserve engine ...          one builtin engine server            (cli.engine)
ddserve chat MESSAGE        ask a running server                 (cli.engine)
ddserve up|status|down      the Ray Serve application            (cli.serve)
ddserve reconfig ...        change the serving config safely     (cli.reconfig)
ddserve systemd ...         units for a single box               (cli.systemd)
ddserve bench ...           load benchmark against a server      (cli.bench)
ddserve --version           `ddserve <version>`
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys

from ddserve.cli import bench, engine, reconfig, serve, systemd
from ddserve.deploy import DEFAULT_CONFIG
from ddserve.errors import DDServeError, exit_code

# subcommand -> the module that parses and runs it
COMMANDS = {
    "engine": engine,
    "chat": engine,
    "up": serve,
    "status": serve,
    "down": serve,
    "reconfig": reconfig,
    "systemd": systemd,
    "bench": bench,
}


def version() -> str:
    """The installed distribution's version (what `pip show ddserve` says)."""
    try:
        return importlib.metadata.version("ddserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): `ddserve engine: error: argument
    --port: 99999 is not a port: choose 1-65535 (see ddserve engine --help)`, exit 2.
    Subcommand parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ddserve", description="DDTree speculative decoding server")
    parser.add_argument("--version", action="version", version=f"ddserve {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    engine.add_parsers(sub)
    serve.add_parsers(sub)
    reconfig.add_parsers(sub, DEFAULT_CONFIG)
    systemd.add_parsers(sub, DEFAULT_CONFIG)
    bench.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(a, "log_level", "warning").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return COMMANDS[a.command].dispatch(a)
    except DDServeError as exc:
        print(f"ddserve: error: {exc.message}", file=sys.stderr)
        return exit_code(exc)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
