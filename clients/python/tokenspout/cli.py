"""`tokenspout-client`: stream, generate, tokenize and describe the server from a shell.

    tokenspout-client stream "Why is the sky blue?" --max-new-tokens 64
    tokenspout-client generate --json-schema person.json "A person:" --json
    tokenspout-client tokenize "Hello world"
    tokenspout-client info --json
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import pathlib
import sys
from typing import Any

from tokenspout.client import Client
from tokenspout.connection import Tls
from tokenspout.errors import TokenspoutError
from tokenspout.requests import GenerateOptions, Message

DEFAULT_ADDRESS = "127.0.0.1:50051"


def _json(value: Any) -> str:
    def encode(item: Any) -> Any:
        if isinstance(item, bytes):  # as protobuf's JSON mapping writes bytes
            return base64.b64encode(item).decode()
        raise TypeError(f"cannot write {type(item).__name__} as JSON")

    data = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return json.dumps(data, default=encode, ensure_ascii=False)


def _parser() -> argparse.ArgumentParser:
    # No abbreviations: `--json` after a command must not be read as that command's `--json-schema`.
    parser = argparse.ArgumentParser(prog="tokenspout-client", description="Talk to a tokenspout server.",
                                     allow_abbrev=False)
    parser.add_argument("--address", default=os.environ.get("TOKENSPOUT_ADDRESS", DEFAULT_ADDRESS),
                        help="host:port (default $TOKENSPOUT_ADDRESS or %(default)s)")
    parser.add_argument("--api-key", help="sent as a bearer token (default $TOKENSPOUT_API_KEY)")
    parser.add_argument("--tls", action="store_true", help="connect with TLS (system roots unless --ca)")
    parser.add_argument("--ca", type=pathlib.Path, help="PEM root certificates to trust (implies --tls)")
    parser.add_argument("--timeout", type=float, help="deadline of the call in seconds")
    parser.add_argument("--json", action="store_true", help="print JSON (one object per line for stream)")
    commands = parser.add_subparsers(dest="command", required=True)
    # Every command takes --json too, before or after its arguments; SUPPRESS keeps a --json given before
    # the command from being reset by the command's own default.
    json_after = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    json_after.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")

    for name, help_text in (("stream", "print the text as it is generated"), ("generate", "print the whole text")):
        command = commands.add_parser(name, help=help_text, parents=[json_after], allow_abbrev=False)
        command.add_argument("prompt")
        command.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
        command.add_argument("--system", help="a system message (implies --chat)")
        command.add_argument("--max-new-tokens", type=int)
        command.add_argument("--temperature", type=float)
        command.add_argument("--seed", type=int)
        command.add_argument("--stop", action="append", help="a stop sequence (repeatable)")
        kinds = command.add_mutually_exclusive_group()
        kinds.add_argument("--json-schema", help="a JSON Schema, inline or @file")
        kinds.add_argument("--regex")
        kinds.add_argument("--grammar", help="a Lark grammar, inline or @file")
        kinds.add_argument("--choice", action="append", dest="choices", help="an allowed output (repeatable)")

    tokenize = commands.add_parser("tokenize", help="print the token ids of a text", parents=[json_after],
                                   allow_abbrev=False)
    tokenize.add_argument("text")
    tokenize.add_argument("--chat", action="store_true", help="tokenize the text as a user chat message")
    commands.add_parser("info", help="describe the model and the server's state", parents=[json_after],
                        allow_abbrev=False)
    return parser


class UsageError(Exception):
    """A mistake in the command line found after parsing (an unreadable @file): one line, exit 2."""


def _read(path: pathlib.Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror or error}") from None


def _text_or_file(value: str | None) -> str | None:
    if value is not None and value.startswith("@"):
        return _read(pathlib.Path(value[1:])).decode()
    return value


def _generate_options(args: argparse.Namespace) -> tuple[str | None, GenerateOptions]:
    options: GenerateOptions = {}
    for name in ("max_new_tokens", "temperature", "seed", "regex", "choices"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)  # type: ignore[literal-required]
    if args.stop:
        options["stop"] = args.stop
    if args.json_schema is not None:
        options["json_schema"] = _text_or_file(args.json_schema) or ""
    if args.grammar is not None:
        options["grammar"] = _text_or_file(args.grammar) or ""
    if not (args.chat or args.system):
        return args.prompt, options
    messages = [Message("system", args.system)] if args.system else []
    options["messages"] = [*messages, Message("user", args.prompt)]
    return None, options


def _run(client: Client, args: argparse.Namespace) -> None:
    out = sys.stdout
    if args.command == "stream":
        prompt, options = _generate_options(args)
        with client.stream(prompt, **options) as stream:
            for chunk in stream:
                out.write(_json(chunk) + "\n" if args.json else chunk.text)
                out.flush()
        if not args.json:
            out.write("\n")
        if not args.json and stream.finish:
            finish = stream.finish
            usage = finish.usage.completion_tokens if finish.usage else 0
            print(f"[{finish.reason}: {usage} tokens]", file=sys.stderr)
    elif args.command == "generate":
        prompt, options = _generate_options(args)
        generation = client.generate(prompt, **options)
        print(_json(generation) if args.json else generation.text)
    elif args.command == "tokenize":
        if args.chat:
            tokens = client.tokenize(messages=[Message("user", args.text)])
        else:
            tokens = client.tokenize(args.text)
        if args.json:
            print(_json(tokens))
        else:
            for token_id, piece in zip(tokens.token_ids, tokens.pieces):
                print(f"{token_id}\t{piece.decode(errors='backslashreplace')!r}")
    else:
        info, status = client.model_info(), client.status()
        if args.json:
            print(_json({"model": dataclasses.asdict(info), "status": dataclasses.asdict(status)}))
        else:
            print(f"{info.model_id} on {info.engine} ({info.quantization}), context {info.context_length} tokens")
            print(f"running {status.running_sequences}/{status.max_batch_size}, queued {status.queued_requests}")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        tls: bool | Tls = Tls(root_certificates=_read(args.ca)) if args.ca else args.tls
        with Client(args.address, api_key=args.api_key, tls=tls, timeout=args.timeout) as client:
            _run(client, args)
    except UsageError as error:
        parser.error(str(error))
    except TokenspoutError as error:
        print(f"error: {error}", file=sys.stderr)
        for violation in error.field_violations:
            if f"{violation.field}: {violation.description}" not in str(error):
                print(f"  {violation.field}: {violation.description}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
