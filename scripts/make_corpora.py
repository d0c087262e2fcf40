"""English corpora of about 10, 30 and 100 MB to measure the recipe on (issue 49), made from documentation a
Debian machine installs: the packages SOURCES names (the reStructuredText of Sphinx manuals, Python's, LLVM's,
CMake's, pandas's and more; Perl's pod; the kernel's Documentation; Vim's help; the fortunes, an entry a
document). One file is one document, kept whole (a gzip-compressed one is read too); exact duplicates go; the
rest are shuffled with a fixed seed. Each size gets `<out>/<name>-<N>mb/` with `held_out.txt` (the first
documents of the shuffle: the same in every folder, in no train.txt), `train.txt` (the documents after them,
up to N MB, so a smaller corpus is a prefix of a larger one) and `manifest.json` (packages and their versions,
the seed, the counts). Text is only made text (UTF-8 with errors replaced, no NULs); markup stays, as in a
user's text.

    apt-get install -y $(.venv/bin/python scripts/make_corpora.py --packages)
    python scripts/make_corpora.py --out ../corpora [--sizes 10,30,100] [--shared ../shared/data]

`--shared DATA` also writes `tinyshakespeare/` (its last 10% held out, where nanoGPT cuts it) and
`fortunes-shared/` (DATA/fortunes' files as whole documents, a tenth held out) for the small end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import stat
import statistics
import subprocess
import sys
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from aftgen.errors import AftgenError
from aftgen.files import atomic_open, atomic_write, read_bytes

MB = 1_000_000  # sizes are in bytes of UTF-8, as a file's size is given
FILE_LIMIT = 64 * MB  # a documentation file larger than this, compressed or not, is not one
SHARED_HELD_OUT = 0.1  # the small corpora's held-out share


@dataclass(frozen=True)
class Source:
    """A package's documents: the files under `folder` (a glob under the root matching one folder) whose path
    below it matches `pattern`; a fortune file (`entries`) holds one document per %-separated entry."""

    package: str
    folder: str
    pattern: str = r"\.txt$"
    entries: bool = False


@dataclass(frozen=True)
class Document:
    package: str
    text: str


def sphinx(package: str, folder: str = "") -> Source:
    """A Sphinx manual's reStructuredText, which it ships beside its HTML as _sources/*.txt."""
    return Source(package, f"usr/share/doc/{folder or package}/html/_sources")


SOURCES = (
    sphinx("python3.11-doc", "python3.11"),
    Source("perl-doc", "usr/share/perl/5.*/pod", r"\.pod$"),
    Source("linux-doc", "usr/share/doc/linux-doc-*/Documentation", r"^(?!translations/).*\.(rst|txt)(\.gz)?$"),
    Source("fortunes", "usr/share/games/fortunes", r"^[^./]+$", entries=True),  # not .dat indexes or .u8 links
    Source("git-doc", "usr/share/doc/git-doc"),
    Source("vim-runtime", "usr/share/vim/vim90/doc"),
    Source("python-sqlalchemy-doc", "usr/share/doc/python-sqlalchemy-doc/rst", r"\.(rst|txt)$"),
    Source("debian-policy", "usr/share/doc/debian-policy", r"\.txt\.gz$"),
    Source("debian-reference-en", "usr/share/debian-reference", r"\.en\.txt\.gz$"),
    Source("developers-reference", "usr/share/developers-reference/_sources"),
    Source("jargon-text", "usr/share/doc/jargon-text", r"\.txt\.gz$"),
    sphinx("sphinx-doc"),
    sphinx("llvm-15-doc"),
    sphinx("clang-15-doc", "clang-15"),
    sphinx("cmake-doc", "cmake-data"),
    sphinx("python-sklearn-doc"),
    sphinx("python-pandas-doc"),
    sphinx("python-astropy-doc"),
    sphinx("python-statsmodels-doc"),
    sphinx("python-sympy-doc"),
    sphinx("python-dask-doc"),
    sphinx("python-xarray-doc"),
    sphinx("python-setuptools-doc"),
    sphinx("python-cryptography-doc"),
    sphinx("python-pil-doc"),
    sphinx("python-flask-doc"),
)


def source_folder(root: Path, source: Source) -> Path | None:
    """The folder `source.folder` names under `root` (the highest version where a glob matches several)."""
    found = sorted(path for path in root.glob(source.folder) if path.is_dir())
    return found[-1] if found else None


def source_files(folder: Path, pattern: str) -> list[Path]:
    """The regular files below `folder` whose relative path matches `pattern`, in a fixed order. Links are
    not followed (a package's links point at its own files, which are read where they are) and FIFOs,
    devices and sockets are passed over."""
    wanted = re.compile(pattern)
    found = []
    for parent, folders, names in os.walk(folder):  # os.walk descends into no linked folder
        folders.sort()
        for name in sorted(names):
            path = Path(parent, name)
            if wanted.search(path.relative_to(folder).as_posix()) and stat.S_ISREG(os.lstat(path).st_mode):
                found.append(path)
    return found


def read_document(path: Path) -> str:
    """A file's text: gunzipped if it is .gz, decoded as UTF-8 with errors replaced, NULs dropped."""
    data = read_bytes(path, FILE_LIMIT, "a document", follow=False)  # follow=False: a link swapped in is refused
    if path.suffix == ".gz":
        data = gunzip(path, data)
    return data.decode("utf-8", errors="replace").replace("\0", "")


def gunzip(path: Path, data: bytes) -> bytes:
    """`data` decompressed, refusing more than FILE_LIMIT bytes of it (a small file can inflate without end)."""
    inflater = zlib.decompressobj(wbits=zlib.MAX_WBITS | 16)
    try:
        text = inflater.decompress(data, FILE_LIMIT + 1)
    except zlib.error as exc:
        raise AftgenError(f"{path}: not gzip data ({exc})") from None
    if len(text) > FILE_LIMIT:
        raise AftgenError(f"{path}: inflates past {FILE_LIMIT:,} bytes")
    return text


def fortune_entries(text: str) -> list[str]:
    """A fortune file's entries, which lines holding only % separate."""
    return [entry.strip("\n") + "\n" for entry in re.split(r"^%\n", text, flags=re.MULTILINE)]


def documents_of(source: Source, folder: Path) -> list[Document]:
    """The source's documents, each ending with one newline; a file that cannot be read is said and passed."""
    documents = []
    for path in source_files(folder, source.pattern):
        try:
            text = read_document(path)
        except AftgenError as exc:
            print(f"warning: skipped {exc}", file=sys.stderr)
            continue
        texts = fortune_entries(text) if source.entries else [text.rstrip("\n") + "\n"]
        documents += [Document(source.package, text) for text in texts if text.strip()]
    return documents


def collect(sources: tuple[Source, ...], root: Path = Path("/")) -> list[Document]:
    """Every source's documents, exact duplicates after the first dropped; a missing package is an error."""
    folders = {source: source_folder(root, source) for source in sources}
    missing = [source.package for source, folder in folders.items() if folder is None]
    if missing:
        raise AftgenError(f"not installed: {' '.join(missing)} (apt-get install -y {' '.join(missing)})")
    documents, seen = [], set()
    for source, folder in folders.items():
        for document in documents_of(source, folder):
            if document.text not in seen:
                seen.add(document.text)
                documents.append(document)
    return documents


def size(document: Document) -> int:
    return len(document.text.encode("utf-8"))


def prefix(documents: list[Document], limit: int) -> list[Document]:
    """The first documents whose sizes reach `limit` bytes (the last one whole, past it), or all of them."""
    total = 0
    for count, document in enumerate(documents, 1):
        total += size(document)
        if total >= limit:
            return documents[:count]
    return documents


def shuffled(documents: list[Document], seed: int) -> list[Document]:
    order = list(documents)
    random.Random(seed).shuffle(order)
    return order


def counts(documents: list[Document]) -> dict:
    chars = [len(document.text) for document in documents] or [0]
    return {
        "documents": len(documents),
        "characters": sum(chars),
        "bytes": sum(size(document) for document in documents),
        "characters_per_document": {"mean": round(statistics.mean(chars)), "median": round(statistics.median(chars))},
    }


def write_corpus(folder: Path, train: list[Document], held_out: list[Document], about: dict) -> dict:
    """train.txt, held_out.txt (documents one after another, a blank line between two) and manifest.json."""
    for name, documents in (("train.txt", train), ("held_out.txt", held_out)):
        with atomic_open(folder / name, "w", durable=False) as handle:
            handle.write("\n".join(document.text for document in documents))
    manifest = {"corpus": folder.name} | about | {"train": counts(train), "held_out": counts(held_out)}
    atomic_write(folder / "manifest.json", json.dumps(manifest, indent=1) + "\n", durable=False)
    return manifest


def package_version(package: str) -> str:
    """The installed version, as dpkg-query gives it, or "not installed"."""
    try:
        done = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
    except OSError:
        return "not installed"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "not installed"


def make_sized(
    documents: list[Document], out: Path, name: str, sizes_mb: list[float], seed: int, held_out_mb: float
) -> list[dict]:
    """One corpus a size from the shuffled documents: the held-out ones first, then each size's prefix of the
    rest; refused before anything is written if the rest falls short of the largest size."""
    order = shuffled(documents, seed)
    held_out = prefix(order, int(held_out_mb * MB))
    rest = order[len(held_out) :]
    available = sum(size(document) for document in rest)
    if sizes_mb and available < max(sizes_mb) * MB:
        raise AftgenError(
            f"the sources hold {available / MB:.1f} MB beside {held_out_mb:g} MB held out, less than "
            f"{max(sizes_mb):g} MB: ask for less, or add a package to SOURCES"
        )
    packages = sorted({document.package for document in documents})
    versions = {package: package_version(package) for package in packages}
    manifests = []
    for size_mb in sizes_mb:
        train = prefix(rest, int(size_mb * MB))
        per_package = Counter(document.package for document in train)
        about = {
            "made_by": "scripts/make_corpora.py",
            "seed": seed,
            "sources": [
                {"package": package, "version": versions[package], "train_documents": per_package[package]}
                for package in packages
            ],
        }
        manifests.append(write_corpus(out / f"{name}-{size_mb:g}mb", train, held_out, about))
    return manifests


def make_shared(data: Path, out: Path, seed: int) -> list[dict]:
    """tinyshakespeare/ (its last tenth held out, cut where nanoGPT cuts it) and fortunes-shared/ (the files
    of DATA/fortunes as whole documents, shuffled, about a tenth of them held out)."""
    text = read_document(data / "tinyshakespeare.txt")
    cut = int(len(text) * (1 - SHARED_HELD_OUT))
    about = {"made_by": "scripts/make_corpora.py --shared", "source": str(data / "tinyshakespeare.txt")}
    made = [write_corpus(out / "tinyshakespeare", [Document("", text[:cut])], [Document("", text[cut:])], about)]
    fortunes = documents_of(Source("fortunes", "fortunes", r"\.txt$"), data / "fortunes")
    order = shuffled(fortunes, seed)
    held_out = prefix(order, int(SHARED_HELD_OUT * sum(size(document) for document in order)))
    about = {"made_by": "scripts/make_corpora.py --shared", "source": str(data / "fortunes"), "seed": seed}
    made.append(write_corpus(out / "fortunes-shared", order[len(held_out) :], held_out, about))
    return made


def parse_sizes(text: str) -> list[float]:
    try:
        sizes = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not sizes in MB, comma-separated: {text!r}") from None
    if any(not 0 < value < 1e6 for value in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be above 0 MB: {text!r}")
    return sorted(sizes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the folder to write the corpora in")
    parser.add_argument("--sizes", type=parse_sizes, default="10,30,100", help="MB of training text: %(default)s")
    parser.add_argument("--held-out-mb", type=float, default=1.0, help="MB of held-out documents (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="debian-docs", help="the corpora's name, before -<N>mb")
    parser.add_argument("--shared", type=Path, help="also tinyshakespeare/ and fortunes-shared/ from this folder")
    parser.add_argument("--packages", action="store_true", help="print the packages to install, and stop")
    args = parser.parse_args(argv)
    if args.packages:
        print(" ".join(source.package for source in SOURCES))
        return 0
    if args.out is None:
        parser.error("--out is required")
    try:
        made = make_sized(collect(SOURCES), args.out, args.name, args.sizes, args.seed, args.held_out_mb)
        made += make_shared(args.shared, args.out, args.seed) if args.shared else []
    except AftgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for manifest in made:
        print(json.dumps({key: manifest[key] for key in ("corpus", "train", "held_out")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
