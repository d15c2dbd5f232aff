"""`tokenspout serve` and `tokenspout fetch-model`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

from service import logs
from service.config import SETTINGS, ServeConfig, load_config

if TYPE_CHECKING:  # the server is imported only to serve (fetch-model needs none of it)
    from backend import EngineRecipe


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenspout", description="Streams LLM tokens over gRPC.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the gRPC server")
    serve.add_argument("--config", help="TOML file with settings (also TOKENSPOUT_CONFIG)")
    # Values stay text here: load_config parses every source the same way, with one-line errors.
    for name, setting in SETTINGS.items():
        flag = "--" + name.replace("_", "-")
        help_text = f"default: {setting.default!r}"
        if setting.kind is bool:  # `--flag` alone means true; `--flag false` is false
            serve.add_argument(flag, dest=name, nargs="?", const="true", default=None, help=help_text)
        else:
            serve.add_argument(flag, dest=name, default=None, help=help_text)
    commands.add_parser("fetch-model", help="fetch the embedded default model into the cache and print its path")
    return parser


def main(argv: list[str] | None = None, recipe: EngineRecipe | None = None) -> int:
    """`recipe` replaces backend.registry.MODEL_RECIPE (tests wrap the engine it builds, or serve a fake one)."""
    args = _parser().parse_args(argv)
    if args.command == "fetch-model":
        from backend import default_model_path

        logs.configure("info", "text")  # progress lines when stderr is not a terminal
        print(default_model_path())
        return 0
    try:
        config: ServeConfig = load_config(vars(args), config_file=args.config)
    except (OSError, ValueError) as exc:
        print(f"tokenspout: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.log_level, config.log_format)
    from backend import MODEL_RECIPE, EngineUnavailable, ModelError
    from service import server

    recipe = recipe or MODEL_RECIPE
    try:
        if config.engine_process:  # the engine in a process of its own, beside the front ends
            from service import supervisor

            return supervisor.supervise(config, recipe)
        return asyncio.run(server.run_in_process(config, recipe))
    except (ModelError, EngineUnavailable, server.StartupError) as exc:
        print(f"tokenspout: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
