"""The text files of a folder, read as one code base: which files, in which order, and how the
stream names each.

Files are picked as ripgrep picks them by default: the `.gitignore` files of the folder, of the
folders below it and of those above it up to its git work tree's top, and the work tree's
`.git/info/exclude`, with git's rules (a deeper file's patterns take precedence; nothing is picked
below an ignored folder); hidden files and folders (a leading dot) skipped; binary and empty files
skipped (`open_documents` says which); links not followed (ripgrep's default: a link to a file
outside the folder would put that file in the store). They are read in the order
of their paths, as `git ls-files` lists them, and each opens with a line naming it,
`==> proj/src/main.py <==` (as `head` and `tail` name the files they print), so the model reads
which file says what.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pathspec

from emllm.app.textinput import InputError, TextSource


def header(name: str) -> str:
    """The line that opens a folder's file in the stream."""
    return f"==> {name} <==\n"


def _spec(file: str) -> pathspec.GitIgnoreSpec | None:
    """The patterns of an ignore file (None: there is none, or it cannot be read: nothing ignored by it)."""
    try:
        with open(file, encoding="utf-8", errors="replace") as f:
            return pathspec.GitIgnoreSpec.from_lines(f.read().splitlines())
    except OSError:
        return None


def _above(folder: str) -> list[tuple[str, pathspec.GitIgnoreSpec]]:
    """The ignore files git would apply to `folder` (absolute) from above it and from its work
    tree's top, shallowest first: the work tree's `.git/info/exclude` (git's weakest), then the
    .gitignore files of the folders above `folder` up to the top (the nearest folder, `folder`
    itself included, holding `.git`). None when it is in no work tree."""
    chain, d = [], folder
    while not os.path.exists(os.path.join(d, ".git")):
        parent = os.path.dirname(d)
        if parent == d:
            return []  # in no work tree
        d = parent
        chain.append(d)
    found = [(d, spec) for d in reversed(chain) if (spec := _spec(os.path.join(d, ".gitignore"))) is not None]
    exclude = _spec(os.path.join(d, ".git", "info", "exclude"))  # (a worktree's .git is a file: none read)
    return ([(d, exclude)] if exclude is not None else []) + found


def _ignored(path: str, is_dir: bool, specs: list[tuple[str, pathspec.GitIgnoreSpec]]) -> bool:
    """Whether git ignores `path` (absolute) under these (folder, patterns), shallowest first:
    the deepest file with a pattern that matches decides, its last matching pattern within it."""
    for base, spec in reversed(specs):
        rel = path[len(base) :].lstrip("/") + ("/" if is_dir else "")
        hit = spec.check_file(rel).include
        if hit is not None:
            return hit
    return False


def folder_files(folder: str | Path, skipped: Callable[[str, str], None] | None = None) -> list[tuple[str, Path]]:
    """(name, path) of each file to read in `folder`, in the order of their paths. name: the
    folder's own name, then the file's path inside it, joined by "/" (the stream's and the
    store's name for it). Links are not followed (told to `skipped(name, "link")`): one to a
    file outside the folder (a key, a password file) would be read into the store, and served."""
    top = os.path.abspath(folder)
    label = os.path.basename(top) or "root"
    found: list[tuple[str, Path]] = []

    def walk(d: str, rel: str, specs: list[tuple[str, pathspec.GitIgnoreSpec]]) -> None:
        spec = _spec(os.path.join(d, ".gitignore"))
        if spec is not None:
            specs = [*specs, (d, spec)]
        try:
            entries = list(os.scandir(d))
        except OSError:
            return  # an unreadable folder: nothing read from it, as git and ripgrep
        for e in entries:
            if e.name.startswith("."):
                continue
            try:
                link = e.is_symlink()
                is_dir = e.is_dir(follow_symlinks=False)
                is_file = e.is_file(follow_symlinks=False)
            except OSError:
                continue
            if not (is_dir or is_file or link) or _ignored(e.path, is_dir, specs):
                continue
            inner = f"{rel}/{e.name}" if rel else e.name
            if link:
                if skipped is not None:
                    skipped(f"{label}/{inner}", "link")
            elif is_dir:
                walk(e.path, inner, specs)
            else:
                found.append((inner, Path(e.path)))

    walk(top, "", _above(top))
    found.sort(key=lambda f: f[0].encode("utf-8", "surrogateescape"))  # bytewise, as git sorts paths
    return [(f"{label}/{rel}", path) for rel, path in found]


def open_documents(paths: list[str], warn: Callable[[str], None] | None = None,
                   skipped: Callable[[str, str], None] | None = None) -> list[tuple[str, TextSource]]:
    """(name, source) of each document that `paths` name, in order, checked before any is read:
    a file ("-": stdin) is one document, named by its path (InputError when it cannot be read as
    text); a folder is its files (`folder_files`), each opening with its `header`, those that are
    binary, empty or unreadable left out and told to `skipped(name, why)`; a folder with none
    left is an InputError. A file named twice (`*.md README.md`, a folder and a file in it) is
    read once, where it is named first, and told to `skipped(name, "named twice")`. warn: told of
    text that is not valid UTF-8, when it is read."""
    docs: list[tuple[str, TextSource]] = []
    seen: set[str] = set()

    def again(name: str, f: str) -> bool:
        key = os.path.realpath(f)
        if key in seen:
            if skipped is not None:
                skipped(name, "named twice")
            return True
        seen.add(key)
        return False

    for p in paths:
        if p == "-" or not os.path.isdir(p):
            if p == "-" or not again(p, p):
                docs.append((p if p != "-" else "stdin", TextSource.open(p, warn)))
            continue
        texts = 0  # (a folder whose files were all named before holds text: it is not refused)
        for name, f in folder_files(p, skipped):
            if again(name, str(f)):
                texts += 1
                continue
            try:
                docs.append((name, TextSource.open(str(f), warn, header=header(name))))
                texts += 1
            except InputError as e:
                if skipped is not None:
                    skipped(name, e.kind)
        if not texts:
            raise InputError(f"{p}: no text files to read in this folder (hidden, git-ignored, binary and empty "
                             "files and links are left out)")
    return docs


__all__ = ["folder_files", "open_documents", "header"]
