"""The admin token: one rule for `ddserve engine`, `ddserve up` and `ddserve reconfig`
(`read_secret` is that rule; the API key, ddserve.config.api_key, follows it too).

The token guards live changes (`POST /admin/params`, `ddserve reconfig`). It is read from the
variable a deployment names in `admin_token_env` (default DDSERVE_ADMIN_TOKEN), or from the
file named by `<VAR>_FILE` (or `ddserve engine --admin-token-file PATH`), never from the
command line, where every user of the machine could read it. A token that is set but empty
is refused at start-up: it would report the admin API as protected while an empty Bearer
passes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ddserve.errors import ConfigError

DEFAULT_ENV = "DDSERVE_ADMIN_TOKEN"


def read_admin_token(
    var: str = DEFAULT_ENV,
    *,
    file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The admin token (`read_secret`'s rule)."""
    return read_secret(var, file=file, environ=environ)


def read_secret(
    var: str,
    *,
    file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    what: str = "admin token",
    file_flag: str = "--admin-token-file",
) -> str | None:
    """The secret from `file`, else `$var`, else the file named by `$var_FILE`; None when none
    is set (no protection). ConfigError for a set-but-empty secret, an unreadable file, both
    variables set, or whitespace/control characters in it. `what` and `file_flag` name the
    secret and its file flag in the errors."""
    environ = os.environ if environ is None else environ
    file_var = var + "_FILE"
    if file is None and var in environ and file_var in environ:
        raise ConfigError(f"both {var} and {file_var} are set; set one of them")
    if file is not None:
        path, source = str(file), file_flag
    elif var in environ:
        path, source = None, var
    elif file_var in environ:
        path, source = environ[file_var], file_var
    else:
        return None
    if path is None:
        token = environ[var]
    else:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"{source}={path}: cannot read the {what} file ({exc.strerror})"
            ) from exc
    if not token.strip():
        raise ConfigError(
            f"{source} is set but the {what} is empty; set one (e.g. `openssl rand -hex 32`) or unset {source} to run without one"
        )
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in token):
        raise ConfigError(f"{source}: the {what} must not contain whitespace or control characters")
    return token
