"""Client scorer for any HTTP reward server speaking reward_models.wire (JSON + PNG, no pickle).

The transport (bounded attempts and deadline, retries with backoff and jitter, bearer token) is
reward_models.http_client.HttpClient, set by the HttpSettings keys of the config entry: HTTP 500 (the
server's scorer raised), 429, 502, 503, 504 and connection resets are retried; when the attempts run out, a
RemoteRewardError names the URL, the status and the attempts on one line, whatever on_bad_response says
(a server that keeps failing is down, not a bad answer). Here:
- a bad answer (HTTP 400 / 404 / 413, non-JSON, a Content-Type other than JSON, over max_response_bytes,
  wrong lengths, ...) raises, or with on_bad_response="nan" gives NaN rows and counts
  counters["bad_responses"];
- a health check (GET /health) runs before the first request and tells the client which prompts
  and metadata the server's scorer needs.
"""

from __future__ import annotations

import json

import torch

from .base import Scorer
from .http_client import HttpClient, HttpSettings, HTTPStatusError, RemoteRewardError
from .http_client import RETRY_STATUSES, resolve_token  # noqa: F401  (their import path before http_client)
from .registry import register, with_settings
from .wire import WireError, decode_scores, encode_request

BAD_RESPONSE_POLICIES = ("raise", "nan")


class RemoteScorer(Scorer):
    name = "remote"

    def __init__(
        self,
        url: str,
        *,
        on_bad_response: str = "raise",
        batch_size: int = 16,
        key: str | None = None,
        **http,
    ):
        """`http`: the HttpSettings fields (timeout_s, max_attempts, token, health_check, ...)."""
        super().__init__(batch_size=batch_size, key=key)
        if on_bad_response not in BAD_RESPONSE_POLICIES:
            raise ValueError(f"on_bad_response must be one of {BAD_RESPONSE_POLICIES}, got {on_bad_response!r}")
        settings = HttpSettings(url, **http)
        self.client = HttpClient(settings, counters=self.counters)
        self.url = self.client.url
        self.on_bad_response = on_bad_response
        self.health_check = settings.health_check
        self.server_info: dict | None = None
        self._server_key: str | None = None
        self._send_prompts = True

    @property
    def key(self) -> str:
        return self._key or self._server_key or self.name

    # -- transport -------------------------------------------------------------------------------

    def backoff(self, attempt: int) -> float:
        return self.client.backoff(attempt)

    def _send(self, method: str, path: str, body: bytes | None = None) -> bytes:
        return self.client.send(method, path, body)

    # -- protocol --------------------------------------------------------------------------------

    def health(self) -> dict:
        """GET /health; raises RemoteRewardError unless the server says it is ok."""
        info = self.server_info = self.client.health()
        self._server_key = info.get("key") if isinstance(info.get("key"), str) else None
        self.requires_prompts = bool(info.get("requires_prompts", False))
        self.metadata_keys = tuple(info.get("metadata_keys") or ())
        return info

    def __call__(self, images, prompts=None, metadata=None):
        if self.health_check and self.server_info is None:
            self.health()
        # No prompts travel as null, not as empty strings, so a server that needs them says so.
        self._send_prompts = prompts is not None
        return super().__call__(images, prompts, metadata)

    def score_batch(self, images, prompts, metadata):
        n = len(prompts)
        request = encode_request(images, prompts if self._send_prompts else None, metadata)
        body = json.dumps(request, allow_nan=False).encode()
        try:
            server_key, scores = decode_scores(json.loads(self._send("POST", "/score", body)), n)
            return self._rename(server_key, scores)
        except (HTTPStatusError, WireError, ValueError) as e:  # json errors are ValueErrors
            self.counters["bad_responses"] += 1
            message = f"reward server {self.url}/score gave an unusable answer: {e}"
            if self.on_bad_response == "raise":
                raise RemoteRewardError(message) from None
            return {self.key: torch.full((n,), float("nan"))}

    def _rename(self, server_key: str, scores: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Server keys -> this client's key (main score '<key>', extras '<key>/<what>')."""
        self._server_key = self._server_key or server_key
        out = {}
        for name, value in scores.items():
            if name == server_key:
                out[self.key] = value
            elif name.startswith(server_key + "/"):
                out[self.key + name[len(server_key) :]] = value
            else:
                raise WireError(f"score '{name}' is not named after the main key '{server_key}'")
        return out


@register("remote")
@with_settings(HttpSettings)
def build_remote(
    *, on_bad_response: str = "raise", batch_size: int = 16, key: str | None = None, **http
) -> RemoteScorer:
    """Any HTTP reward server speaking reward_models.wire (see scripts/reward_server.py); `token`: the
    server's bearer token, or `env:NAME` to read it from an environment variable."""
    return RemoteScorer(on_bad_response=on_bad_response, batch_size=batch_size, key=key, **http)
