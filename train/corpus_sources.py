"""Where the training text comes from: text every machine here has offline, one file per document.

A :class:`Source` is a named root folder and a file-name glob matched in every folder under it;
:func:`read_source` walks it in sorted path order and yields each file's text (one document) or
the reason it was left out. Three sources by default, in the order the corpus fills its cap:

- ``stdlib``: the running interpreter's standard library, ``.py`` files, test suites left out;
- ``docs``: the English documentation of Python 3.11, the reST sources that Debian's
  ``python3.11-doc`` package ships under ``usr/share/doc/python3.11/html/_sources`` (``*.rst.txt``).
  The package is not installed; :func:`docs_source` takes its ``.deb`` (unpacked by
  :func:`unpack_deb` while the corpus is built) or a folder it was unpacked into. A tree without
  the ``_sources`` folder falls back to its HTML pages, turned to text by :func:`html_to_text`;
- ``packages``: the ``.py`` files of the packages installed in the project's environment, at most
  :data:`PACKAGE_CAP_BYTES` per top-level package (files in sorted path order), so torch and
  transformers do not crowd out the rest.

A document is the file's text as it is (no header), decoded as UTF-8 (a leading byte-order mark
dropped) with ``\\r\\n`` and ``\\r`` line ends turned into ``\\n``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import subprocess
import sysconfig
import tarfile
import tempfile
from dataclasses import dataclass
from fnmatch import fnmatch
from html.parser import HTMLParser
from pathlib import Path
from typing import Iterator

from ..reference.formats.errors import UserInputError

log = logging.getLogger(__name__)

DEFAULT_DOCS_DEB = Path("/tmp/debdoc/python3.11-doc_3.11.2-6+deb12u8_all.deb")
DOCS_HTML = "usr/share/doc/python3.11/html"  # inside the unpacked python3.11-doc package
TEST_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__"})
PACKAGE_CAP_BYTES = 6 * 2**20
PACKAGE_MAX_FILE_BYTES = 512 * 2**10


@dataclass(frozen=True)
class Source:
    """Files named ``pattern`` (a file-name glob) in every folder under ``root``, minus the
    folders named in ``exclude_dirs``. ``root`` may be a ``.deb``: it is unpacked while read and
    holds documentation (:func:`docs_source` picks the folder inside). ``max_file_bytes`` skips
    larger files; ``package_cap_bytes`` caps the text taken per first path component (a
    top-level package, or a single-file module); ``html`` turns each file from HTML into text."""

    name: str
    root: Path
    pattern: str
    exclude_dirs: frozenset[str] = frozenset()
    max_file_bytes: int | None = None
    package_cap_bytes: int | None = None
    html: bool = False


@dataclass(frozen=True)
class Document:
    """One file read from a source: ``text`` is None when it was left out, ``skipped`` says why."""

    relative_path: str  # posix, relative to the source's root
    disk_bytes: int
    text: str | None
    skipped: str | None = None


def default_sources() -> list[Source]:
    """stdlib, docs, packages: the order in which the corpus's total cap fills them."""
    return [stdlib_source(), docs_source(DEFAULT_DOCS_DEB), packages_source()]


def stdlib_source(root: str | Path | None = None) -> Source:
    """The interpreter's standard library (``sysconfig``'s ``stdlib``) without its test suites
    (``test/``, ``tests/``, ``idlelib/idle_test``, ``lib2to3/tests``, ...) and ``site-packages``."""
    return Source("stdlib", Path(root or sysconfig.get_paths()["stdlib"]), "*.py",
                  exclude_dirs=TEST_DIRS | {"site-packages"})


def packages_source(root: str | Path | None = None) -> Source:
    """The environment's ``site-packages`` (``sysconfig``'s ``purelib``), capped per package."""
    return Source("packages", Path(root or sysconfig.get_paths()["purelib"]), "*.py", exclude_dirs=TEST_DIRS,
                  max_file_bytes=PACKAGE_MAX_FILE_BYTES, package_cap_bytes=PACKAGE_CAP_BYTES)


def docs_source(path: str | Path, name: str = "docs") -> Source:
    """Python's documentation from ``path``: the ``python3.11-doc`` ``.deb``, a folder it was
    unpacked into (holding ``usr/share/doc/python3.11/html``), or that ``html`` folder itself.
    Its reST sources (``_sources/**/*.txt``) when present, else its HTML pages as text."""
    path = Path(path)
    if path.suffix == ".deb":
        return Source(name, path, "*.txt")
    html = path / DOCS_HTML if (path / DOCS_HTML).is_dir() else path
    if (html / "_sources").is_dir():
        return Source(name, html / "_sources", "*.txt")
    return Source(name, html, "*.html", exclude_dirs=frozenset({"_static", "_images", "_sources"}), html=True)


def read_source(source: Source) -> Iterator[Document]:
    """Every file of ``source`` in sorted path order, read or skipped; nothing for a missing root."""
    with _unpacked(source) as source:
        if not source.root.is_dir():
            log.warning("corpus source %r: root %s is missing, skipped", source.name, source.root)
            return
        taken_per_package: dict[str, int] = {}
        for relative in _walk(source):
            path = source.root / relative
            disk_bytes = path.stat().st_size
            if source.max_file_bytes is not None and disk_bytes > source.max_file_bytes:
                yield Document(relative, disk_bytes, None, f"larger than {source.max_file_bytes} bytes")
                continue
            text, why = _read_text(path.read_bytes())
            if text is not None and source.html:
                text = html_to_text(text)
            if text is not None and not text.strip():
                text, why = None, "empty"
            if text is not None and source.package_cap_bytes is not None:
                package = relative.split("/")[0]
                size = len(text.encode("utf-8"))
                if taken_per_package.get(package, 0) + size > source.package_cap_bytes:
                    # Sorted order within a package: once one file does not fit, none after it will.
                    taken_per_package[package] = source.package_cap_bytes
                    text, why = None, f"package cap of {source.package_cap_bytes} bytes"
                else:
                    taken_per_package[package] = taken_per_package.get(package, 0) + size
            yield Document(relative, disk_bytes, text, why)


def _walk(source: Source) -> list[str]:
    found = []
    for folder, dirs, files in os.walk(source.root):  # symlinked folders are not entered
        dirs[:] = [d for d in dirs if d not in source.exclude_dirs]
        base = Path(folder).relative_to(source.root)
        found += [(base / f).as_posix() for f in files
                  if fnmatch(f, source.pattern) and (Path(folder) / f).is_file()]
    return sorted(found)


def _read_text(data: bytes) -> tuple[str | None, str | None]:
    """(text, None), or (None, why): the corpus separates documents with NUL, so none may hold one."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None, "not valid UTF-8"
    if "\x00" in text:
        return None, "contains a NUL character"
    return text.replace("\r\n", "\n").replace("\r", "\n"), None


@contextlib.contextmanager
def _unpacked(source: Source) -> Iterator[Source]:
    """``source`` itself, or for a ``.deb`` root the docs source of its tree unpacked for the while."""
    if source.root.suffix != ".deb":
        yield source
        return
    if not source.root.is_file():
        yield source  # read_source logs the missing root
        return
    with tempfile.TemporaryDirectory(prefix="dflash2-deb-") as tree:
        unpack_deb(source.root, tree)
        yield docs_source(tree, source.name)


def unpack_deb(deb: str | Path, dest: str | Path, *, use_dpkg: bool | None = None) -> None:
    """Extract the files of Debian package ``deb`` into ``dest``, as ``dpkg-deb -x`` does.
    ``use_dpkg``: None uses ``dpkg-deb`` when installed; False reads the package with the stdlib
    (an ``ar`` archive whose ``data.tar.{gz,xz,bz2}`` member holds the tree; regular files and
    folders only, links left out)."""
    deb, dest = Path(deb), Path(dest)
    dpkg = shutil.which("dpkg-deb") if use_dpkg is not False else None
    if use_dpkg and dpkg is None:
        raise UserInputError("use_dpkg=True: expected dpkg-deb on PATH")
    if dpkg:
        subprocess.run([dpkg, "-x", str(deb), str(dest)], check=True)
        return
    name, data = _deb_data_member(deb.read_bytes(), deb)
    mode = {".gz": "r:gz", ".xz": "r:xz", ".bz2": "r:bz2", ".tar": "r:"}.get(Path(name).suffix)
    if mode is None:
        raise UserInputError(f"{deb}: data member {name!r}: expected data.tar, .gz, .xz or .bz2 "
                             "(the stdlib cannot read this compression; install dpkg-deb)")
    with tarfile.open(fileobj=io.BytesIO(data), mode=mode) as tar:
        tar.extractall(dest, filter=_files_and_folders)


def _deb_data_member(archive: bytes, deb: Path) -> tuple[str, bytes]:
    """The ``data.tar*`` member of an ``ar`` archive: an 8-byte magic, then members of a 60-byte
    header (name 16, mtime 12, uid 6, gid 6, mode 8, size 10, ``\\x60\\n``) and data padded to even."""
    if not archive.startswith(b"!<arch>\n"):
        raise UserInputError(f"{deb}: expected a Debian package (an ar archive starting with '!<arch>')")
    offset = 8
    while offset + 60 <= len(archive):
        header = archive[offset:offset + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        if name.startswith("data.tar"):
            return name, archive[offset + 60:offset + 60 + size]
        offset += 60 + size + size % 2
    raise UserInputError(f"{deb}: expected a data.tar member in the package")


def _files_and_folders(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
    member = tarfile.data_filter(member, path)
    return member if member.isfile() or member.isdir() else None


class _TextOfHtml(HTMLParser):
    """Text of a page without its scripts, styles and navigation (Sphinx marks its navigation
    bars ``role="navigation"``); block elements end lines."""

    DROPPED = frozenset({"script", "style", "nav"})
    BLOCKS = frozenset({"p", "div", "section", "br", "li", "tr", "pre", "blockquote", "dt", "dd",
                        "h1", "h2", "h3", "h4", "h5", "h6", "table", "ul", "ol", "dl"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.dropping: tuple[str, int] | None = None  # (tag, nesting depth of that tag)

    def handle_starttag(self, tag, attrs):
        if self.dropping:
            if tag == self.dropping[0]:
                self.dropping = (tag, self.dropping[1] + 1)
        elif tag in self.DROPPED or ("role", "navigation") in attrs:
            self.dropping = (tag, 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if self.dropping:
            if tag == self.dropping[0]:
                depth = self.dropping[1] - 1
                self.dropping = (tag, depth) if depth else None
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.dropping:
            self.parts.append(data)


def html_to_text(html: str) -> str:
    """The readable text of an HTML page: trailing spaces cut, runs of blank lines made one."""
    parser = _TextOfHtml()
    parser.feed(html)
    parser.close()
    lines = [line.rstrip() for line in "".join(parser.parts).split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n") + "\n"
