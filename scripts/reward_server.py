#!/usr/bin/env python
"""Serve any registered scorer over HTTP (GET /health, POST /score; JSON + base64 PNG, no pickle).

    python scripts/reward_server.py --scorer brightness --port 8123
    python scripts/reward_server.py --scorer pickscore --set dtype=bfloat16 --set device=cuda:0
    python scripts/reward_server.py --scorer clip_score --config '{"tiny": true}' --port 0

--set values are parsed as JSON when they parse (numbers, true, lists) and kept as strings
otherwise. Clients: reward_models.remote.RemoteScorer, or build_scorer({"name": "remote", "url": ...}).

Beyond this machine, only with a token: `--host 0.0.0.0` is refused unless a bearer token is set
(`--token` or the FLOWGRPO_REWARD_TOKEN environment variable; clients send it with `token: env:NAME`).
    FLOWGRPO_REWARD_TOKEN=$(openssl rand -hex 16) python scripts/reward_server.py --scorer pickscore --host 0.0.0.0
Limits (each a flag): pixels per image and per request, body size, header / body / idle timeouts, open connections.
Request bodies are application/json only (415 otherwise), with a Content-Length (411 without, 400 if invalid).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def parse_settings(config: str | None, sets: list[str]) -> dict:
    settings = json.loads(config) if config else {}
    if not isinstance(settings, dict):
        raise SystemExit("--config must be a JSON object")
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        try:
            settings[key] = json.loads(value)
        except ValueError:
            settings[key] = value
    return settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scorer", required=True, help="registered scorer name, e.g. brightness, pickscore")
    parser.add_argument("--config", help="scorer settings as a JSON object")
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one scorer setting (repeatable; wins over --config)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    parser.add_argument("--port", type=int, default=8123, help="port (0 picks a free one)")
    parser.add_argument(
        "--max-body-mb",
        type=int,
        default=512,
        help="largest accepted request body, in MiB (413 from its Content-Length, before any of it is read)",
    )
    parser.add_argument(
        "--max-megapixels",
        type=float,
        default=16.8,
        help="largest image, in millions of pixels, read from the PNG header (413 above it)",
    )
    parser.add_argument(
        "--max-request-megapixels",
        type=float,
        default=67.2,
        help="all images of one request together, in millions of pixels, summed from the PNG headers before "
        "decoding any (413 above it; a client's batch_size x height x width must fit)",
    )
    parser.add_argument("--header-timeout", type=float, default=10.0, help="seconds for request line + headers")
    parser.add_argument("--body-timeout", type=float, default=120.0, help="seconds for a whole request body")
    parser.add_argument("--idle-timeout", type=float, default=30.0, help="seconds of silence before closing")
    parser.add_argument("--max-connections", type=int, default=64, help="open connections (503 above it)")
    parser.add_argument(
        "--token", default=None, help="require `Authorization: Bearer TOKEN` (default: $FLOWGRPO_REWARD_TOKEN if set)"
    )
    parser.add_argument("--verbose", action="store_true", help="log every request")
    args = parser.parse_args(argv)
    token = args.token or os.environ.get("FLOWGRPO_REWARD_TOKEN") or None

    try:
        import reward_models  # noqa: F401
    except ImportError:  # running from a checkout without an install
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from reward_models.registry import build_scorer
    from reward_models.serving import ServerLimits, is_loopback, make_server

    if not is_loopback(args.host) and token is None:  # before the scorer loads (the server checks it too)
        parser.error(f"--host {args.host} serves beyond this machine: set a token (--token or FLOWGRPO_REWARD_TOKEN)")

    limits = ServerLimits(
        max_body_bytes=args.max_body_mb * 2**20,
        max_pixels=int(args.max_megapixels * 1e6),
        max_request_pixels=int(args.max_request_megapixels * 1e6),
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        idle_timeout_s=args.idle_timeout,
        max_connections=args.max_connections,
    )
    scorer = build_scorer({"name": args.scorer, **parse_settings(args.config, args.sets)})
    server = make_server(scorer, args.host, args.port, limits=limits, token=token, verbose=args.verbose)
    print(
        f"serving {args.scorer} (key {scorer.key}) on {server.url}{' (bearer token required)' if token else ''}",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        scorer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
