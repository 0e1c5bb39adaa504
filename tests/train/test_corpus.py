"""The corpus stage on fake sources: what each source takes and skips, the by-file split, the
shards' round trip and size limit, the manifest's checks, the .deb unpacking and the HTML fallback."""

from __future__ import annotations

import hashlib
import logging
import lzma
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from dflash2.train.corpus import CorpusError, build_corpus, is_heldout, iter_documents, read_manifest
from dflash2.train.corpus_sources import (PACKAGE_CAP_BYTES, 
    DOCS_HTML, Source, default_sources, docs_source, html_to_text, packages_source, read_source, stdlib_source,
    unpack_deb)

needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb is not installed")


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)
    return path


def module_text(i: int) -> str:
    return f'"""Module {i}."""\n\n\ndef f{i}(x):\n    return x * {i} + {i * i}\n'


@pytest.fixture
def lib(tmp_path) -> Path:
    """A fake standard library: 30 modules, plus every kind of file the source must leave out."""
    root = tmp_path / "lib"
    for i in range(30):
        write(root / ("pkg" if i % 3 else "") / f"mod{i:02d}.py", module_text(i))
    write(root / "test" / "test_a.py", "excluded = 1\n")
    write(root / "pkg" / "tests" / "test_b.py", "excluded = 2\n")
    write(root / "idlelib" / "idle_test" / "test_c.py", "excluded = 3\n")
    write(root / "__pycache__" / "cached.py", "excluded = 4\n")
    write(root / "site-packages" / "other.py", "excluded = 5\n")
    write(root / "README.txt", "not a .py file\n")
    write(root / "latin1.py", "caf\xe9 = 1\n".encode("latin-1"))
    write(root / "nul.py", "a = '\x00'\n")
    write(root / "empty.py", "\n\n")
    write(root / "crlf.py", "a = 1\r\nb = 2\rc = 3\n")
    return root


def test_source_reads_sorted_files_and_says_why_it_skips(lib):
    docs = list(read_source(stdlib_source(lib)))
    assert [d.relative_path for d in docs] == sorted(d.relative_path for d in docs)
    taken = {d.relative_path: d.text for d in docs if d.text is not None}
    skipped = {d.relative_path: d.skipped for d in docs if d.text is None}
    assert skipped == {"latin1.py": "not valid UTF-8", "nul.py": "contains a NUL character", "empty.py": "empty"}
    assert taken["crlf.py"] == "a = 1\nb = 2\nc = 3\n"
    assert taken["mod00.py"] == module_text(0)  # raw text, no header
    assert len(taken) == 31 and not any("test" in p or "site-packages" in p for p in taken)


def test_build_round_trips_every_document_into_one_split(lib, tmp_path):
    manifest = build_corpus(tmp_path / "out", sources=[stdlib_source(lib)], heldout_percent=20)
    expected = {f"stdlib/{d.relative_path}": d.text for d in read_source(stdlib_source(lib)) if d.text is not None}
    heldout = set(manifest.heldout_files)
    assert heldout == {key for key in expected if is_heldout("stdlib", key.split("/", 1)[1], 20)}
    assert 0 < len(heldout) < len(expected)
    assert list(iter_documents(tmp_path / "out", "heldout")) == [expected[k] for k in expected if k in heldout]
    assert list(iter_documents(tmp_path / "out", "train")) == [expected[k] for k in expected if k not in heldout]
    stats = manifest.sources[0]
    assert (stats.files, stats.bytes) == (31, sum(len(t.encode()) for t in expected.values()))
    assert stats.skipped == {"not valid UTF-8": 1, "contains a NUL character": 1, "empty": 1}
    assert manifest.splits["heldout"].docs == len(heldout)
    assert read_manifest(tmp_path / "out") == manifest


def test_split_is_a_stable_hash_of_the_file_name():
    key = "stdlib/os.py"
    bucket = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100
    assert is_heldout("stdlib", "os.py", bucket + 1) and not is_heldout("stdlib", "os.py", bucket)
    assert not is_heldout("stdlib", "os.py", 0) and is_heldout("stdlib", "os.py", 100)
    # The same relative path in another source is another file, decided on its own.
    buckets = {int(hashlib.sha256(f"{s}/os.py".encode()).hexdigest(), 16) % 100 for s in ("a", "b", "c", "d")}
    assert len(buckets) > 1


def test_build_is_deterministic_and_a_file_keeps_its_split_when_others_change(lib, tmp_path):
    first = build_corpus(tmp_path / "a", sources=[stdlib_source(lib)], heldout_percent=20)
    second = build_corpus(tmp_path / "b", sources=[stdlib_source(lib)], heldout_percent=20)
    assert (tmp_path / "a" / "manifest.json").read_bytes() == (tmp_path / "b" / "manifest.json").read_bytes()
    assert first == second
    for i in range(30, 60):
        write(lib / f"extra{i}.py", module_text(i))
    grown = build_corpus(tmp_path / "c", sources=[stdlib_source(lib)], heldout_percent=20)
    assert set(first.heldout_files) == {k for k in grown.heldout_files if "/extra" not in k}


def test_small_shards_stay_under_the_limit_and_join_documents_with_nul(lib, tmp_path):
    for i in range(200):  # hex digests: text that compresses only about 2:1
        write(lib / "many" / f"m{i:03d}.py", "".join(f"h = '{hashlib.sha256(f'{i} {j}'.encode()).hexdigest()}'\n"
                                                     for j in range(1 + i % 7)))
    manifest = build_corpus(tmp_path / "out", sources=[stdlib_source(lib)], heldout_percent=0, shard_bytes=3000)
    shards = manifest.splits["train"].shards
    assert len(shards) > 3 and manifest.splits["heldout"].shards == []
    assert [s.name for s in shards] == [f"train-{i:03d}.txt.xz" for i in range(len(shards))]
    streams = []
    for shard in shards:
        data = (tmp_path / "out" / shard.name).read_bytes()
        assert len(data) == shard.bytes <= 3000
        assert hashlib.sha256(data).hexdigest() == shard.sha256
        streams.append(lzma.decompress(data).decode())
    docs = [d.text for d in read_source(stdlib_source(lib)) if d.text is not None]
    assert "\x00".join(streams) == "\x00".join(docs)
    assert sum(s.docs for s in shards) == len(docs) == manifest.splits["train"].docs


def test_a_corrupted_shard_is_named(lib, tmp_path):
    build_corpus(tmp_path / "out", sources=[stdlib_source(lib)], heldout_percent=0)
    shard = tmp_path / "out" / "train-000.txt.xz"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CorpusError, match="train-000.txt.xz.*sha256"):
        next(iter_documents(tmp_path / "out", "train"))
    shard.unlink()
    with pytest.raises(CorpusError, match="train-000.txt.xz.*missing"):
        next(iter_documents(tmp_path / "out", "train"))
    with pytest.raises(CorpusError, match="manifest.json"):
        next(iter_documents(tmp_path / "nowhere", "train"))


def test_total_cap_cuts_the_rest_in_source_order(lib, tmp_path):
    other = tmp_path / "other"
    for i in range(5):
        write(other / f"o{i}.py", module_text(i))
    sources = [stdlib_source(lib), Source("other", other, "*.py")]
    full = build_corpus(tmp_path / "full", sources=sources)
    cap = full.sources[0].bytes - 1
    cut = build_corpus(tmp_path / "cut", sources=sources, max_bytes=cap)
    lib_stats, other_stats = cut.sources
    assert lib_stats.files == 30 and lib_stats.cut_files == 1 and lib_stats.bytes <= cap
    assert other_stats.files == 0 and other_stats.cut_files == 5
    assert cut.cut == "stdlib/pkg/mod29.py"  # the last file in sorted order is the first cut


def test_packages_are_capped_per_top_level_package(tmp_path):
    root = tmp_path / "site-packages"
    for i in range(6):
        write(root / "big" / f"m{i}.py", "x = 1\n" * 10)  # 60 bytes each
    write(root / "big" / "tests" / "test_m.py", "y = 1\n")
    write(root / "small" / "__init__.py", "z = 1\n")
    write(root / "single.py", "w = 1\n")
    write(root / "small" / "huge.py", "h = 1\n" * 1000)
    source = Source("packages", root, "*.py", exclude_dirs=packages_source(root).exclude_dirs,
                    max_file_bytes=1000, package_cap_bytes=200)
    docs = {d.relative_path: d.skipped for d in read_source(source)}
    assert docs == {**{f"big/m{i}.py": None for i in range(3)},
                    **{f"big/m{i}.py": "package cap of 200 bytes" for i in range(3, 6)},
                    "single.py": None, "small/__init__.py": None, "small/huge.py": "larger than 1000 bytes"}


def test_missing_roots_are_skipped_with_a_log_line(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        manifest = build_corpus(tmp_path / "out", sources=[Source("gone", tmp_path / "nope", "*.py"),
                                                           docs_source(tmp_path / "nope.deb")])
    assert [s.files for s in manifest.sources] == [0, 0]
    assert "'gone'" in caplog.text and "nope.deb" in caplog.text
    assert list(iter_documents(tmp_path / "out", "train")) == []


def test_default_sources_read_this_interpreter_in_cap_order():
    stdlib, docs, packages = default_sources()
    assert [stdlib.name, docs.name, packages.name] == ["stdlib", "docs", "packages"]
    assert stdlib.root == Path(sysconfig.get_paths()["stdlib"]) and {"test", "tests", "idle_test"} <= stdlib.exclude_dirs
    assert packages.root == Path(sysconfig.get_paths()["purelib"]) and packages.package_cap_bytes == PACKAGE_CAP_BYTES
    assert docs.root.suffix == ".deb"


# --- documentation: .deb packages and HTML -------------------------------------------------------


def make_deb(tmp_path: Path, files: dict[str, str]) -> Path:
    tree = tmp_path / "debtree"
    write(tree / "DEBIAN" / "control", "Package: fake-doc\nVersion: 1.0\nArchitecture: all\n"
          "Maintainer: Nobody <nobody@example.com>\nDescription: fake documentation\n")
    for name, text in files.items():
        write(tree / name, text)
    (tree / "usr" / "share" / "doc" / "link").symlink_to("python3.11")
    deb = tmp_path / "fake-doc.deb"
    subprocess.run(["dpkg-deb", "-Zxz", "--root-owner-group", "-b", str(tree), str(deb)], check=True,
                   capture_output=True)
    return deb


DOC_FILES = {f"{DOCS_HTML}/_sources/library/os.rst.txt": ":mod:`os` --- Miscellaneous\n=====\n",
             f"{DOCS_HTML}/_sources/tutorial/index.rst.txt": "The Python Tutorial\n*******\n",
             f"{DOCS_HTML}/library/os.html": "<html><body><p>os</p></body></html>\n"}


@needs_dpkg
def test_deb_unpacks_the_same_with_dpkg_and_with_the_stdlib(tmp_path):
    deb = make_deb(tmp_path, DOC_FILES)
    unpack_deb(deb, tmp_path / "dpkg", use_dpkg=True)
    unpack_deb(deb, tmp_path / "stdlib", use_dpkg=False)
    for name, text in DOC_FILES.items():
        assert (tmp_path / "dpkg" / name).read_text() == (tmp_path / "stdlib" / name).read_text() == text
    assert not (tmp_path / "stdlib" / "usr/share/doc/link").exists()  # links left out by the stdlib reader


@needs_dpkg
def test_docs_from_a_deb_are_its_rest_sources(tmp_path):
    deb = make_deb(tmp_path, DOC_FILES)
    manifest = build_corpus(tmp_path / "out", sources=[docs_source(deb)], heldout_percent=0)
    assert (manifest.sources[0].files, manifest.sources[0].root) == (2, str(deb))
    assert list(iter_documents(tmp_path / "out", "train")) == [DOC_FILES[f"{DOCS_HTML}/_sources/library/os.rst.txt"],
                                                               DOC_FILES[f"{DOCS_HTML}/_sources/tutorial/index.rst.txt"]]


def test_deb_reader_refuses_what_is_not_a_package(tmp_path):
    with pytest.raises(ValueError, match="ar archive"):
        unpack_deb(write(tmp_path / "x.deb", b"not a package"), tmp_path / "dest", use_dpkg=False)


def test_an_unpacked_folder_gives_its_sources_and_a_tree_without_them_its_html(tmp_path):
    for name, text in DOC_FILES.items():
        write(tmp_path / "tree" / name, text)
    assert docs_source(tmp_path / "tree") == Source("docs", tmp_path / "tree" / DOCS_HTML / "_sources", "*.txt")
    shutil.rmtree(tmp_path / "tree" / DOCS_HTML / "_sources")
    write(tmp_path / "tree" / DOCS_HTML / "_static" / "x.html", "<p>static</p>")
    source = docs_source(tmp_path / "tree")
    assert source.html and source.root == tmp_path / "tree" / DOCS_HTML
    assert [(d.relative_path, d.text) for d in read_source(source)] == [("library/os.html", "os\n")]


def test_html_to_text_drops_scripts_styles_and_navigation():
    page = """<html><head><style>p { color: red }</style><script>var x = "<p>";</script></head><body>
    <div class="related" role="navigation"><ul><li><div>index</div></li></ul></div>
    <nav>menu</nav>
    <h1>os &mdash; Operating system interfaces</h1><p>Use <code>os.path</code>.</p>
    <pre>x = 1
    y = 2</pre></body></html>"""
    assert html_to_text(page) == "os \u2014 Operating system interfaces\n\nUse os.path.\n\nx = 1\n    y = 2\n"
