"""Files from and for the user: bounded reads of YAML/JSON, and writes that never harm an old file.

# NOTE [ Untrusted input files ]
A config, a model's ``config.json`` or a calibration is a few kilobytes; a file a thousand
times larger, or one whose YAML aliases expand a few hundred bytes into billions of nodes
("billion laughs"), would otherwise take minutes and gigabytes only to be refused for an
unknown key. Every file the CLI parses goes through :func:`read_text` (at most
:data:`MAX_INPUT_BYTES`) and :func:`parse_yaml` / :func:`parse_json`, which refuse, before
building anything, more than :data:`MAX_NODES` nodes once aliases are expanded, a recursive
alias, nesting deeper than :data:`MAX_DEPTH` (the OmegaConf merge recurses a few frames per
level) and integers longer than :data:`MAX_INT_DIGITS` digits (Python refuses to convert
4,300). Each refusal is an :class:`~batchfit.errors.InvalidArgument` naming the file, the limit
and the fix.

# NOTE [ Writes replace, never truncate ]
:func:`replacing` writes into a temporary file beside the target and ``os.replace``-s it in
only when the write ended: a write that fails (disk full, file-size limit, Ctrl-C) leaves the
old file as it was and no partial file behind. The file at the path is therefore either the
old one, untouched, or the new one, complete; :func:`said_on_interrupt` tells which after a
Ctrl-C (the move gives the path a new inode), for the one line the CLI prints.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchfit.errors import InvalidArgument

MAX_INPUT_BYTES = 4 * 2**20
"""Largest input file (config, model config.json, calibration) read: 4 MiB."""
MAX_NODES = 10_000
"""Most values (mappings, lists, scalars) in one input file, YAML aliases expanded."""
MAX_DEPTH = 32
"""Deepest nesting of mappings and lists in one input file (a framework config nests about 6)."""
MAX_INT_DIGITS = 64
"""Longest integer literal accepted in an input file (a count needs at most 19 digits)."""


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"


def read_text(path: str | os.PathLike[str], what: str) -> str:
    """The UTF-8 text of ``path``, refused at once when larger than :data:`MAX_INPUT_BYTES`.

    Args:
        path: the file.
        what: how messages name it, e.g. ``"config file 'a.yaml'"``.

    Raises:
        InvalidArgument: the file is missing, a directory, a pipe or a device, unreadable, too large
            or not UTF-8.
    """
    p = Path(path)
    try:
        info = p.stat()
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise InvalidArgument(f"{what} does not exist") from None
        raise InvalidArgument(f"{what} cannot be read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(info.st_mode):
        raise InvalidArgument(f"{what} is a directory; name a file")
    if not stat.S_ISREG(info.st_mode):  # /dev/zero never ends, a FIFO without a writer blocks
        raise InvalidArgument(f"{what} is not a regular file (a pipe or a device); name a file")
    if info.st_size > MAX_INPUT_BYTES:
        raise InvalidArgument(_too_large(what, info.st_size))
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_INPUT_BYTES + 1)  # a file that grew since is cut here too
    except OSError as exc:
        raise InvalidArgument(f"{what} cannot be read ({exc.strerror or exc})") from None
    if len(data) > MAX_INPUT_BYTES:
        raise InvalidArgument(_too_large(what, None))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(f"{what} is not UTF-8 text") from None


def _too_large(what: str, size: int | None) -> str:
    got = f" ({size / 2**20:.1f} MiB)" if size is not None else ""
    return (
        f"{what} is larger than {_mib(MAX_INPUT_BYTES)}{got}, far more than any config holds; "
        "name the right file (a config is a few kilobytes)"
    )


def parse_json(text: str, what: str) -> Any:
    """``json.loads(text)`` within the limits of NOTE [ Untrusted input files ].

    Raises:
        InvalidArgument: not JSON (``could not be parsed``, with line and column), an integer too long, nesting too deep
            or too many values.
    """

    def parse_int(literal: str) -> int:
        _check_digits(literal, what)
        return int(literal)

    try:
        data = json.loads(text, parse_int=parse_int)
    except RecursionError:
        raise InvalidArgument(_too_deep(what)) from None
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{what} is not valid JSON (could not be parsed: {exc})") from None
    check_tree(data, what)
    return data


def check_tree(data: Any, what: str) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH` or more than :data:`MAX_NODES` values (iteratively).

    Raises:
        InvalidArgument: naming ``what`` and the limit.
    """
    stack = [(data, 1)]
    count = 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise InvalidArgument(_too_many(what))
        if depth > MAX_DEPTH:
            raise InvalidArgument(_too_deep(what))
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def _check_digits(literal: str, what: str, line: int | None = None) -> None:
    digits = sum(c.isdigit() for c in literal)
    if digits > MAX_INT_DIGITS:
        at = f" at line {line}" if line is not None else ""
        raise InvalidArgument(
            f"{what} has an integer of {digits:,} digits{at} ({literal[:12]}...); integers of more than "
            f"{MAX_INT_DIGITS} digits are refused: write the count you mean"
        )


def _too_deep(what: str) -> str:
    return (
        f"{what} nests mappings or lists more than {MAX_DEPTH} deep; a config nests a few levels: "
        "name the right file"
    )


def _too_many(what: str) -> str:
    return (
        f"{what} holds more than {MAX_NODES:,} values (YAML aliases expanded); a config holds a few "
        "hundred: name the right file, or write repeated values out instead of through aliases"
    )


def parse_yaml(text: str, what: str) -> Any:
    """``yaml.safe_load(text)`` within the limits of NOTE [ Untrusted input files ].

    Aliases are counted as the values they stand for while the document is composed, before
    any Python object is built, so an alias bomb is refused after a few hundred nodes of work.

    Raises:
        InvalidArgument: not YAML (``could not be parsed``, with the parser's first line), a recursive alias, an
            integer too long, nesting too deep or too many values.
    """
    import yaml

    loader = None
    try:
        # the reader refuses a NUL or another control character as the loader is built
        loader = _bounded_loader()(text)
        loader.what = what
        return loader.get_single_data()
    except InvalidArgument:
        raise
    except RecursionError:
        raise InvalidArgument(_too_deep(what)) from None
    except yaml.YAMLError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, yaml.reader.ReaderError):  # its message gives a character offset, not a line
            first += f" at line {text.count(chr(10), 0, exc.position) + 1}"
        raise InvalidArgument(f"{what} is not valid YAML (could not be parsed: {first})") from None
    finally:
        if loader is not None:
            loader.dispose()


_LOADER: Any = None


def _bounded_loader() -> Any:
    """The :class:`yaml.SafeLoader` subclass that counts, bounds and refuses (built once)."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import yaml
    from yaml.events import AliasEvent

    class BoundedLoader(yaml.SafeLoader):
        what = "the YAML document"

        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self._depth = 0
            self._nodes = 0
            self._open: set[str] = set()
            self._sizes: dict[int, tuple[int, int]] = {}

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            if isinstance(event, AliasEvent):
                if event.anchor in self._open:
                    raise InvalidArgument(
                        f"{self.what} has a recursive alias *{event.anchor} (line {event.start_mark.line + 1}) "
                        f"inside its own anchor &{event.anchor}; a config value cannot contain itself"
                    )
                node = super().compose_node(parent, index)
                nodes, height = self._expanded(node)
                if self._depth + height > MAX_DEPTH:
                    raise InvalidArgument(_too_deep(self.what))
                self._count(nodes)
                return node
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise InvalidArgument(_too_deep(self.what))
            anchor = getattr(event, "anchor", None)
            if anchor is not None:
                self._open.add(anchor)
            self._count(1)
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1
                if anchor is not None:
                    self._open.discard(anchor)

        def _count(self, n: int) -> None:
            self._nodes += n
            if self._nodes > MAX_NODES:
                raise InvalidArgument(_too_many(self.what))

        def _expanded(self, node: Any) -> tuple[int, int]:
            """Values ``node`` stands for and its height, aliases expanded (memoised: linear in the nodes).

            Every node composed so far is at most :data:`MAX_DEPTH` high once expanded (each alias
            is checked where it stands), so this recursion is bounded too.
            """
            key = id(node)
            if key not in self._sizes:
                if isinstance(node, yaml.MappingNode):
                    children = [n for pair in node.value for n in pair]
                elif isinstance(node, yaml.SequenceNode):
                    children = list(node.value)
                else:
                    children = []
                total, height = 1, 0
                for child in children:
                    n, h = self._expanded(child)
                    total, height = min(total + n, MAX_NODES + 1), max(height, h)
                self._sizes[key] = (total, height + 1)
            return self._sizes[key]

        def construct_yaml_int(self, node: Any) -> int:
            _check_digits(str(node.value), self.what, node.start_mark.line + 1)
            return super().construct_yaml_int(node)

    BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)
    _LOADER = BoundedLoader
    return _LOADER


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; moved over ``path`` when the block ends without error.

    See NOTE [ Writes replace, never truncate ]. The new file keeps an existing file's
    permissions (else the umask's default); a symlink is written through. A target that
    exists and is not a regular file (``/dev/null``, a FIFO) is written directly.

    Raises:
        OSError: the folder cannot hold a new file, or the move fails (the temporary file is
            removed, ``path`` is untouched).
    """
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        yield target
        return
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=f".tmp{target.suffix}")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _mode_for(target))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _mode_for(target: Path) -> int:
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _identity(path: Path) -> tuple[int, ...] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


@contextlib.contextmanager
def said_on_interrupt(path: str | os.PathLike[str] | None, flag: str, what: str) -> Iterator[None]:
    """Ctrl-C inside the block is re-raised as a ``KeyboardInterrupt`` whose message says what ``path`` holds.

    The block writes ``path`` through :func:`replacing` (NOTE [ Writes replace, never truncate ]),
    so the path holds either the file that was there before, untouched, or the new one,
    complete; which one is read from the file itself (its inode, size and time), not from how
    far the block got. ``None`` (nothing to write) or a target that is not a regular file
    (``/dev/null``) passes the interrupt on as it was.

    Args:
        path: the file the block writes.
        flag: how messages name it, e.g. ``"--output"``.
        what: what the new file holds, e.g. ``"report"``.
    """
    target = Path(os.path.realpath(path)) if path is not None else None
    if target is not None and target.exists() and not target.is_file():
        target = None
    before = _identity(target) if target is not None else None
    try:
        yield
    except KeyboardInterrupt as exc:
        if target is None:
            raise
        named = f"{flag} {str(path)!r}"
        if _identity(target) != before:
            note = f"{named} holds the new, complete {what} (written before the interrupt)"
        elif before is None:
            note = f"{named} was not written (no file, and no partial file, is there)"
        else:
            note = f"{named} was not written: the file there before is unchanged"
        raise KeyboardInterrupt(note) from exc


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through :func:`replacing`.

    Raises:
        OSError: it cannot be written; ``path`` is then as it was.
    """
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(text)
