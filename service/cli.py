"""`tokenspout serve` and `tokenspout fetch-model`."""

from __future__ import annotations

import argparse
import asyncio
import sys

from service import logs
from service.config import FIELDS, ServeConfig, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenspout", description="Streams LLM tokens over gRPC.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the gRPC server")
    serve.add_argument("--config", help="TOML file with settings (also TOKENSPOUT_CONFIG)")
    for name, field in FIELDS.items():
        flag = "--" + name.replace("_", "-")
        serve.add_argument(flag, dest=name, type=type(field.default), default=None, help=f"default: {field.default!r}")
    commands.add_parser("fetch-model", help="fetch the embedded default model into the cache and print its path")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "fetch-model":
        from backend.models import default_model_path

        print(default_model_path())
        return 0
    try:
        config: ServeConfig = load_config(vars(args), config_file=args.config)
    except (OSError, ValueError) as exc:
        print(f"tokenspout: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.log_level, config.log_format)
    from backend.engine import EngineUnavailable
    from backend.models import ModelNotFound
    from service import server

    try:
        return asyncio.run(server.run(config))
    except (ModelNotFound, EngineUnavailable) as exc:
        print(f"tokenspout: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
