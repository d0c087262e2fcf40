"""Preparing a corpus for training: scan, split, tokenizer, token files; cached, and continued if killed."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from aftgen.corpus.cache import SET_PREFIX, InUse, TokenFiles, cache_key, corpus_folder, prune
from aftgen.corpus.encode import CHUNK_CHARS, PIECE_CHARS, chunks, cpu_count, encoder, token_dtype
from aftgen.corpus.progress import Advance, Meter
from aftgen.corpus.sample import TOKENIZER_SAMPLE, sample, train_on_sample
from aftgen.corpus.sources import DEFAULT_GLOB, BadFile, Document, check_encoding, find_files, read_span, scan_file
from aftgen.corpus.split import DEFAULT_HELD_OUT, Span, Split, describe, parse_size, split_corpus
from aftgen.corpus.token_file import TokenFile
from aftgen.device import release_freed_memory
from aftgen.distributed import World, local_rank
from aftgen.errors import AftgenError
from aftgen.files import atomic_write
from aftgen.model import LIMITS
from aftgen.options import flag
from aftgen.tokenizer import TOKENIZER_TYPES, Tokenizer

MAX_WORKERS = 1024  # encoding processes, all started at once: a bound that no machine's cores reach
# A new tokenizer's vocabulary chosen from the slices it will train on and the training split's characters.
VocabularyRule = Callable[[list[str], int], int]


@dataclass
class CorpusOptions:
    """How a corpus is read, split and tokenized."""

    glob: str = DEFAULT_GLOB
    held_out: int | str = DEFAULT_HELD_OUT  # characters at most, or a size such as "500k"
    skip_bad_files: bool = False
    encoding: str = "utf-8"
    errors: str = "strict"
    vocab_size: int = 1024
    tokenizer_type: str = "bpe"
    tokenizer_sample: int = TOKENIZER_SAMPLE  # characters the tokenizer trains on at most
    chunk_chars: int = CHUNK_CHARS
    piece_chars: int = PIECE_CHARS
    workers: int | None = None  # encoding processes (default: one per core)
    leave_out: tuple[Path, ...] = ()  # folders in the corpus's folders that are not corpus (a run's own folder)

    def __post_init__(self) -> None:
        if isinstance(self.held_out, str):
            self.held_out = parse_size(self.held_out)

    def check(self) -> None:
        """Refuse out-of-range values before any file is read."""
        check_encoding(self.encoding, self.errors)
        if not self.glob:
            raise AftgenError("--glob must not be empty")
        if self.tokenizer_type not in TOKENIZER_TYPES:
            raise AftgenError(
                f"unknown tokenizer type '{self.tokenizer_type}'; choose one of: {', '.join(TOKENIZER_TYPES)}"
            )
        for name in ("held_out", "vocab_size", "tokenizer_sample", "chunk_chars", "piece_chars"):
            if getattr(self, name) <= 0:
                raise AftgenError(f"{flag(name)} must be positive, got {getattr(self, name)}")
        if self.vocab_size > LIMITS["vocab_size"]:
            raise AftgenError(f"--vocab-size must be at most {LIMITS['vocab_size']}, got {self.vocab_size}")
        if self.workers is not None and not 0 < self.workers <= MAX_WORKERS:
            raise AftgenError(f"--workers must be between 1 and {MAX_WORKERS}, got {self.workers}")


@dataclass
class Corpus:
    """A corpus as scanned: its documents (in order), its split, and where its preparations are cached."""

    documents: list[Document]
    split: Split
    held_out: dict  # what is held out (split.describe)
    options: CorpusOptions
    skipped: int = 0

    @property
    def digest(self) -> str:
        """What makes this corpus its text: its files' contents, in order, and the options that shape its split."""
        options = self.options
        digests = [document.digest for document in self.documents]
        key = {"documents": digests, "encoding": options.encoding, "errors": options.errors}
        return cache_key(key | {"held_out": options.held_out})

    @property
    def folder(self) -> Path:
        """The cache folder of this corpus."""
        return corpus_folder(self.digest)

    def read(self, span: Span, advance: Advance | None = None, skip: int = 0) -> Iterator[str]:
        """A span's text in blocks, from `skip` characters into it."""
        document = self.documents[span.document]
        return read_span(document, span.start + skip, span.stop, self.options.encoding, self.options.errors, advance)

    def bytes_of(self, spans: Sequence[Span]) -> int:
        """About how many bytes of the files `spans` cover."""
        return sum(self.documents[s.document].size * s.chars // max(self.documents[s.document].chars, 1) for s in spans)


@dataclass
class PreparedCorpus:
    """A corpus ready to train on: its tokenizer and memory-mapped token ids, a BOS before each document."""

    tokenizer: Tokenizer
    train_ids: TokenFile  # uint16 (int32 past 65,536 pieces), memory-mapped: read from disk as batches use it
    held_out_ids: torch.Tensor  # memory-mapped too
    held_out_chars: int  # for nats/char
    held_out_bytes: int  # UTF-8 bytes, for bits/byte
    held_out: dict  # what was held out, exactly (training.json)
    folder: Path  # where the token files are
    digest: str  # the text's identity (Corpus.digest): a resumed run checks that it trains on the same
    summary: dict = field(default_factory=dict)
    in_use: InUse | None = None  # holds the token files in use while this lives: no other run's pruning removes them


def scan_corpus(sources: Sequence[Path | str], options: CorpusOptions, meter: Meter) -> Corpus:
    """Find the corpus's files, check, count and hash each (one streamed read), and split it."""
    files = find_files(sources, options.glob, options.leave_out)
    documents, skipped = [], 0
    with meter.phase("scanning", sum(_size(path) for path in files)) as advance:
        for path in files:
            try:
                documents.append(scan_file(path, options.encoding, options.errors, advance=advance))
            except BadFile as exc:
                if not options.skip_bad_files:
                    hint = "" if len(files) == 1 else "; --skip-bad-files leaves such files out"
                    raise BadFile(f"{exc}{hint}") from None
                meter.log(f"warning: skipping {exc}")
                skipped += 1
    if not documents:
        raise AftgenError(f"no usable text in {', '.join(map(str, sources))}: all {skipped} files were skipped")
    if skipped:
        meter.log(f"skipped {skipped} bad file{'s' * (skipped != 1)}, kept {len(documents)}")
    split = split_corpus(documents, options.held_out)
    held_out = describe(split, documents, options.held_out)
    meter.log(
        f"{len(documents):,} document{'s' * (len(documents) != 1)}, {sum(d.chars for d in documents):,} characters; "
        f"held out: {held_out['summary']}, {held_out['chars']:,} characters"
    )
    return Corpus(documents, split, held_out, options, skipped)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def corpus_tokenizer(corpus: Corpus, meter: Meter, vocabulary: VocabularyRule | None = None) -> Tokenizer:
    """The corpus's tokenizer: trained on a sample of its training split, cached beside its token files; of the
    size `vocabulary` chooses from that sample and the split's characters, where given."""
    if vocabulary is None and (cached := _cached_tokenizer(corpus)) is not None:
        return cached
    spans = corpus.split.train
    total = sum(span.chars for span in spans)
    if not total:  # one character, and the held-out split took it
        chars = sum(document.chars for document in corpus.documents)
        raise AftgenError(
            f"the corpus is too small to train a tokenizer: {chars} character{'s' * (chars != 1)}, all of it held "
            "out; give it more text"
        )
    with meter.phase("sampling", corpus.bytes_of(spans)) as advance:
        slices = sample((corpus.read(span, advance) for span in spans), total, corpus.options.tokenizer_sample)
    if vocabulary is not None:
        corpus.options = replace(corpus.options, vocab_size=vocabulary(slices, total))
        if (cached := _cached_tokenizer(corpus)) is not None:
            return cached
    tokenizer = train_on_sample(slices, total, corpus.options, meter.log)
    atomic_write(_tokenizer_path(corpus), tokenizer.model_proto)
    return tokenizer


def _tokenizer_path(corpus: Corpus) -> Path:
    options = corpus.options
    return corpus.folder / f"tokenizer-{options.tokenizer_type}-{options.vocab_size}-{options.tokenizer_sample}.model"


def _cached_tokenizer(corpus: Corpus) -> Tokenizer | None:
    path = _tokenizer_path(corpus)
    if path.exists():
        with contextlib.suppress(AftgenError):  # a damaged cache entry is simply made again
            return Tokenizer.load(path)
    return None


def encode_corpus(corpus: Corpus, tokenizer: Tokenizer, meter: Meter) -> PreparedCorpus:
    """The corpus's token files for `tokenizer`: opened from the cache, continued, or written."""
    options = corpus.options
    settings = {
        "tokenizer": hashlib.sha256(tokenizer.model_proto).hexdigest(),
        "chunk": options.chunk_chars,
        "piece": options.piece_chars,
    }
    spans = {"held_out": corpus.split.held_out, "train": corpus.split.train}
    chars = {part: [span.chars for span in part_spans] for part, part_spans in spans.items()}
    folder = corpus.folder / f"{SET_PREFIX}{cache_key(settings)}"
    files = TokenFiles(folder, token_dtype(tokenizer.vocab_size), chars, tokenizer.vocab_size)
    in_use = files.use()
    prune(corpus.folder, folder, meter.log)  # before this set is written: room made first
    with files.locked():
        manifest = files.finished(meter.log)
        if manifest is None:
            if files.resume(meter.log):
                meter.log(f"continuing the preparation left unfinished in {files.folder}")
            manifest = _encode(corpus, tokenizer, files, meter)
    return _prepared(corpus, tokenizer, files, manifest, in_use)


def _encode(corpus: Corpus, tokenizer: Tokenizer, files: TokenFiles, meter: Meter) -> dict:
    split, started = corpus.split, time.monotonic()
    total = corpus.bytes_of(split.held_out) + corpus.bytes_of(split.train)
    workers = corpus.options.workers or cpu_count()
    with meter.phase("encoding", total) as advance:
        with encoder(tokenizer, files.dtype, workers, corpus.options.piece_chars) as encode:
            for part, spans in (("held_out", split.held_out), ("train", split.train)):
                _encode_part(corpus, tokenizer.bos_id, files, part, spans, encode, advance)
    meter.log(f"encoded in {time.monotonic() - started:.1f} s by {workers} processes into {files.folder}")
    return files.finish({"documents": [str(d.path) for d in corpus.documents], "skipped": corpus.skipped})


def _encode_part(corpus: Corpus, bos: int, files: TokenFiles, part: str, spans, encode, advance: Advance) -> None:
    """Encode the spans of one part, chunk by chunk, from where the files' progress says it stopped."""
    progress = dict(files.progress[part])
    for index, chunk, ids in encode(_chunks(corpus, spans, progress, advance)):
        if index > progress["span"]:
            progress.update(span=index, char=0)
        if progress["char"] == 0:  # the document starts here
            ids = np.concatenate([np.array([bos], dtype=files.dtype), ids])
        progress["char"] += len(chunk)
        progress["bytes"] += len(chunk.encode("utf-8", "replace"))
        progress["tokens"] += len(ids)
        files.append(part, ids, progress)
        release_freed_memory()  # or the heap, fragmented by megabyte-sized chunks, grows for minutes
    files.progress[part] = progress | {"span": len(spans), "char": 0}


def _chunks(corpus: Corpus, spans: Sequence[Span], progress: dict, advance: Advance) -> Iterator[tuple[int, str]]:
    """(span index, chunk) from where `progress` stopped to the end of `spans`."""
    for index in range(progress["span"], len(spans)):
        skip = progress["char"] if index == progress["span"] else 0
        for chunk in chunks(corpus.read(spans[index], advance, skip=skip), corpus.options.chunk_chars):
            yield index, chunk


def _prepared(corpus: Corpus, tokenizer: Tokenizer, files: TokenFiles, manifest: dict, in_use: InUse) -> PreparedCorpus:
    parts = manifest["parts"]
    held_out = corpus.held_out | {"bytes": parts["held_out"]["bytes"], "tokens": parts["held_out"]["tokens"]}
    summary = {
        "documents": len(corpus.documents),
        "skipped": corpus.skipped,
        "chars": sum(d.chars for d in corpus.documents),
        "train_tokens": parts["train"]["tokens"],
        "held_out_tokens": parts["held_out"]["tokens"],
        "cache": str(files.folder),
    }
    return PreparedCorpus(
        tokenizer=tokenizer,
        train_ids=files.open("train", parts["train"]["tokens"]),
        held_out_ids=files.open("held_out", parts["held_out"]["tokens"])[:],
        held_out_chars=held_out["chars"],
        held_out_bytes=parts["held_out"]["bytes"],
        held_out=held_out,
        folder=files.folder,
        digest=corpus.digest,
        summary=summary,
        in_use=in_use,
    )


def prepare_corpus(
    sources: Sequence[Path | str],
    options: CorpusOptions | None = None,
    log: Callable[[str], None] | None = None,
    tokenizer: Tokenizer | None = None,
    world: World | None = None,
    vocabulary: VocabularyRule | None = None,
) -> PreparedCorpus:
    """Make `sources` (text files and folders) ready to train on, or open what an earlier run prepared.

    `log` None shows progress on stderr (a bar on a terminal); a function gets the messages and no
    progress. With `tokenizer` (a resumed run's), only token files are made. Under torchrun (`world`),
    rank 0 trains the tokenizer and sends it to the others, and one process per machine writes the
    token files while the others on it wait. `vocabulary(sample, training characters)` chooses the new
    tokenizer's size from the slices it will train on (aftgen.training.vocabulary); else options.vocab_size.
    """
    options = options or CorpusOptions()
    options.check()
    meter = Meter(show=True) if log is None else _LoggingMeter(log)
    corpus = scan_corpus(sources, options, meter)
    world = world or World()
    if tokenizer is None:
        proto = corpus_tokenizer(corpus, meter, vocabulary).model_proto if world.main else None
        tokenizer = Tokenizer(world.share_bytes(proto))
    first_on_machine = local_rank() == 0
    if not first_on_machine:
        world.barrier()
    prepared = encode_corpus(corpus, tokenizer, meter)
    if first_on_machine:
        world.barrier()
    return prepared


class _LoggingMeter(Meter):
    """No progress display; messages go to a given function."""

    def __init__(self, log: Callable[[str], None]):
        super().__init__(show=False)
        self._log = log

    def log(self, message: str) -> None:
        self._log(message)
