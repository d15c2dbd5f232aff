"""`tokenspout serve` and `tokenspout fetch-model`."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import TYPE_CHECKING

from service import logs, settings_help
from service.config import ServeConfig, load_config
from service.startup import StartupError

if TYPE_CHECKING:  # the server is imported only to serve (fetch-model needs none of it)
    from backend import EngineRecipe


_SERVE_HELP = """\
Every setting is also an environment variable (TOKENSPOUT_ and its name in upper case, as
TOKENSPOUT_CONTEXT_LENGTH=4096) and a key of the TOML file (context_length = 4096). Flags win over
the environment, the environment over the file. docs/configuration.md lists the same settings."""


def _parser() -> argparse.ArgumentParser:
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser, and each command's own (to report a command's mistakes with that command's usage)."""
    parser = argparse.ArgumentParser(prog="tokenspout", description="Streams LLM tokens over gRPC.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="run the gRPC server", description=_SERVE_HELP, usage="%(prog)s [--config FILE] [--SETTING VALUE ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
    )
    serve.add_argument("--config", metavar="FILE", help="TOML file with settings (also TOKENSPOUT_CONFIG)")
    settings_help.add_setting_flags(serve)
    fetch = commands.add_parser("fetch-model", help="fetch the embedded default model into the cache and print its path")
    return parser, {"serve": serve, "fetch-model": fetch}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Arguments a command does not know are reported with that command's usage, and the flags they may mean."""
    parser, commands = _parsers()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = commands[args.command]
        known = [option for action in command._actions for option in action.option_strings]
        hints = [f"{word} (did you mean {', '.join(close)}?)" if (close := difflib.get_close_matches(word, known, 3))
                 else word for word in unknown]
        command.error(f"unrecognized arguments: {' '.join(hints)}")
    return args


def main(argv: list[str] | None = None, recipe: EngineRecipe | None = None) -> int:
    """`recipe` replaces backend.registry.MODEL_RECIPE (tests wrap the engine it builds, or serve a fake one)."""
    args = _parse(argv)
    if args.command == "fetch-model":
        from backend import default_model_path

        logs.configure("info", "text")  # progress lines when stderr is not a terminal
        print(default_model_path())
        return 0
    try:
        config: ServeConfig = load_config(vars(args), config_file=args.config)
    except (OSError, ValueError) as exc:
        return _failed(exc)
    logs.configure(config.log_level, config.log_format)
    if config.engine_process:  # the engine in a process of its own, beside the front ends
        from service import supervisor  # light: the children load gRPC and the model

        try:
            return supervisor.supervise(config, recipe)
        except StartupError as exc:
            return _failed(exc)
    return _serve_in_process(config, recipe)


def _serve_in_process(config: ServeConfig, recipe: EngineRecipe | None) -> int:
    import asyncio

    from backend import MODEL_RECIPE, EngineUnavailable, ModelError
    from service import server

    try:
        return asyncio.run(server.run_in_process(config, recipe or MODEL_RECIPE))
    except (ModelError, EngineUnavailable, StartupError) as exc:
        return _failed(exc)


def _failed(exc: Exception) -> int:
    print(f"tokenspout: {exc}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
