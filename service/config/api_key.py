"""The API key: Bearer authentication of the inference API (`/v1/*` and the native `/generate`).

One rule with the admin token (ddserve.config.admin_token.read_secret): the key comes from the
variable a deployment names in `api_key_env` (default DDSERVE_API_KEY), from the file named by
`<VAR>_FILE`, or from `ddserve engine --api-key-file PATH`; a set-but-empty key is refused.
Never from the command line: vLLM and SGLang accept `--api-key VALUE`, but a value in argv is
readable by every user of the machine (`ps`, /proc/PID/cmdline), and the key is what keeps
them off the API. `ddserve engine --api-key` is refused with one line that names the fix.

Clients of the CLI (`ddserve chat`, `bench`, `up`, `systemd status`) send the same key,
read by the same rule (`bearer`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ddserve.config.admin_token import read_secret

DEFAULT_ENV = "DDSERVE_API_KEY"
FILE_FLAG = "--api-key-file"


def read_api_key(
    var: str = DEFAULT_ENV,
    *,
    file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The key from `file`, else `$var`, else the file `$var_FILE` names; None = no key."""
    return read_secret(var, file=file, environ=environ, what="API key", file_flag=FILE_FLAG)


def bearer(key: str | None) -> dict[str, str]:
    """Request headers that carry `key` (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def argv_refused(flag: str = "--api-key") -> str:
    """The one-line refusal of a key given on the command line."""
    return (
        f"{flag} puts the key on the command line, where every user of the machine can read it (ps); "
        f"set env {DEFAULT_ENV}, {DEFAULT_ENV}_FILE or {FILE_FLAG} PATH"
    )
