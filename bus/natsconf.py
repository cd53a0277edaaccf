"""nats.conf's users block: rendered from bus/credentials.py + bus/permissions.py (pure).

The repo's nats.conf holds the dev users between BEGIN/END marker lines; a test checks that the
block equals `render_users(MeshCredentials.dev())`. A generated config (`meshnet up`, tests) is
the repo's file with that block replaced by other users: every server setting stays the same.

`python -m bus.natsconf` prints the dev block (to paste after changing permissions).
"""

from __future__ import annotations

import json
import re

from bus.credentials import Credential, MeshCredentials
from bus.permissions import Permissions

BEGIN = "# BEGIN users"
END = "# END users"
_BLOCK = re.compile(rf"^{re.escape(BEGIN)}[^\n]*\n.*?^{re.escape(END)}[^\n]*$", re.M | re.S)


class MissingUsersBlockError(ValueError):
    """A nats.conf without the BEGIN/END users markers."""


def _list(items: tuple[str, ...], indent: str = "          ") -> str:
    """A JSON-quoted list, one subject a line when there are more than two."""
    if len(items) <= 2:
        return "[" + ", ".join(json.dumps(i) for i in items) + "]"
    inner = "".join(f"{indent}  {json.dumps(i)},\n" for i in items)
    return f"[\n{inner}{indent}]"


def render_user(cred: Credential, perms: Permissions) -> str:
    """One entry of `authorization.users` (nats-server config syntax; strings JSON-quoted)."""
    publish = f"{{ allow: {_list(perms.publish)} }}" if perms.publish else '{ deny: [">"] }'  # read-only
    lines = [f"    # {perms.comment}"] if perms.comment else []
    lines += [
        "    {",
        f"      user: {json.dumps(cred.user)}",
        f"      password: {json.dumps(cred.password)}",
        "      permissions: {",
        f"        publish: {publish}",
        f"        subscribe: {{ allow: {_list(perms.subscribe)} }}",
        "      }",
        "    }",
    ]
    return "\n".join(lines)


def render_users(creds: MeshCredentials) -> str:
    """The whole users block, markers included."""
    users = "\n".join(render_user(c, p) for c, p in creds.users())
    return (
        f"{BEGIN} (rendered by bus/natsconf.py from bus/permissions.py; tests check it)\n"
        f"authorization {{\n  users = [\n{users}\n  ]\n}}\n{END}"
    )


def replace_users(conf: str, creds: MeshCredentials) -> str:
    """`conf` with its users block replaced by `creds`' users."""
    if not _BLOCK.search(conf):
        raise MissingUsersBlockError(f"no '{BEGIN}' ... '{END}' block in the nats config")
    block = render_users(creds)
    return _BLOCK.sub(lambda _m: block, conf, count=1)


def users_block(conf: str) -> str | None:
    """The users block of `conf` (markers included), or None."""
    m = _BLOCK.search(conf)
    return m.group(0) if m else None


if __name__ == "__main__":
    print(render_users(MeshCredentials.dev()))
