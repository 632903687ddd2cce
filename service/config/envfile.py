"""The EnvironmentFile of a systemd-run engine: one `DDSERVE_*` variable per EngineConfig field.

    # written by ddserve reconfig 20250101-abc; fingerprint fp_0123456789
    DDSERVE_MODEL=smollm2-135m
    DDSERVE_DRAFT_MODEL='/srv/models/draft 0.5b.gguf'
    DDSERVE_SGLANG=
    ...
    DDSERVE_HOST=127.0.0.1          # lines ddserve does not own are kept as they are

Every field is written (None as an empty value, which `ddserve engine` reads as unset), so
the file alone says what the engine serves and a later default never shifts it. Values are
quoted the way systemd reads them (bare when plain, else single quotes, else double quotes with
`\\` escapes); a value with a newline or another control character is refused, since it would
start a new assignment (`LD_PRELOAD=...`). `parse_env_file` reads the file back as systemd does.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ddserve.config.engine import EngineConfig
from ddserve.config.flags import ALIAS_VARS, ENGINE_FIELDS, config_environ
from ddserve.errors import ConfigError

_BARE = re.compile(r"[A-Za-z0-9_.,:/@%+=-]*")
_DQ_ESCAPE = re.compile(r'(["\\`$])')
CONFIG_VARS = {s.env for s in ENGINE_FIELDS}


def _has_control(text: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)


def quote(value: str) -> str:
    """`value` as systemd's EnvironmentFile parser will give it back."""
    if _BARE.fullmatch(value):
        return value
    if "'" not in value:
        return f"'{value}'"
    return '"' + _DQ_ESCAPE.sub(r"\\\1", value) + '"'


def env_lines(cfg: EngineConfig) -> list[str]:
    """`VAR=value` for every field of `cfg`; ConfigError (naming the field) for a value that
    cannot sit on one line."""
    by_env = {s.env: s for s in ENGINE_FIELDS}
    lines = []
    for env, value in config_environ(cfg).items():
        if _has_control(value):
            raise ConfigError(
                f"{by_env[env].path}={value!r}: a value written to an EnvironmentFile must not contain newlines or other control characters",
                param=by_env[env].path,
            )
        lines.append(f"{env}={quote(value)}")
    return lines


def env_file_text(cfg: EngineConfig, note: str = "", keep: list[str] | None = None) -> str:
    """The EnvironmentFile for `cfg`; `keep` are lines of other variables carried over."""
    note = "".join(c for c in note if not _has_control(c))
    header = f"# written by ddserve reconfig{(' ' + note) if note else ''}; fingerprint {cfg.fingerprint()}"
    return "\n".join([header, *env_lines(cfg), *(keep or [])]) + "\n"


def parse_env_file(text: str) -> dict[str, str]:
    """Variables of an EnvironmentFile, unquoted like systemd does (comments start with # or ;)."""
    out = {}
    for line in text.splitlines():
        s = line.lstrip()
        if not s or s[0] in "#;" or "=" not in s:
            continue
        key, _, rest = s.partition("=")
        out[key.strip()] = _unquote(rest)
    return out


def _unquote(s: str) -> str:
    """systemd's value rules: leading blanks skipped; '...' literal; "..." with \\ escapes of
    " \\ ` $; unquoted text keeps quotes literally, drops trailing blanks, `\\x` is x."""
    out: list[str] = []
    i, n, bare = 0, len(s), False
    while i < n:
        c = s[i]
        if not bare and c.isspace():
            i += 1
        elif not bare and c == "'":
            j = s.find("'", i + 1)
            j = n if j < 0 else j  # unterminated: to the end
            out.append(s[i + 1 : j])
            i = j + 1
        elif not bare and c == '"':
            i += 1
            while i < n and s[i] != '"':
                if s[i] == "\\" and i + 1 < n:
                    i += 1
                    out.append(s[i] if s[i] in '"\\`$' else "\\" + s[i])
                else:
                    out.append(s[i])
                i += 1
            i += 1
        else:
            bare = True
            if c == "\\" and i + 1 < n:
                i += 1
            out.append(s[i])
            i += 1
    text = "".join(out)
    return text.rstrip() if bare else text


def read_env_file(path: str | Path) -> dict[str, str]:
    return parse_env_file(Path(path).read_text())


def write_env_file(path: str | Path, cfg: EngineConfig, note: str = "") -> None:
    """Rewrite the config variables of the file at `path` (atomically; its mode kept, 0600
    for a new file): lines of other variables (DDSERVE_HOST, DDSERVE_ADMIN_TOKEN, ...) stay;
    lines of a flag alias's variable (DDSERVE_SERVED_NAME) go, their value now in the
    field's own variable."""
    path = Path(path)
    keep: list[str] = []
    mode = 0o600
    if path.exists():
        mode = path.stat().st_mode & 0o777
        for line in path.read_text().splitlines():
            s = line.lstrip()
            if s.startswith("# written by ddserve"):
                continue
            if s.partition("=")[0].strip() not in CONFIG_VARS | ALIAS_VARS:
                keep.append(line)
    text = env_file_text(cfg, note, keep)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
