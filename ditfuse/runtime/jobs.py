"""The video job store: one SQLite database (standard library ``sqlite3``, WAL mode) per data dir.

Layout of a data dir (``ditfuse serve --data-dir``, default ``$DITFUSE_CACHE/videos``)::

    jobs.sqlite3 (+ -wal, -shm)   one row per job (table ``videos``)
    files/<id>.mp4                the finished clip (H.264)
    files/<id>.webp               its thumbnail (first frame)
    lock                          held (flock) by the one server using this data dir

Rows are the source of truth for a job's state; files are created atomically (temporary name,
fsync, rename: :func:`ditfuse.runtime.video_io.atomic_write`) *before* the row says
``completed``, so a completed row always has its file, and a file whose row is not completed is
either a leftover (removed at startup) or proof that the job finished just before a crash (the
startup recovery in :class:`ditfuse.runtime.videos.VideoJobs` then marks it completed).

Durability: WAL with ``synchronous=NORMAL`` — a committed change survives a crash of the server
process (the case this store is for); after an OS crash or power loss the last few commits may
be rolled back, which the startup recovery handles the same way.

Schema versions (``meta.schema_version``)
    1   the first layout.
    2   adds ``videos.close_sites``: how many sites ran their quality="high" (close) kernels in the
        job's batch, set when the job completes (NULL until then, and for rows written by version 1).

Opening a file of an older version migrates it in place, in one transaction (so a crash leaves
it at the old version, not half-way), and logs one line; a file of a newer version is refused
(its layout is unknown here). Once migrated, a file cannot be opened by an older ditfuse.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2

logger = logging.getLogger("ditfuse.jobs")

STATUSES = ("queued", "in_progress", "completed", "failed")
FINISHED = ("completed", "failed")

# The current layout, for a new file. Statements one by one (not executescript, which commits
# whatever transaction is open): a new file gets its tables and version in one transaction.
_SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS videos (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,  -- creation order (pagination cursor)
    id             TEXT NOT NULL UNIQUE,
    model          TEXT NOT NULL,
    status         TEXT NOT NULL CHECK (status IN ('queued', 'in_progress', 'completed', 'failed')),
    progress       INTEGER NOT NULL DEFAULT 0,
    created_at     INTEGER NOT NULL,
    started_at     INTEGER,
    completed_at   INTEGER,                -- completed jobs only (as in OpenAI's object)
    finished_at    INTEGER,                -- completed or failed: the retention clock
    expires_at     INTEGER,
    prompt         TEXT NOT NULL,
    size           TEXT NOT NULL,
    seconds        TEXT NOT NULL,
    quality        TEXT NOT NULL,
    params         TEXT NOT NULL,          -- JSON of SamplingParams.to_dict()
    file           TEXT,                   -- under files/
    bytes          INTEGER,
    error_code     TEXT,
    error_message  TEXT,
    close_sites    INTEGER                 -- completed jobs: sites that ran close kernels (v2)
)""",
    "CREATE INDEX IF NOT EXISTS videos_status ON videos (status)",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
)

# _MIGRATIONS[v]: the statements that take a version-v file to version v + 1. Old rows keep NULL
# in a new column: what they would hold was never recorded, so it is reported as unknown.
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: ("ALTER TABLE videos ADD COLUMN close_sites INTEGER",),
}

COLUMNS = (
    "id", "model", "status", "progress", "created_at", "started_at", "completed_at", "finished_at",
    "expires_at", "prompt", "size", "seconds", "quality", "params", "file", "bytes", "error_code",
    "error_message", "close_sites",
)


class DataDirLocked(RuntimeError):
    """Another server holds this data dir."""


class JobStore:
    """Job rows in SQLite. Thread-safe (one connection behind a lock); every write is its own
    transaction."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir).expanduser()
        self.files_dir = self.data_dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.db_path = self.data_dir / "jobs.sqlite3"
        self._lock = threading.Lock()
        self._lock_fd: int | None = None
        self._acquire_dir_lock()
        try:
            self._db = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise RuntimeError(f"{self.db_path}: could not switch SQLite to WAL mode (got {mode!r})")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._open_schema()
        except BaseException:
            if getattr(self, "_db", None) is not None:
                self._db.close()
            self._release_dir_lock()
            raise

    def _open_schema(self) -> None:
        """Create the tables of a new file, or bring an older file to :data:`SCHEMA_VERSION`;
        RuntimeError for a file of a newer version (nothing is written to it)."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")  # one writer from here to COMMIT: the check and the change agree
        try:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            row = None if "meta" not in tables else db.execute(
                "SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is not None:
                found = int(row[0])
            elif "videos" in tables:
                # version 1 created its tables and then its version row in separate commits: a
                # crash between them left a version-1 table with no version
                found = 1
            else:
                found = None
            if found is not None and found > SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self.db_path} has schema version {found}, newer than this ditfuse's "
                    f"{SCHEMA_VERSION} (it was written by a later ditfuse): upgrade ditfuse, or pass "
                    "another --data-dir")
            if found is not None and found != SCHEMA_VERSION and found not in _MIGRATIONS:
                raise RuntimeError(f"{self.db_path} has schema version {found}, which this ditfuse cannot migrate")
            if found is None:
                for stmt in _SCHEMA:
                    db.execute(stmt)
            else:
                for version in range(found, SCHEMA_VERSION):
                    for stmt in _MIGRATIONS[version]:
                        db.execute(stmt)
                for stmt in _SCHEMA[1:]:  # no-ops, unless that crash of version 1 came before it made them
                    db.execute(stmt)
            if found != SCHEMA_VERSION:
                db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)",
                           (str(SCHEMA_VERSION),))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        if found is not None and found != SCHEMA_VERSION:
            # a warning, not info: the file can no longer be opened by the older ditfuse (and
            # `serve` opens the store before it sets up its own logging, so only warnings show)
            logger.warning("%s: migrated the video job store from schema version %d to %d",
                           self.db_path, found, SCHEMA_VERSION)

    # -- the data dir lock -------------------------------------------------------------------

    def _acquire_dir_lock(self) -> None:
        fd = os.open(self.data_dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise DataDirLocked(
                f"data dir {self.data_dir} is in use by another ditfuse server (pid {holder}); "
                "stop it or pass another --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _release_dir_lock(self) -> None:
        if self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None

    def close(self) -> None:
        with self._lock:
            if getattr(self, "_db", None) is not None:
                self._db.close()
                self._db = None
        self._release_dir_lock()

    # -- rows --------------------------------------------------------------------------------

    def _exec(self, sql: str, args: Iterable[Any] = ()) -> sqlite3.Cursor:
        with self._lock:
            if self._db is None:
                raise RuntimeError("job store is closed")
            return self._db.execute(sql, tuple(args))

    def insert(self, row: dict[str, Any]) -> None:
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise KeyError(f"unknown job columns: {sorted(unknown)}")
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        self._exec(f"INSERT INTO videos ({cols}) VALUES ({marks})", row.values())

    def update(self, job_id: str, only_status: Iterable[str] | None = None, **fields: Any) -> bool:
        """Set ``fields`` on a job (only while its status is one of ``only_status``, if given).
        False if no such job (deleted) or its status did not match."""
        unknown = set(fields) - set(COLUMNS)
        if unknown or not fields:
            raise KeyError(f"bad job columns: {sorted(unknown) or 'none'}")
        sets = ", ".join(f"{k} = ?" for k in fields)
        sql, args = f"UPDATE videos SET {sets} WHERE id = ?", [*fields.values(), job_id]
        if only_status is not None:
            statuses = tuple(only_status)
            sql += f" AND status IN ({', '.join('?' for _ in statuses)})"
            args += statuses
        return self._exec(sql, args).rowcount == 1

    def get(self, job_id: str) -> dict[str, Any] | None:
        row = self._exec("SELECT * FROM videos WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else dict(row)

    def delete(self, job_id: str) -> bool:
        return self._exec("DELETE FROM videos WHERE id = ?", (job_id,)).rowcount == 1

    def count(self, statuses: Iterable[str] | None = None) -> int:
        if statuses is None:
            return self._exec("SELECT COUNT(*) FROM videos").fetchone()[0]
        st = tuple(statuses)
        return self._exec(f"SELECT COUNT(*) FROM videos WHERE status IN ({', '.join('?' for _ in st)})", st).fetchone()[0]

    def list(self, after: str | None = None, limit: int = 20, order: str = "desc") -> tuple[list[dict[str, Any]], bool]:
        """One page in creation order (``desc``: newest first) after the job ``after``;
        returns (rows, has_more). KeyError if ``after`` is not a job."""
        if order not in ("asc", "desc"):
            raise ValueError("order must be 'asc' or 'desc'")
        where, args = "", []
        if after is not None:
            row = self._exec("SELECT seq FROM videos WHERE id = ?", (after,)).fetchone()
            if row is None:
                raise KeyError(after)
            where, args = ("WHERE seq < ?" if order == "desc" else "WHERE seq > ?"), [row[0]]
        rows = self._exec(
            f"SELECT * FROM videos {where} ORDER BY seq {order.upper()} LIMIT ?", [*args, limit + 1]
        ).fetchall()
        return [dict(r) for r in rows[:limit]], len(rows) > limit

    def with_status(self, statuses: Iterable[str]) -> list[dict[str, Any]]:
        """Jobs in ``statuses``, oldest first."""
        st = tuple(statuses)
        rows = self._exec(f"SELECT * FROM videos WHERE status IN ({', '.join('?' for _ in st)}) ORDER BY seq", st)
        return [dict(r) for r in rows.fetchall()]

    def retention_victims(self, max_finished: int | None, now: float | None = None) -> list[dict[str, Any]]:
        """Finished jobs to delete: expired ones (``expires_at`` passed), then the oldest beyond
        the newest ``max_finished``."""
        now = time.time() if now is None else now
        fin = ", ".join(f"'{s}'" for s in FINISHED)
        rows = [dict(r) for r in self._exec(
            f"SELECT * FROM videos WHERE status IN ({fin}) ORDER BY finished_at DESC, seq DESC"
        ).fetchall()]
        victims = [r for r in rows if r["expires_at"] is not None and r["expires_at"] <= now]
        kept = [r for r in rows if r not in victims]
        if max_finished is not None and len(kept) > max_finished:
            victims += kept[max_finished:]
        return victims

    def files_in_use(self) -> set[str]:
        return {r[0] for r in self._exec("SELECT file FROM videos WHERE file IS NOT NULL").fetchall()}

    def ids(self) -> set[str]:
        return {r[0] for r in self._exec("SELECT id FROM videos").fetchall()}


def params_json(params: Any) -> str:
    return json.dumps(params.to_dict(), sort_keys=True)
