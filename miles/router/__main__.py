"""Run the miles router by hand:

    export MILES_API_KEY=...   # the key the engines were started with
    python -m miles.router --port 0 --worker-url http://127.0.0.1:8001 --worker-url http://127.0.0.1:8002

Every request needs `Authorization: Bearer <key>` (the key from $MILES_API_KEY or --api-key; the router sends
the same key to the engines). Prints `MILES_ROUTER_URL=http://host:port` once serving (and writes it to `--url-file`); engines can be added
and removed at run time with `POST /add_worker` / `POST /remove_worker` ({"url": ...}).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from miles.router.router import Router, RouterConfig
from miles.utils.errors import exit_on_user_error
from miles.utils.parent_death import die_with_parent

URL_PREFIX = "MILES_ROUTER_URL="


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m miles.router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind; anything but loopback exposes the router to the network (warned)")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--worker-url", action="append", default=[], help="an engine URL (repeatable)")
    parser.add_argument("--health-check-interval", type=float, default=30.0, help="--rollout-health-check-interval")
    parser.add_argument("--health-check-timeout", type=float, default=30.0, help="--rollout-health-check-timeout")
    parser.add_argument("--health-check-first-wait", type=float, default=0.0,
                        help="--rollout-health-check-first-wait")
    parser.add_argument("--failure-threshold", type=int, default=3,
                        help="--miles-router-health-check-failure-threshold")
    parser.add_argument("--timeout", type=float, default=None, help="--miles-router-timeout (seconds per request)")
    parser.add_argument("--max-connections", type=int, default=None, help="--miles-router-max-connections")
    parser.add_argument("--max-request-bytes", type=int, default=16 << 20,
                        help="largest request body a client may send (larger: 413)")
    parser.add_argument("--connection-read-timeout", type=float, default=30.0,
                        help="seconds a client has for a request head, then for its body (slower: closed)")
    parser.add_argument("--max-client-connections", type=int, default=1024,
                        help="most open client connections (lowered to the file limit); more get 503")
    parser.add_argument("--api-key", default=None,
                        help="the run's key (prefer $MILES_API_KEY: a command line is visible to every user via ps)")
    parser.add_argument("--url-file", default=None, help="write the bound URL here once serving")
    parser.add_argument("--log-level", default="info")
    return parser


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    die_with_parent()  # first thing: a driver killed meanwhile must not leave this router behind
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s router %(levelname)s: %(message)s")
    config = RouterConfig(
        health_check_interval=args.health_check_interval,
        health_check_timeout=args.health_check_timeout,
        health_check_first_wait=args.health_check_first_wait,
        failure_threshold=args.failure_threshold,
        timeout=args.timeout,
        max_connections=args.max_connections,
        max_request_bytes=args.max_request_bytes,
        connection_read_timeout=args.connection_read_timeout,
        max_client_connections=args.max_client_connections,
    )

    async def run() -> None:
        router = Router(config, args.worker_url, api_key=args.api_key)
        url = await router.start(args.host, args.port)
        if args.url_file:
            with open(args.url_file + ".tmp", "w") as f:
                f.write(url)
            os.replace(args.url_file + ".tmp", args.url_file)
        print(URL_PREFIX + url, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await router.stop()

    asyncio.run(run())


if __name__ == "__main__":
    main()
