"""Edit traces for tuning the drafters: "here is a file and a change to make; write the file after it".

Each trace is one file of one package, in two consecutive releases: the release's sources are downloaded
from PyPI (sdists: ``pip download --no-deps --no-binary PKG PKG==A``: ``:all:`` would build the
build backends from source too) or npm (``npm pack PKG@A``), the
files present in both releases are paired by path, and a pair is kept when its text changed by 1 to
``--max-lines`` lines (difflib). A trace is one JSON line::

    {"prompt": INSTRUCTION + "\\n\\n" + FILE_BEFORE, "output": FILE_AFTER, "package": "pypi:attrs",
     "path": "src/attr/_make.py", "versions": ["25.3.0", "25.4.0"], "language": "python",
     "lines_changed": 3}

``INSTRUCTION`` names the change: the first entry of the release's changelog for version B when the
release ships a changelog that has one (CHANGELOG/CHANGES/HISTORY/NEWS), else "Update to version B",
followed by the file's path and "reply with the complete updated file" (what an editing agent asks).
``lines_changed`` is the number of lines of the larger side of every changed block of the line diff
(a one-line edit is 1, three lines inserted are 3). Files are capped at ``--max-chars`` characters
(both sides) so a replay stays short; metadata that changes with every release (PKG-INFO,
package.json, lock files) is skipped.

The default package set (:data:`DEFAULT_RELEASES`: pinned versions, so a rebuild gives the same traces)
with the default ``--limit-per-package 10`` is what ``benchmarks/data/edit-traces.jsonl.xz`` was built from
(``--limit-per-package 0``: all ~190 traces of those releases); ``requests``, ``click`` and ``express``
are deliberately left out (kept for a check on data no default was tuned on). ``--package pypi:NAME``
/ ``npm:NAME`` with ``--latest N`` builds from a package's newest N releases instead.

Without ``-o`` the output is that committed sample, so ``-o`` is required with ``--package`` or a
non-default ``--max-lines``, ``--max-chars`` or ``--limit-per-package`` (traces that are not the sample
never overwrite it). The arguments, the output's folder included, are checked before any download.

Examples::

    python benchmarks/edit_traces.py -o traces.jsonl.xz                 # the default set (downloads ~15 MB)
    python benchmarks/edit_traces.py --package npm:uuid --package pypi:attrs --latest 6 -o more.jsonl
    ngram-spec stats --requests traces.jsonl.xz --drafter suffix --draft-max 16 --json
"""
from __future__ import annotations

import argparse
import difflib
import io
import json
import lzma
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from reference.atomic import atomic_write  # noqa: E402

DEFAULT_CACHE = Path.home() / ".cache" / "ngram-spec" / "edit-traces"
DEFAULT_OUTPUT = ROOT / "benchmarks" / "data" / "edit-traces.jsonl.xz"
SAMPLE_OPTIONS = {"max_lines": 20, "max_chars": 12000, "limit_per_package": 10}  # what DEFAULT_OUTPUT is built with
HELD_OUT = ("pypi:requests", "pypi:click", "npm:express")  # never in a tuning set

# package -> consecutive releases, oldest first (each adjacent pair is one release step)
DEFAULT_RELEASES: dict[str, list[str]] = {
    "pypi:attrs": ["24.2.0", "24.3.0", "25.1.0", "25.2.0", "25.3.0", "25.4.0"],
    "pypi:packaging": ["24.0", "24.1", "24.2", "25.0"],
    "pypi:pluggy": ["1.3.0", "1.4.0", "1.5.0", "1.6.0"],
    "pypi:platformdirs": ["4.3.6", "4.3.7", "4.3.8", "4.4.0"],
    "pypi:tomli": ["2.0.2", "2.1.0", "2.2.1", "2.3.0"],
    "pypi:iniconfig": ["2.0.0", "2.1.0", "2.2.0", "2.3.0"],
    "npm:semver": ["7.6.0", "7.6.1", "7.6.2", "7.6.3", "7.7.0", "7.7.1", "7.7.2"],
    "npm:debug": ["4.3.4", "4.3.5", "4.3.6", "4.3.7", "4.4.0"],
    "npm:yargs-parser": ["20.2.7", "20.2.9", "21.0.0", "21.0.1", "21.1.0", "21.1.1"],
    "npm:minimist": ["1.2.5", "1.2.6", "1.2.7", "1.2.8"],
    "npm:commander": ["12.0.0", "12.1.0", "13.0.0", "13.1.0"],
    "npm:qs": ["6.13.0", "6.13.1", "6.14.0"],
}

TEXT_SUFFIXES = {".py": "python", ".pyi": "python", ".js": "javascript", ".mjs": "javascript",
                 ".cjs": "javascript", ".ts": "typescript", ".mts": "typescript", ".md": "text",
                 ".rst": "text", ".txt": "text", ".toml": "text", ".cfg": "text", ".ini": "text"}
SKIP_NAMES = {"PKG-INFO", "package.json", "package-lock.json", "yarn.lock", "SOURCES.txt", "RECORD"}
CHANGELOG = re.compile(r"^(changelog|changes|history|news|release[-_ ]?notes)(\.\w+)?$", re.I)


class BuildError(Exception):
    """A package or version that cannot be fetched or read: one line for the user."""


# --- fetching ------------------------------------------------------------------------------------

def run(cmd: list[str], cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    except FileNotFoundError as exc:
        raise BuildError(f"{cmd[0]} is not installed ({exc})") from exc
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise BuildError(f"{' '.join(cmd)} failed: {' | '.join(tail)}")
    return done.stdout


def split_package(spec: str) -> tuple[str, str]:
    registry, sep, name = spec.partition(":")
    if not sep or registry not in ("pypi", "npm") or not name:
        raise BuildError(f"package {spec!r}: write pypi:NAME or npm:NAME")
    return registry, name


def latest_versions(spec: str, n: int) -> list[str]:
    """The newest ``n`` stable releases of a package, oldest first."""
    registry, name = split_package(spec)
    if registry == "npm":
        versions = json.loads(run(["npm", "view", name, "versions", "--json"]))
        versions = [v for v in ([versions] if isinstance(versions, str) else versions) if "-" not in v]
    else:
        line = next((l for l in run([sys.executable, "-m", "pip", "index", "versions", name]).splitlines()
                     if l.startswith("Available versions:")), "")
        versions = [v.strip() for v in line.split(":", 1)[-1].split(",") if v.strip()][::-1]
        versions = [v for v in versions if re.fullmatch(r"[\d.]+(\.post\d+)?", v)]
    if len(versions) < 2:
        raise BuildError(f"{spec}: fewer than two stable releases found")
    return versions[-n:]


def fetch(spec: str, version: str, cache: Path) -> Path:
    """The release's archive (sdist or npm tarball), downloaded into ``cache`` once."""
    registry, name = split_package(spec)
    where = cache / registry / name / version
    found = [p for p in where.glob("*") if p.is_file() and not p.name.startswith(".")] if where.is_dir() else []
    if found:
        return found[0]
    tmp = where.with_name(version + ".part")
    tmp.mkdir(parents=True, exist_ok=True)
    for old in tmp.glob("*"):
        old.unlink()
    if registry == "npm":
        run(["npm", "pack", f"{name}@{version}", "--silent"], cwd=tmp)
    else:
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name, "--quiet", "-d", str(tmp), f"{name}=={version}"])
    files = list(tmp.glob("*"))
    if len(files) != 1:
        raise BuildError(f"{spec}=={version}: expected one archive, got {[f.name for f in files]}")
    if where.exists():  # a stale empty directory
        where.rmdir()
    tmp.rename(where)  # atomic: a cache entry is complete or absent
    return where / files[0].name


def read_archive(path: Path) -> dict[str, bytes]:
    """Member path (its top directory stripped: ``pkg-1.0/`` or ``package/``) -> bytes, regular files only."""
    out: dict[str, bytes] = {}
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if not info.is_dir():
                    out[info.filename.split("/", 1)[-1]] = z.read(info)
        return out
    with tarfile.open(path) as t:
        for m in t.getmembers():
            if m.isfile() and "/" in m.name:
                out[m.name.split("/", 1)[1]] = t.extractfile(m).read()
    return out


# --- pairing -------------------------------------------------------------------------------------

def lines_changed(before: str, after: str) -> int:
    """Lines of the larger side of every changed block of the line diff."""
    a, b = before.splitlines(), after.splitlines()
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for op, i1, i2, j1, j2 in ops if op != "equal")


def clean_note(text: str) -> str:
    """A changelog entry as plain text: no issue links, commit links or reST/Markdown markup."""
    text = re.sub(r"^`?(#\d+\s*)?<https?://[^>]*>`?_:?\s*", "", text)                  # towncrier's "<url>_: "
    text = re.sub(r"\s*\(\[[0-9a-f]{7,}\]\([^)]*\)\)", "", text)          # ([abc1234](url))
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)                  # [text](url)
    text = re.sub(r"\s*\(?:(issue|pr|user|gh):`[^`]*`\)?", "", text)         # (:issue:`828`)
    text = re.sub(r":\w+:`~?([^`]*)`", r"\1", text)                        # :class:`~pkg.Name`
    text = re.sub(r"\s*\((fixes|closes|see|refs?)?\s*#\d+\)", "", text)    # (fixes #123)
    text = re.sub(r"\s*\[?#\d+\]?(\([^)]*\))?", "", text)                  # #123, [#123](url)
    text = re.sub(r"`+([^`]*)`+", r"\1", text)
    return re.sub(r"\s+", " ", text).strip()


def changelog_note(files: dict[str, bytes], version: str) -> str | None:
    """The first entry under version ``version``'s heading in the release's changelog, or None."""
    for path, data in sorted(files.items()):
        if "/" in path or not CHANGELOG.match(path):
            continue
        lines = data.decode("utf-8", "replace").splitlines()
        heading = re.compile(rf"(^|[^\w.]){re.escape(version)}([^\w.]|$)")
        for i, line in enumerate(lines):
            if heading.search(line) and len(line) < 120:
                for entry in lines[i + 1:i + 40]:
                    text = entry.strip()
                    if re.match(r"^[-*+]\s+\S", text):
                        text = clean_note(re.sub(r"^[-*+]\s+", "", text))
                        if len(text) > 8:
                            return text[:200]
                break
    return None


def instruction(spec: str, version_b: str, path: str, note: str | None) -> str:
    name = split_package(spec)[1]
    change = f"{note.rstrip('.')}." if note else f"Update {name} to version {version_b}."
    return f"{change}\nApply this change to `{path}` ({name} {version_b}) and reply with the complete updated file."


def pair_traces(spec: str, a: str, b: str, files_a: dict[str, bytes], files_b: dict[str, bytes], *,
                max_lines: int, max_chars: int, min_chars: int = 200) -> list[dict]:
    note = changelog_note(files_b, b)
    traces = []
    for path in sorted(set(files_a) & set(files_b)):
        name = path.rsplit("/", 1)[-1]
        language = TEXT_SUFFIXES.get(Path(name).suffix)
        if (language is None or name in SKIP_NAMES or CHANGELOG.match(name) or ".egg-info/" in path
                or "/node_modules/" in f"/{path}" or name.endswith((".min.js", ".map"))):
            continue
        try:
            before, after = files_a[path].decode("utf-8"), files_b[path].decode("utf-8")
        except UnicodeDecodeError:
            continue
        if before == after or not (min_chars <= len(before) <= max_chars and len(after) <= max_chars):
            continue
        changed = lines_changed(before, after)
        if not 1 <= changed <= max_lines:
            continue
        traces.append({"prompt": instruction(spec, b, path, note) + "\n\n" + before, "output": after,
                       "package": spec, "path": path, "versions": [a, b], "language": language,
                       "lines_changed": changed})
    return traces


def build(releases: dict[str, list[str]], cache: Path, *, max_lines: int, max_chars: int,
          log=print) -> list[dict]:
    traces = []
    for spec, versions in releases.items():
        if spec in HELD_OUT:
            raise BuildError(f"{spec} is held out for an outside check: tune on other packages")
        archives = {}
        for v in versions:
            archives[v] = read_archive(fetch(spec, v, cache))
        n0 = len(traces)
        for a, b in zip(versions, versions[1:]):
            traces += pair_traces(spec, a, b, archives[a], archives[b], max_lines=max_lines, max_chars=max_chars)
        log(f"{spec}: {len(traces) - n0} traces from {len(versions) - 1} release steps")
    return traces


def write_jsonl(path: str | Path, traces: list[dict]) -> None:
    text = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in traces).encode("utf-8")
    if str(path) == "-":
        sys.stdout.buffer.write(text)
        return
    if str(path).endswith(".xz"):
        text = lzma.compress(text, preset=9 | lzma.PRESET_EXTREME)
    with atomic_write(path, "wb") as f:
        f.write(text)


def read_jsonl(path: str | Path) -> list[dict]:
    """The traces of a ``.jsonl`` or ``.jsonl.xz`` file."""
    data = Path(path).read_bytes()
    if str(path).endswith(".xz"):
        data = lzma.decompress(data)
    return [json.loads(line) for line in io.StringIO(data.decode("utf-8")) if line.strip()]


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad numbers, an output that would overwrite the committed sample with other traces, and an
    output whose folder is missing: each a one-line ``p.error`` (exit 2), before anything is downloaded."""
    if args.latest < 2 or args.max_lines < 1 or args.max_chars < 1:
        p.error("--latest must be >= 2, --max-lines and --max-chars >= 1")
    if args.limit_per_package < 0:
        p.error(f"--limit-per-package {args.limit_per_package}: must be >= 0 (0 keeps every trace)")
    if args.output is None:
        differ = ["--package"] if args.package else []
        differ += [f"--{k.replace('_', '-')}" for k, v in SAMPLE_OPTIONS.items() if getattr(args, k) != v]
        if differ:
            p.error(f"{', '.join(differ)} needs -o FILE: without -o the output is the committed sample "
                    f"{DEFAULT_OUTPUT.relative_to(ROOT)}, built from the defaults only")
        args.output = str(DEFAULT_OUTPUT)
    if args.output != "-":
        out = Path(args.output)
        if out.is_dir():
            p.error(f"-o {args.output}: is a folder; name a file in it, e.g. -o {out / 'traces.jsonl.xz'}")
        if not out.parent.is_dir():
            p.error(f"-o {args.output}: folder {out.parent} does not exist; create it or name another file")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="edit_traces.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0] + "\n\nDownloads releases from PyPI and npm into --cache, pairs\n"
                    "files between consecutive releases and writes one JSON line per file changed by\n"
                    "1..--max-lines lines: {prompt, output, package, path, versions, language, lines_changed}.\n"
                    "Without --package: the pinned default set (benchmarks/data/edit-traces.jsonl.xz).",
        epilog="examples:\n  python benchmarks/edit_traces.py -o traces.jsonl.xz\n"
               "  python benchmarks/edit_traces.py --package npm:uuid --latest 6 -o uuid.jsonl")
    p.add_argument("-o", "--output", default=None,
                   help="JSONL file to write ('.xz': compressed; '-': stdout; default: the committed sample "
                        f"{DEFAULT_OUTPUT.relative_to(ROOT)}, only with the default package set and options)")
    p.add_argument("--package", action="append", metavar="REG:NAME",
                   help="pypi:NAME or npm:NAME (repeatable); with --latest N, its newest N releases")
    p.add_argument("--latest", type=int, default=5, metavar="N",
                   help="with --package: how many of the newest releases to pair (default: %(default)s)")
    p.add_argument("--cache", default=str(DEFAULT_CACHE), help="download cache directory (default: %(default)s)")
    p.add_argument("--max-lines", type=int, default=SAMPLE_OPTIONS["max_lines"],
                   help="keep files changed by at most this many lines (default: %(default)s)")
    p.add_argument("--max-chars", type=int, default=SAMPLE_OPTIONS["max_chars"],
                   help="skip files longer than this, before or after (default: %(default)s)")
    p.add_argument("--limit-per-package", type=int, default=SAMPLE_OPTIONS["limit_per_package"], metavar="N",
                   help="keep at most N traces per package, evenly spaced in (release step, path) order; 0: all "
                        "(default: %(default)s, the committed sample)")
    args = p.parse_args(argv)
    check_args(p, args)
    try:
        releases = ({spec: latest_versions(spec, args.latest) for spec in args.package} if args.package
                    else DEFAULT_RELEASES)
        traces = build(releases, Path(args.cache), max_lines=args.max_lines, max_chars=args.max_chars,
                       log=lambda s: print(s, file=sys.stderr))
    except BuildError as exc:
        print(f"edit_traces.py: error: {exc}", file=sys.stderr)
        return 2
    if args.limit_per_package:
        kept = []
        for spec in releases:
            mine = [t for t in traces if t["package"] == spec]
            step = max(1, len(mine) / args.limit_per_package)
            kept += [mine[int(i * step)] for i in range(min(len(mine), args.limit_per_package))]
        traces = kept
    write_jsonl(args.output, traces)
    langs = sorted({t["language"] for t in traces})
    print(f"{args.output}: {len(traces)} traces from {len({t['package'] for t in traces})} packages "
          f"({', '.join(langs)})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
