"""The offline text corpus, stage 1 of the training recipe: documents split by file, in xz shards.

Every document of every source (``corpus_sources.py``) goes whole to one split. A file is held out
iff ``int(sha256("source/relative_path"), 16) mod 100 < heldout_percent``: stable across runs and
machines, and never a file in both splits. Sources fill a total cap of ``max_bytes`` raw UTF-8 bytes
in order; at the first document that does not fit, it and everything after it are cut (counted in
the manifest).

On disk (``out_dir``): ``train-000.txt.xz``, ``train-001.txt.xz``, ..., ``heldout-000.txt.xz``, each
at most ``shard_bytes`` compressed. A shard's decompressed stream is its documents joined by one
NUL (``"\\x00"``, which no document holds). A shard is a concatenation of xz streams, each of whole
documents and about :data:`STREAM_RAW_BYTES` raw (``lzma.decompress`` and ``xz -d`` read them as one
stream), so each stream's compressed size is known exactly before it is appended and a shard never
passes the limit. ``manifest.json`` records, with no timestamps (same inputs, same bytes): per source
the files and bytes taken and what was skipped or cut; per split the documents, bytes and shards
with their sha256; ``heldout_percent``; and the held-out files.

``python -m dflash2.train.corpus --out .corpus --max-mb 120`` builds it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import lzma
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from ..reference.formats.errors import UserInputError, expect
from .corpus_sources import Source, default_sources, read_source

log = logging.getLogger(__name__)

SPLITS = ("train", "heldout")
SEPARATOR = "\x00"
DEFAULT_OUT = Path(".corpus")
DEFAULT_HELDOUT_PERCENT = 2
DEFAULT_MAX_BYTES = 120 * 2**20
DEFAULT_SHARD_BYTES = 15 * 2**20
STREAM_RAW_BYTES = 8 * 2**20  # preset 6's dictionary: a longer stream would not compress better
LZMA_PRESET = 6
MANIFEST = "manifest.json"


class CorpusError(UserInputError):
    """A corpus folder whose manifest or shards are missing, corrupted or do not match."""


@dataclass
class SourceStats:
    name: str
    root: str
    files: int = 0
    bytes: int = 0  # raw UTF-8 bytes of the documents taken
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> files
    cut_files: int = 0  # left out by the total cap
    cut_disk_bytes: int = 0


@dataclass
class Shard:
    name: str
    bytes: int  # compressed, on disk
    raw_bytes: int  # decompressed, separators included
    docs: int
    sha256: str


@dataclass
class SplitStats:
    docs: int = 0
    bytes: int = 0  # raw UTF-8 bytes of the documents, separators not counted
    shards: list[Shard] = field(default_factory=list)


@dataclass
class Manifest:
    heldout_percent: int
    max_bytes: int
    shard_bytes: int
    sources: list[SourceStats]
    splits: dict[str, SplitStats]
    heldout_files: list[str]  # "source/relative_path", in build order
    cut: str | None = None  # the first document the total cap left out, "source/relative_path"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        data = json.loads(text)
        data["sources"] = [SourceStats(**s) for s in data["sources"]]
        data["splits"] = {name: SplitStats(s["docs"], s["bytes"], [Shard(**h) for h in s["shards"]])
                          for name, s in data["splits"].items()}
        return cls(**data)


def is_heldout(source: str, relative_path: str, heldout_percent: int) -> bool:
    """``sha256("source/relative_path") mod 100 < heldout_percent``: the split, decided per file."""
    digest = hashlib.sha256(f"{source}/{relative_path}".encode("utf-8")).hexdigest()
    return int(digest, 16) % 100 < heldout_percent


class _ShardWriter:
    """Writes one split's documents into ``{split}-NNN.txt.xz`` shards of whole xz streams."""

    def __init__(self, out_dir: Path, split: str, shard_bytes: int, stats: SplitStats) -> None:
        self.out_dir, self.split, self.shard_bytes, self.stats = out_dir, split, shard_bytes, stats
        self.stream_limit = min(STREAM_RAW_BYTES, shard_bytes)
        self.pending: list[str] = []  # documents of the stream being gathered
        self.pending_bytes = 0
        self.shard: list[bytes] = []  # compressed streams of the shard being gathered
        self.shard_raw = self.shard_docs = 0

    def add(self, text: str) -> None:
        size = len(text.encode("utf-8"))
        if self.pending and self.pending_bytes + size > self.stream_limit:
            self._compress_pending()
        self.pending.append(text)
        self.pending_bytes += size + 1

    def close(self) -> None:
        if self.pending:
            self._compress_pending()
        if self.shard:
            self._write_shard()

    def _compress_pending(self) -> None:
        # Documents are joined by one NUL across the streams of a shard: each stream after the
        # first starts with the separator.
        raw = (SEPARATOR if self.shard else "") + SEPARATOR.join(self.pending)
        stream = lzma.compress(raw.encode("utf-8"), preset=LZMA_PRESET)
        if self.shard and sum(map(len, self.shard)) + len(stream) > self.shard_bytes:
            self._write_shard()
            raw = raw[1:]
            stream = lzma.compress(raw.encode("utf-8"), preset=LZMA_PRESET)
        if len(stream) > self.shard_bytes:
            raise CorpusError(f"shard_bytes={self.shard_bytes}: {len(self.pending)} document(s) of "
                              f"{self.pending_bytes} bytes compress to {len(stream)} bytes; expected a larger limit")
        self.shard.append(stream)
        self.shard_raw += len(raw.encode("utf-8"))
        self.shard_docs += len(self.pending)
        self.pending, self.pending_bytes = [], 0

    def _write_shard(self) -> None:
        name = f"{self.split}-{len(self.stats.shards):03d}.txt.xz"
        data = b"".join(self.shard)
        (self.out_dir / name).write_bytes(data)
        self.stats.shards.append(Shard(name, len(data), self.shard_raw, self.shard_docs,
                                       hashlib.sha256(data).hexdigest()))
        self.shard, self.shard_raw, self.shard_docs = [], 0, 0


def build_corpus(out_dir: str | Path = DEFAULT_OUT, *, sources: Sequence[Source] | None = None,
                 heldout_percent: int = DEFAULT_HELDOUT_PERCENT, max_bytes: int = DEFAULT_MAX_BYTES,
                 shard_bytes: int = DEFAULT_SHARD_BYTES) -> Manifest:
    """Read ``sources`` (default: :func:`default_sources`) in order and write the shards and the
    manifest into ``out_dir``; old shards there are removed first."""
    expect(isinstance(heldout_percent, int) and 0 <= heldout_percent <= 100, UserInputError,
           "heldout_percent", heldout_percent, "an integer from 0 to 100")
    expect(isinstance(max_bytes, int) and max_bytes > 0, UserInputError, "max_bytes", max_bytes, "a positive integer")
    expect(isinstance(shard_bytes, int) and shard_bytes > 0, UserInputError, "shard_bytes", shard_bytes,
           "a positive integer")
    sources = default_sources() if sources is None else list(sources)
    names = [s.name for s in sources]
    expect(len(set(names)) == len(names), UserInputError, "source names", names, "distinct names")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in [*out_dir.glob("*.txt.xz"), out_dir / MANIFEST]:
        old.unlink(missing_ok=True)

    manifest = Manifest(heldout_percent, max_bytes, shard_bytes, [], {s: SplitStats() for s in SPLITS}, [])
    writers = {s: _ShardWriter(out_dir, s, shard_bytes, manifest.splits[s]) for s in SPLITS}
    total = 0
    for source in sources:
        stats = SourceStats(source.name, str(source.root))
        manifest.sources.append(stats)
        for doc in read_source(source):
            key = f"{source.name}/{doc.relative_path}"
            if doc.text is None:
                stats.skipped[doc.skipped] = stats.skipped.get(doc.skipped, 0) + 1
                continue
            size = len(doc.text.encode("utf-8"))
            if manifest.cut is not None or total + size > max_bytes:
                manifest.cut = manifest.cut or key
                stats.cut_files += 1
                stats.cut_disk_bytes += doc.disk_bytes
                continue
            total += size
            stats.files += 1
            stats.bytes += size
            split = "heldout" if is_heldout(source.name, doc.relative_path, heldout_percent) else "train"
            if split == "heldout":
                manifest.heldout_files.append(key)
            manifest.splits[split].docs += 1
            manifest.splits[split].bytes += size
            writers[split].add(doc.text)
        log.info("corpus source %r: %d files, %d bytes, skipped %s, cut %d files",
                 source.name, stats.files, stats.bytes, stats.skipped, stats.cut_files)
    for writer in writers.values():
        writer.close()
    (out_dir / MANIFEST).write_text(manifest.to_json(), encoding="utf-8")
    return manifest


def read_manifest(corpus_dir: str | Path) -> Manifest:
    path = Path(corpus_dir) / MANIFEST
    if not path.is_file():
        raise CorpusError(f"corpus folder {str(corpus_dir)!r}: no {MANIFEST} (build it with build_corpus)")
    return Manifest.from_json(path.read_text(encoding="utf-8"))


def iter_documents(corpus_dir: str | Path, split: str) -> Iterator[str]:
    """The documents of ``split`` in build order, each shard checked against the manifest's
    sha256 before any of its documents is yielded."""
    expect(split in SPLITS, UserInputError, "split", split, f"one of {', '.join(SPLITS)}")
    manifest = read_manifest(corpus_dir)
    for shard in manifest.splits[split].shards:
        path = Path(corpus_dir) / shard.name
        if not path.is_file():
            raise CorpusError(f"corpus shard {str(path)!r} is missing (listed in {MANIFEST})")
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != shard.sha256:
            raise CorpusError(f"corpus shard {str(path)!r}: sha256 {digest}, expected {shard.sha256} "
                              f"from {MANIFEST}: the shard is corrupted or from another build")
        yield from lzma.decompress(data).decode("utf-8").split(SEPARATOR)


def main(argv: Sequence[str] | None = None) -> Manifest:
    parser = argparse.ArgumentParser(prog="python -m dflash2.train.corpus", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default %(default)s)")
    parser.add_argument("--max-mb", type=float, default=DEFAULT_MAX_BYTES / 2**20,
                        help="total raw text in MiB, sources filled in order (default %(default)s)")
    parser.add_argument("--heldout-percent", type=int, default=DEFAULT_HELDOUT_PERCENT)
    parser.add_argument("--shard-mb", type=float, default=DEFAULT_SHARD_BYTES / 2**20,
                        help="largest compressed shard in MiB (default %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    manifest = build_corpus(args.out, heldout_percent=args.heldout_percent, max_bytes=int(args.max_mb * 2**20),
                            shard_bytes=int(args.shard_mb * 2**20))
    for name, split in manifest.splits.items():
        print(f"{name}: {split.docs} docs, {split.bytes} bytes, "
              + ", ".join(f"{s.name} {s.bytes} B" for s in split.shards))
    return manifest


if __name__ == "__main__":
    main()
