"""Who may use a server: the access token's rules, the refusal to serve beyond this machine without one, and the
token kept out of every log line.

Why a token in the path: Lean's client is given only `premiseSelection.apiBaseUrl`, so a token must ride in that
URL. Why these rules: a token is the only thing between a network and the indexed code, so a short one is refused
(a generated one holds 192 random bits), one with a character a URL's path cannot carry as it is would make every
path a 404, and a token file others can read is no secret.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import secrets
import stat
import string
from pathlib import Path
from urllib.parse import unquote

from leanagent.ground.json_files import KIB, read_capped

MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 1024  # far beyond any token worth its name; a URL's path carries it on every request
TOKEN_FILE_BYTES = 4 * KIB  # a token file's most: one line of a token, and room for a comment after it
GENERATED_TOKEN_BYTES = 24  # 192 random bits, 32 characters of base64url
TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + "-._~")  # RFC 3986's unreserved characters
REDACTED = "TOKEN"


class AccessError(ValueError):
    """A token or an address that cannot be used; the message is one line saying what to do."""


def new_token() -> str:
    return secrets.token_urlsafe(GENERATED_TOKEN_BYTES)


def check_token(token: str, where: str) -> str:
    """`token` when it is long enough and every character rides in a URL's path as it is; else AccessError."""
    if len(token) < MIN_TOKEN_CHARS:
        raise AccessError(f"{where}: a token of {len(token)} characters; at least {MIN_TOKEN_CHARS} are needed (a "
                          f"generated one has 32: remove the file to have one written)")
    if len(token) > MAX_TOKEN_CHARS:
        raise AccessError(f"{where}: a token of {len(token):,} characters, more than the {MAX_TOKEN_CHARS:,} a URL's "
                          f"path should carry on every request (a generated one has 32)")
    bad = next((c for c in token if c not in TOKEN_CHARS), None)
    if bad is not None:
        raise AccessError(f"{where}: the token holds {bad!r}, which a URL's path does not carry as it is; use "
                          f"letters, digits and -._~ only (a generated one does)")
    return token


def check_token_file(path: Path) -> None:
    """A token file must be a regular file that its owner alone can read (AccessError naming the chmod)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise AccessError(f"--token-file {path}: cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise AccessError(f"--token-file {path}: not a regular file")
    if st.st_mode & 0o077:
        raise AccessError(f"--token-file {path}: readable by others (mode {stat.S_IMODE(st.st_mode):03o}), so the "
                          f"token is no secret; run `chmod 600 {path}` (or remove it to have a new one written)")


def read_token_file(path: Path) -> str:
    """The token of a token file (its first line), written there first, readable by its owner alone, when the
    file does not exist."""
    if not path.exists():
        token = new_token()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise AccessError(f"--token-file {path}: cannot be created ({exc.strerror or exc})") from None
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token
    check_token_file(path)
    try:  # at most TOKEN_FILE_BYTES, the size checked on the open file first: a 1 GiB file was read whole (2 GB)
        data = read_capped(path, TOKEN_FILE_BYTES, "token file", AccessError,
                           "a token file holds one line, the token")
        lines = data.decode("utf-8").splitlines()
    except AccessError as exc:
        raise AccessError(f"--token-file {exc}") from None
    except UnicodeDecodeError as exc:
        raise AccessError(f"--token-file {path}: not UTF-8 text (byte {exc.start})") from None
    return check_token(lines[0].strip() if lines else "", f"--token-file {path}")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def require_token(host: str, token: str | None, insecure_no_token: bool) -> None:
    """Beyond this machine, a server without a token would serve anyone who reaches its port: refused before
    anything is loaded or bound, unless the user says so."""
    if token is None and not insecure_no_token and not is_loopback(host):
        raise AccessError(f"--host {host}: serving beyond this machine needs an access token: give --token-file FILE "
                          f"(a new file gets a random token) or set LEANAGENT_SERVE_TOKEN; or pass "
                          f"--insecure-no-token to serve anyone who can reach the port")


WRONG = "WRONG-TOKEN"
# A request in a log line: uvicorn's access line quotes `METHOD PATH HTTP/x`, the path as sent (percent-encoded or
# not, maybe after a scheme and host); its first segment, after any slashes (`TokenGate` skips them all), stands
# where the token goes.
_REQUEST = re.compile(r'(?P<head>"[A-Z]+ (?:[A-Za-z][A-Za-z0-9+.-]*://[^/\s"]*)?/+)(?P<segment>[^/?#\s"]*)')
_TARGET = re.compile(r'(?P<head>(?:[A-Za-z][A-Za-z0-9+.-]*://[^/\s"]*)?/+)(?P<segment>[^/?#\s"]*)')
_WORD = re.compile(r"[A-Za-z0-9%._~+-]+")  # a run of what a token, spelled in a URL, may be made of


class RedactToken(logging.Filter):
    """Keeps the token out of a log record, in any spelling: a log is read by more people than the token's file.

    In a request (uvicorn's access line has its path as sent) the first segment stands where the token goes, and it
    is replaced whatever it holds: `TOKEN` when it is the token (percent-encoded or not), `WRONG-TOKEN` when it is
    not (a token cut short by a character, or mistyped, would show nearly all of it). Anywhere else in the line, and
    in a traceback, any run of URL characters that holds the token, once percent-decoded, is `TOKEN`. A record's
    arguments stay arguments (uvicorn's access formatter reads them by position), each redacted."""

    def __init__(self, token: str) -> None:
        super().__init__()
        self.token = token

    def _segment(self, head: str, held: str) -> str:
        if not held:
            return head
        return head + (REDACTED if unquote(held).lstrip("/") == self.token else WRONG)

    def redact(self, text: str) -> str:
        """`text` with every request's first segment and every spelling of the token replaced."""
        def word(match: re.Match) -> str:
            return REDACTED if self.token in unquote(match[0]) else match[0]

        text = _REQUEST.sub(lambda m: self._segment(m["head"], m["segment"]), text)
        return _WORD.sub(word, text)

    def redact_target(self, target: str) -> str:
        """A request's target as uvicorn's access line passes it (`/SEGMENT/...`, maybe after a scheme and host)."""
        match = _TARGET.match(target)
        if match is None:
            return self.redact(target)
        return self.redact(self._segment(match["head"], match["segment"]) + target[match.end():])

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "token_redacted", False):  # a record passes the loggers' filters and the handlers'
            return True
        record.token_redacted = True
        access = record.name.startswith("uvicorn.access")
        if isinstance(record.msg, str):
            record.msg = self.redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(self._argument(a, access) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: self._argument(v, access) for k, v in record.args.items()}
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        return True

    def _argument(self, value: object, access: bool) -> object:
        if not isinstance(value, str):
            return self.redact(str(value)) if self.token in unquote(str(value)) else value
        return self.redact_target(value) if access and _TARGET.match(value) else self.redact(value)
