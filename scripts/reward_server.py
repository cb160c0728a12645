#!/usr/bin/env python
"""Serve any registered scorer over HTTP (GET /health, POST /score; JSON + base64 PNG, no pickle).

    python scripts/reward_server.py --scorer brightness --port 8123
    python scripts/reward_server.py --scorer pickscore --set dtype=bfloat16 --set device=cuda:0
    python scripts/reward_server.py --scorer clip_score --config '{"tiny": true}' --port 0

--set values are parsed as JSON when they parse (numbers, true, lists) and kept as strings
otherwise. Clients: reward_models.remote.RemoteScorer, or build_scorer({"name": "remote", "url": ...}).
"""

from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="one scorer setting (repeatable; wins over --config)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    parser.add_argument("--port", type=int, default=8123, help="port (0 picks a free one)")
    parser.add_argument("--max-body-mb", type=int, default=512, help="largest accepted request body")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    args = parser.parse_args(argv)

    try:
        import reward_models  # noqa: F401
    except ImportError:  # running from a checkout without an install
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from reward_models.registry import build_scorer
    from reward_models.serving import make_server

    scorer = build_scorer({"name": args.scorer, **parse_settings(args.config, args.sets)})
    server = make_server(scorer, args.host, args.port, max_body_bytes=args.max_body_mb * 2**20,
                         verbose=args.verbose)
    print(f"serving {args.scorer} (key {scorer.key}) on {server.url}", flush=True)
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
