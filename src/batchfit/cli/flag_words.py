"""A library message in the command line's words: keyword settings renamed as the flags that set them."""

from __future__ import annotations

import re
from collections.abc import Mapping

# a value as the library writes it: 'a' or 'b' (quoted, maybe a list of choices), or a bare token
_VALUE = r"('[^']*'(?: or '[^']*')*|[^\s,;:()]+)"


def as_flags(message: str, flags: Mapping[str, str]) -> str:
    """``message`` with each keyword of ``flags`` written as its flag: ``name=value`` → ``--flag value``, ``name`` → ``--flag``.

    Quotes around values are dropped (a flag's value is typed bare). Only whole names are
    renamed: a dotted config key (``trainer.world_size``) or a longer name is left alone.

    Example:
        >>> as_flags("offload='cpu' needs strategy='fsdp1' or 'fsdp2'; use offload='none'",
        ...          {"offload": "--offload", "strategy": "--sharding"})
        '--offload cpu needs --sharding fsdp1 or fsdp2; use --offload none'
    """
    for name in sorted(flags, key=len, reverse=True):
        flag = flags[name]
        message = re.sub(
            rf"(?<![\w.-]){re.escape(name)}={_VALUE}",
            lambda m, flag=flag: f"{flag} {m.group(1).replace(chr(39), '')}",
            message,
        )
        message = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w])", flag, message)
    return message
