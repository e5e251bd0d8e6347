"""`export_decoder`: a patched model + static cache -> an artifact directory (see artifact.py).

Writing is all or nothing: every argument and the target are checked before anything is written;
the export is built in a staging directory beside the target (`.<name>.kivi-tmp-*`) and moved into
place only when complete (renameat2 RENAME_EXCHANGE where the OS has it, so the old and the new
export trade places in one step); a failure or Ctrl-C at any point before that leaves the target as
it was. An exclusive lock (`.<name>.kivi-lock` beside the target, flock) held for the whole export makes a second export into
the same target fail at once instead of interleaving files.

`--overwrite` never deletes what an export did not write. It replaces a directory that is empty or
holds an intact KIVI export (its kivi_export.json checks, digest included) and nothing else: the
signed metadata lists every file the export wrote, and any other file or directory there (a user's
notes, results, a project) makes the export refuse, naming it. Only the names an export writes
count as listed (the metadata, the program file, its external data, the files a tokenizer writes
under tokenizer/: artifact.written_files), whatever else a recomputed digest vouches for. A directory whose
metadata does not verify is never touched. After the swap only the listed files of the old export
are removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path, PurePosixPath
from typing import Iterator, Optional

import torch

from kivi_models.generate import make_cache
from kivi_models.loading import log
from kivi_ops import KIVIConfig

from .artifact import (FORMATS, METADATA_FILE, MIN_MAX_SEQ_LEN, PROGRAM_FILES, TOKENIZER_DIR, ArtifactError,
                       ExportMetadata, check_fields, signed_fields, write_metadata, written_files)
from .decoder import ExportableDecoder
from .formats import save_aoti, save_onnx, save_pt2, save_pte

try:
    import fcntl
except ImportError:  # not POSIX: no lock (the staged, atomic write still applies)
    fcntl = None

STAGING_TAG = ".kivi-tmp-"  # .<name>.kivi-tmp-XXXX: an export being written, beside its target
LOCK_TAG = ".kivi-lock"  # .<name>.kivi-lock: held (flock) while an export writes <name>


class ExportTargetError(FileExistsError):
    """--out cannot be written: a file, a directory that is not a KIVI export, a non-empty one without
    --overwrite, or one another export is writing."""


def example_inputs(batch_size: int, device) -> tuple[torch.Tensor, ...]:
    """A two-token prompt (a dynamic dim must not be traced at size 0 or 1): why max_seq_len >= 2."""
    n = MIN_MAX_SEQ_LEN
    return (torch.zeros(batch_size, n, dtype=torch.long, device=device),
            torch.zeros(batch_size, dtype=torch.long, device=device),
            torch.full((batch_size,), n, dtype=torch.long, device=device))


def trace(decoder: ExportableDecoder) -> torch.export.ExportedProgram:
    args = example_inputs(decoder.cache.batch_size, decoder.cache.device)
    tokens = torch.export.Dim("tokens", min=1, max=decoder.cache.max_seq_len)
    shapes = ({1: tokens}, None, None)
    if decoder.cache_as_io:  # forward(..., *cache): the varargs are one tuple in dynamic_shapes
        args, shapes = (*args, *decoder.cache_tensors()), (*shapes, (None,) * len(decoder.cache_names))
    with torch.no_grad():
        return torch.export.export(decoder, args, dynamic_shapes=shapes)


# ---------------------------------------------------------------- the target directory


def check_target(out: Path, overwrite: bool) -> set[str]:
    """Refuse (ExportTargetError naming --out) a target this export must not replace. Returns the
    files of the earlier export there that the new one replaces (empty: `out` is new or empty)."""
    if out.is_symlink() and not out.exists():
        raise ExportTargetError(f"--out {out} is a dangling symbolic link; remove it or choose another --out")
    if out.exists() and not out.is_dir():
        raise ExportTargetError(f"--out {out} is a file, not a directory; choose a directory path for --out")
    parent = out.parent
    if parent.exists() and not parent.is_dir():
        raise ExportTargetError(f"--out {out}: {parent} is a file, not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return set()
    if not (out / METADATA_FILE).exists():
        raise ExportTargetError(
            f"--out {out} is a non-empty directory that is not a KIVI export (no {METADATA_FILE}); refusing to "
            f"write there: --overwrite only replaces an earlier KIVI export. Choose a new or empty --out")
    try:
        written = written_files(signed_fields(out))
    except ArtifactError as e:
        raise ExportTargetError(
            f"--out {out} is not an intact KIVI export ({e}); it is left untouched: --overwrite only replaces an "
            f"export whose metadata verifies. Remove it yourself or choose another --out") from None
    if not overwrite:
        raise ExportTargetError(f"--out {out} already holds a KIVI export; pass --overwrite to replace it")
    if foreign := foreign_entries(out, written):
        shown = ", ".join(foreign[:10]) + (f" and {len(foreign) - 10} more" if len(foreign) > 10 else "")
        raise ExportTargetError(
            f"--out {out} holds files the export did not write: {shown}; --overwrite only replaces an export's own "
            f"files. Move them out of {out} or choose another --out")
    return written


def foreign_entries(out: Path, written: set[str]) -> list[str]:
    """What under `out` is not in `written` (paths relative to `out`; a directory ends with "/" and is
    not entered). Symbolic links are entries of their own, never followed."""
    dirs = {parent.as_posix() for w in written for parent in PurePosixPath(w).parents} - {"."}
    found = []
    for root, dirnames, filenames in os.walk(out):
        here = PurePosixPath(Path(root).relative_to(out).as_posix())
        for name in list(dirnames):
            if (here / name).as_posix() not in dirs:
                found.append(f"{(here / name).as_posix()}/")
                dirnames.remove(name)
        found += [(here / name).as_posix() for name in filenames if (here / name).as_posix() not in written]
    return sorted(found)


def remove_written(old: Path, written: set[str], out: Path) -> None:
    """Delete the listed files of the export replaced at `out` (now at `old`), then its directories
    if empty. Anything else (added after the check) is moved beside `out` and said so."""
    for name in written:
        with contextlib.suppress(FileNotFoundError):
            (old / name).unlink()
    for root, _, _ in sorted(os.walk(old), key=lambda entry: -len(entry[0])):  # deepest first
        with contextlib.suppress(OSError):
            os.rmdir(root)
    if old.exists():  # someone wrote there between the check and the swap: keep it, visibly
        kept = out.with_name(f"{out.name}.kept-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        os.rename(old, kept)
        log(f"kept what the replaced export did not write ({', '.join(foreign_entries(kept, set()))}) in {kept}")


def lock_path(out: Path) -> Path:
    """The lock file of target `out`, beside it (a name of ours: it is truncated and removed)."""
    return out.with_name(f".{out.name}{LOCK_TAG}")


@contextlib.contextmanager
def target_lock(out: Path) -> Iterator[None]:
    """Hold the target's lock file (flock, exclusive, non-blocking) until the export is in place; another
    holder means another export is writing `out`: fail at once. The lock file is removed on release
    (the inode check below makes that safe against a racing opener)."""
    if fcntl is None:
        yield
        return
    lock = lock_path(out)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ExportTargetError(f"--out {out} is being written by another `kivi export` (it holds {lock}); "
                                        f"wait for it to finish or choose another --out") from None
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder removed this file as we opened it: lock the current one
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under root (and root) to disk before it is renamed into place."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not fsync directories
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


@contextlib.contextmanager
def _no_interrupts() -> Iterator[list]:
    """Hold Ctrl-C (SIGINT) off while the export is put in place, so that its renames and the removal
    of the old export finish together; yields the list of signals that came meanwhile."""
    caught: list = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield caught
    finally:
        signal.signal(signal.SIGINT, previous)


def swap_in(staging: Path, out: Path) -> Optional[Path]:
    """Put the complete export `staging` at `out`. Returns the path now holding what `out` held (to
    delete), or None if `out` did not exist."""
    if not os.path.lexists(out):
        os.rename(staging, out)  # atomic; refuses (OSError) a non-empty directory created meanwhile
        return None
    if _exchange(staging, out):
        return staging  # the old contents now live at the staging path
    # No atomic exchange: move the old export aside, the new one in; undo on failure.
    old = out.with_name(f".{out.name}.kivi-old-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(out, old)
    try:
        os.rename(staging, out)
    except BaseException:
        os.rename(old, out)
        raise
    return old


def _remove_stale_staging(out: Path) -> None:
    """Staging directories of this target left by a killed export (we hold the lock: none is live)."""
    prefix = f".{out.name}{STAGING_TAG}"
    for entry in out.parent.iterdir():
        if entry.name.startswith(prefix) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)


# ---------------------------------------------------------------- export


def check_export_arguments(model, *, fmt: str, batch_size: int, max_seq_len: int) -> None:
    """ValueError for a format, batch size or capacity the export would fail on (the other fields
    are checked with the metadata, artifact.check_fields), before anything is written."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    context = model.config.max_position_embeddings
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or not MIN_MAX_SEQ_LEN <= max_seq_len <= context:
        raise ValueError(f"max_seq_len must be in [{MIN_MAX_SEQ_LEN}, {context}] (at least {MIN_MAX_SEQ_LEN}: the "
                         f"exporter traces the program with a {MIN_MAX_SEQ_LEN}-token prompt; at most the model's "
                         f"context), got {max_seq_len!r}")


def export_decoder(
    model,
    tokenizer,
    out: Path,
    *,
    fmt: str,
    model_name: str,
    method: str = "kivi",
    kivi_config: Optional[KIVIConfig] = None,
    batch_size: int = 1,
    max_seq_len: int = 1024,
    weight_quant: str = "none",
    overwrite: bool = False,
) -> ExportMetadata:
    """Export `model` (already patched with patch_model, weights already quantized if asked) to the
    directory `out`, all or nothing (module docstring)."""
    check_export_arguments(model, fmt=fmt, batch_size=batch_size, max_seq_len=max_seq_len)
    out = Path(os.path.abspath(out))
    if out.is_symlink() and out.is_dir():
        out = out.resolve()  # replace what the link names; the link keeps naming it
    check_target(out, overwrite)
    kivi_config = kivi_config or KIVIConfig()
    # ONNX and ExecuTorch cannot carry the kivi custom ops: the cache then runs core ATen forms
    # (kivi_ops/dispatch/__init__.py, "portable").
    cache = make_cache(model, method=method, batch_size=batch_size, max_seq_len=max_seq_len, kivi_config=kivi_config,
                       portable=fmt in ("onnx", "pte"))
    decoder = ExportableDecoder(model, cache, cache_as_io=fmt == "onnx").eval()
    eos = tokenizer.eos_token_id
    meta = ExportMetadata(
        format=fmt, model=model_name, model_type=model.config.model_type, vocab_size=model.config.vocab_size,
        num_layers=model.config.num_hidden_layers, method=method,
        kivi=kivi_config.to_dict() if method == "kivi" else None, batch_size=batch_size, max_seq_len=max_seq_len,
        dtype=str(model.dtype).replace("torch.", ""), weight_quant=weight_quant, eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0),
        cache_bytes=cache.nbytes(), fp16_cache_bytes=cache.fp16_nbytes(),
        cache_names=decoder.cache_names,
    )
    try:  # the metadata's own checks, before the slow part (the file fields come last)
        check_fields(json.loads(json.dumps(asdict(meta))), "the export's metadata", files=False)
    except ArtifactError as e:
        raise ValueError(f"cannot export: {e}") from None

    out.parent.mkdir(parents=True, exist_ok=True)
    with target_lock(out):
        replaced = check_target(out, overwrite)  # again, now that no other export can change it
        _remove_stale_staging(out)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}{STAGING_TAG}", dir=out.parent))
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # mkdtemp's 0700 -> what a plain mkdir would give
        try:
            _write_export(model, decoder, tokenizer, staging, fmt, weight_quant, meta)
            _fsync_tree(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        # From the swap on the export completes: a Ctrl-C then waits for it (raised after an
        # exchange, it would have removed the staging path, which then holds the old export).
        with _no_interrupts() as interrupted:
            try:
                old = swap_in(staging, out)  # after an exchange, `old` is the staging path
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            _fsync_dir(out.parent)
            if old is not None:
                remove_written(old, replaced, out)
    if interrupted:
        log("Ctrl-C came while the export was being put in place; the export was completed first")
    log(f"Exported to {out}")
    return meta


def _write_export(model, decoder: ExportableDecoder, tokenizer, staging: Path, fmt: str, weight_quant: str,
                  meta: ExportMetadata) -> None:
    if weight_quant != "none":
        # torchao's quantized weights are tensor subclasses, which the exporters would pickle or
        # refuse; unwrapped, the program holds plain int8 tensors + scales and dequantizes in-graph.
        from torchao.utils import unwrap_tensor_subclass

        unwrap_tensor_subclass(model)
    start = time.perf_counter()
    log(f"Tracing the decoder with torch.export ({fmt})...")
    ep = trace(decoder)
    file = staging / PROGRAM_FILES[fmt]
    log(f"Traced in {time.perf_counter() - start:.1f} s; writing {PROGRAM_FILES[fmt]}...")
    if fmt == "pt2":
        save_pt2(ep, file)
    elif fmt == "aoti":
        save_aoti(ep, file)
    elif fmt == "onnx":
        meta.extra_files = save_onnx(ep, file)
    else:
        save_pte(ep, file)
    tokenizer.save_pretrained(staging / TOKENIZER_DIR)
    write_metadata(staging, meta)  # last: hashes every file and signs the metadata
    log(f"Written in {time.perf_counter() - start:.1f} s")
