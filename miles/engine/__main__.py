"""Run one rollout engine by hand:

    export MILES_API_KEY=$(python -c 'import secrets; print(secrets.token_hex(32))')
    python -m miles.engine --model-path /path/to/pipeline --model-family sd3 --port 0 --device cpu --dtype fp32

The command line is generated from `ServerArgs` (one flag per field), plus `--api-key`. Every request must send
`Authorization: Bearer <key>`; the key comes from $MILES_API_KEY (preferred: a command line is visible to every
user through `ps`) or `--api-key`, and an engine without one refuses to start. Once the model is loaded and the
port bound, the engine prints `MILES_ENGINE_URL=http://host:port` on stdout (and writes the URL to
`--url-file` when given), then serves until SIGTERM / Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import types
import typing
from typing import Any

from miles.engine.server_args import ServerArgs
from miles.utils.errors import exit_on_user_error
from miles.utils.parent_death import die_with_parent

URL_PREFIX = "MILES_ENGINE_URL="


def _field_type(annotation: Any) -> tuple[type, bool]:
    """(base type, optional?) of a dataclass field annotation like `str | None`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        return members[0], True
    return annotation, False



def build_parser(dataclass_type: type = ServerArgs, prog: str = "python -m miles.engine") -> argparse.ArgumentParser:
    """One `--field-name` flag per dataclass field, typed and defaulted from the declaration."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(dataclass_type)
    for f in dataclasses.fields(dataclass_type):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        base, optional = _field_type(hints[f.name])
        if base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            parser.add_argument(flag, type=base, default=f.default, help=help_text + (" (optional)" if optional else ""))
    return parser


def parse_server_args(argv: list[str] | None = None) -> ServerArgs:
    return parse_command_line(argv)[0]


def parse_command_line(argv: list[str] | None = None) -> tuple[ServerArgs, str | None]:
    """(ServerArgs, --api-key or None). The key is kept out of ServerArgs, which is logged, pickled to Ray actors
    and turned back into a command line by `server_args_to_argv`."""
    parser = build_parser()
    parser.add_argument(
        "--api-key",
        default=None,
        help="the key clients must send as 'Authorization: Bearer <key>'. Prefer the MILES_API_KEY environment "
        "variable: a command line is visible to every user of the machine (ps)",
    )
    values = vars(parser.parse_args(argv))
    api_key = values.pop("api_key")
    return ServerArgs(**values), api_key


def server_args_to_argv(server_args: ServerArgs) -> list[str]:
    """The inverse of `parse_server_args`: the flags that reproduce `server_args` (used to spawn engines)."""
    argv: list[str] = []
    for f in dataclasses.fields(ServerArgs):
        value = getattr(server_args, f.name)
        if value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + f.name.replace("_", "-"))
        else:
            argv.extend([flag, str(value)])
    return argv


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    die_with_parent()  # before the heavy imports: a driver killed meanwhile must not leave this process behind
    server_args, api_key = parse_command_line(argv)
    logging.basicConfig(
        level=server_args.log_level.upper(), format="%(asctime)s engine %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from miles.engine.server import serve_forever

    def on_ready(url: str) -> None:
        if server_args.url_file:
            tmp = server_args.url_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(url)
            os.replace(tmp, server_args.url_file)  # atomic: a watcher never reads half a URL
        print(URL_PREFIX + url, flush=True)

    async def run() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await serve_forever(server_args, on_ready, api_key=api_key)
        except asyncio.CancelledError:
            pass

    asyncio.run(run())
    sys.exit(0)


if __name__ == "__main__":
    main()
