"""Local-only protection: Host check (DNS rebinding), Origin allowlist (browser CSRF), optional bearer token.

Applied by one middleware to every route. CORS is answered only for allowed origins, echoing that one origin (never `*`).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from ..errors import LlmdError
from .responses import dialect_for_path, error_response

# Editor webviews and desktop shells that host chat panels; their origins are not http(s)://localhost.
EDITOR_SCHEMES = frozenset({"vscode-webview", "vscode-file", "vscode", "app", "tauri", "zed", "jetbrains",
                            "idea", "file+.vscode-resource"})
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
PUBLIC_PATHS = frozenset({"/health"})


def is_loopback_host(host: str) -> bool:
    """True for loopback names and addresses (also `*.localhost`, which resolves to loopback by RFC 6761)."""
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_host_header(value: str) -> str:
    """The host part of a Host header value ("[::1]:8471" -> "::1", "localhost:80" -> "localhost")."""
    value = value.strip()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        return value.rsplit(":", 1)[0]
    return value


@dataclass
class SecurityPolicy:
    api_key: str | None = None
    origins: tuple[str, ...] = ()  # extra allowed origins, exact ("https://x.example") or scheme-wide ("myeditor://")
    extra_hosts: frozenset[str] = field(default_factory=frozenset)  # the bind address when it is not loopback

    def host_allowed(self, host_header: str | None) -> bool:
        if not host_header:  # HTTP/1.0 clients; browsers always send Host, so rebinding needs one
            return True
        host = split_host_header(host_header).lower()
        return is_loopback_host(host) or host in self.extra_hosts

    def origin_allowed(self, origin: str | None) -> bool:
        if origin is None or origin == "":
            return True
        origin = origin.strip()
        if origin in self.origins:
            return True
        parts = urlsplit(origin)
        scheme = parts.scheme.lower()
        if any(o.endswith("://") and o[:-3].lower() == scheme for o in self.origins):
            return True
        if scheme in EDITOR_SCHEMES:
            return True
        if scheme in ("http", "https") and parts.hostname and is_loopback_host(parts.hostname):
            return True
        return False

    def token_ok(self, authorization: str | None) -> bool:
        if not self.api_key:
            return True
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode("utf-8"), self.api_key.encode("utf-8"))

    def request_token_ok(self, headers) -> bool:
        """The token as a bearer (every dialect) or as Anthropic's `x-api-key` header."""
        if self.token_ok(headers.get("Authorization")):
            return True
        key = headers.get("x-api-key")
        return bool(self.api_key and key) and hmac.compare_digest(key.strip().encode("utf-8"),
                                                                  self.api_key.encode("utf-8"))


def _on_unix_socket(request: web.Request) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    return sock is not None and sock.family == socket.AF_UNIX


def make_security_middleware(policy: SecurityPolicy):
    @web.middleware
    async def security(request: web.Request, handler):
        dialect = dialect_for_path(request.path)
        # DNS rebinding needs a browser on TCP; the 0600 Unix socket's clients name any host in their URLs.
        if not _on_unix_socket(request) and not policy.host_allowed(request.headers.get("Host")):
            return error_response(dialect, 403, "Host header is not a loopback name (DNS rebinding protection)",
                                  kind="permission_error")
        origin = request.headers.get("Origin")
        if not policy.origin_allowed(origin):
            return error_response(dialect, 403, f"Origin {origin!r} is not allowed (add it to LLMD_ORIGINS)",
                                  kind="permission_error")
        cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"} if origin else {}
        request["cors_headers"] = cors  # streaming responses add these before they are prepared
        if request.method == "OPTIONS" and origin:  # CORS preflight from an allowed origin
            return web.Response(status=204, headers={
                **cors,
                "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                "Access-Control-Allow-Headers": "Authorization, Content-Type, x-api-key, anthropic-version, "
                                                "anthropic-beta",
                "Access-Control-Max-Age": "600",
            })
        if request.path not in PUBLIC_PATHS and not policy.request_token_ok(request.headers):
            return error_response(dialect, 401, "missing or wrong token (Authorization: Bearer <LLMD_API_KEY>, or "
                                                "x-api-key: <LLMD_API_KEY>)",
                                  kind="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        response = await handler(request)
        if cors and not response.prepared:
            response.headers.update(cors)
        return response

    return security


def read_key_file(path: str | os.PathLike) -> str:
    """Read an API key file, refusing one that others can read (it must be 0600 or stricter)."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except OSError as exc:
        raise LlmdError(f"API key file {p}: {exc.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise LlmdError(f"API key file {p} is readable by others: chmod 600 {p}")
    key = p.read_text(encoding="utf-8").strip()
    if not key:
        raise LlmdError(f"API key file {p} is empty")
    return key
