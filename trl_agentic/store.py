"""The durable episode store of online training: users, closed episodes, rewards and training claims.

Serving (`trl-agentic serve` with user keys) writes closed episodes and the rewards that arrive for them; training
claims rewarded episodes, step by step. Everything goes through `EpisodeStore`, whose default is an embedded SQLite
database (`SQLiteEpisodeStore`): one file, write-ahead log, `synchronous=FULL`, so that a method that returned has
its data on disk and a `kill -9` of the server loses nothing it acknowledged.

What the store guarantees:
- **User keys are stored hashed** (`hash_key`, SHA-256): the file never holds a key; a revoked user's key stops
  resolving at once.
- **Nothing is trained twice**: `claim_for_training` marks the episodes it hands out (with the optimizer step that
  claims them) in the same transaction that reads them. A reward that arrives for an episode already claimed is kept
  with `use="evaluation"`, never trained.
- **A crash between a claim and its checkpoint** costs nothing: on restart from the checkpoint of step `s`,
  `release_claims_after(s)` hands the later steps' episodes back, and they are trained once, by the resumed run.

Example:

```python
>>> store = SQLiteEpisodeStore("online/store.db")
>>> key = store.add_user("alice")  # shown once; only its hash is stored
>>> store.put_episode(episode, user="alice", fingerprint=None)
>>> store.add_reward(episode.id, 1.0, source="feedback", giver="alice")
>>> claim = store.claim_for_training(limit=8, step=1)  # [(Episode, [Reward, ...]), ...]
```
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .trace import Episode


USER_KEY_PREFIX = "sk-user-"
REWARD_USES = ("pending", "trained", "evaluation")  # waiting for a claim, claimed with its episode, came too late
VERSION_PUBLISHED = "published"  # a trainer saved it; serving has not put it on trial yet


def hash_key(key: str) -> str:
    """The stored form of a user key: its SHA-256, hex (keys are 256 random bits: no salt or stretching needed)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Reward:
    """One reward of an episode, with where it came from.

    Args:
        id: its number in the store (rising in arrival order).
        episode_id: the episode it rewards.
        value: the reward.
        source: `"feedback"` (a user's thumbs or number), `"admin"` (CI results, a business metric) or the name of a
            reward function run on the closed episode.
        giver: who gave it (the user's name, `"admin"`, or the function's name).
        note: free text the giver attached, if any.
        use: `"pending"` (not trained yet), `"trained"` (claimed with its episode) or `"evaluation"` (arrived after
            its episode was trained: kept to evaluate, never trained).
        created: Unix time it was stored.
    """

    id: int
    episode_id: str
    value: float
    source: str
    giver: str
    note: str | None
    use: str
    created: float


@dataclass
class Claim:
    """Episodes handed to one optimizer step, each with the rewards claimed with it."""

    step: int
    items: list[tuple[Episode, list[Reward]]] = field(default_factory=list)


class EpisodeStore(Protocol):
    """What serving and training share. `SQLiteEpisodeStore` is the embedded default; a server database implements
    the same methods for serving and training on different machines."""

    def add_user(self, name: str) -> str: ...
    def revoke_user(self, name: str) -> bool: ...
    def user_for_key(self, key: str) -> str | None: ...
    def put_episode(self, episode: Episode, user: str | None, fingerprint: str | None) -> None: ...
    def get_episode(self, episode_id: str) -> tuple[Episode, str | None]: ...
    def episodes_of(self, user: str) -> list[str]: ...
    def add_reward(self, episode_id: str, value: float, source: str, giver: str, note: str | None = None) -> int: ...
    def rewards(self, episode_id: str) -> list[Reward]: ...
    def claim_for_training(
        self,
        limit: int,
        step: int,
        versions: list[int] | None = None,
        newest_first: bool = False,
        group: int | None = None,
    ) -> Claim: ...
    def release_claims_after(self, step: int) -> int: ...
    def publish_version(self, version: int, path: str | None, state: str = VERSION_PUBLISHED) -> None: ...
    def published_versions(self, after: int = -1) -> list[dict]: ...
    def set_version_state(self, version: int, state: str, reason: str | None = None) -> None: ...


# One schema for both engines: {serial} is an auto-numbered key, {float} a double (PostgreSQL's REAL is 4 bytes).
_SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    name TEXT PRIMARY KEY,
    key_hash TEXT NOT NULL UNIQUE,
    created {float} NOT NULL,
    revoked {float}
);
CREATE TABLE IF NOT EXISTS episodes (
    seq {serial},
    id TEXT NOT NULL UNIQUE,
    owner TEXT,
    fingerprint TEXT,
    status TEXT NOT NULL,
    data TEXT NOT NULL,
    stored {float} NOT NULL,
    claim_step BIGINT,
    version BIGINT
);
CREATE INDEX IF NOT EXISTS episodes_owner ON episodes(owner);
CREATE TABLE IF NOT EXISTS rewards (
    id {serial},
    episode_id TEXT NOT NULL REFERENCES episodes(id),
    value {float} NOT NULL,
    source TEXT NOT NULL,
    giver TEXT NOT NULL,
    note TEXT,
    use TEXT NOT NULL,
    created {float} NOT NULL
);
CREATE INDEX IF NOT EXISTS rewards_episode ON rewards(episode_id);
CREATE TABLE IF NOT EXISTS versions (
    version BIGINT PRIMARY KEY,
    path TEXT,
    state TEXT NOT NULL,
    reason TEXT,
    published {float} NOT NULL
);
"""


def episode_version(episode: Episode) -> int | None:
    """The version that sampled an episode's oldest token (`None`: it sampled nothing)."""
    versions = [v for turn in episode.turns for v in (turn.token_versions or [turn.policy_version])]
    return min(versions) if versions else None


class SQLEpisodeStore:
    """`EpisodeStore` over SQL: the queries, the transactions and what they guarantee, for both engines
    ([`SQLiteEpisodeStore`], [`PostgresEpisodeStore`]). Queries use `?` placeholders; rows a claim hands out are
    locked (`FOR UPDATE SKIP LOCKED` on PostgreSQL; SQLite's `BEGIN IMMEDIATE` locks the whole file)."""

    _integrity_error: type[Exception] = Exception
    _row_lock = ""  # appended to a SELECT whose rows the transaction then updates (waits for other transactions)
    _claim_lock = ""  # the same for a claim's SELECT, which skips rows another claim holds

    # Users

    def add_user(self, name: str) -> str:
        """Create a user and return its key (`sk-user-...`): shown to the caller once, stored only as its hash."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"A user needs a non-empty name, not {name!r}.")
        key = f"{USER_KEY_PREFIX}{secrets.token_urlsafe(32)}"
        try:
            with self._transaction() as db:
                db.execute(
                    "INSERT INTO users (name, key_hash, created) VALUES (?, ?, ?)", (name, hash_key(key), time.time())
                )
        except self._integrity_error:
            raise ValueError(f"User {name!r} already exists; revoke it or pick another name.") from None
        return key

    def revoke_user(self, name: str) -> bool:
        """Revoke a user's key at once; `False` when there is no such user or it was revoked already."""
        with self._transaction() as db:
            cursor = db.execute("UPDATE users SET revoked = ? WHERE name = ? AND revoked IS NULL", (time.time(), name))
            return cursor.rowcount == 1

    def user_for_key(self, key: str) -> str | None:
        """The user a key belongs to, `None` for an unknown or revoked key."""
        if not key.startswith(USER_KEY_PREFIX):
            return None
        rows = self._read("SELECT name FROM users WHERE key_hash = ? AND revoked IS NULL", (hash_key(key),))
        return rows[0][0] if rows else None

    def users(self) -> list[dict]:
        """Every user: name, created, revoked (Unix times; revoked `None` while active). Never a key."""
        rows = self._read("SELECT name, created, revoked FROM users ORDER BY created", ())
        return [{"name": n, "created": c, "revoked": r} for n, c, r in rows]

    # Episodes

    def put_episode(self, episode: Episode, user: str | None, fingerprint: str | None) -> None:
        """Store a closed episode (durable when this returns). Storing an id twice is refused: an episode is stored
        once, when it closes."""
        data = json.dumps(episode.to_dict(), ensure_ascii=False, separators=(",", ":"))
        try:
            with self._transaction() as db:
                db.execute(
                    "INSERT INTO episodes (id, owner, fingerprint, status, data, stored, version) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (episode.id, user, fingerprint, episode.status, data, time.time(), episode_version(episode)),
                )
        except self._integrity_error:
            raise ValueError(f"Episode {episode.id!r} is stored already.") from None

    def get_episode(self, episode_id: str) -> tuple[Episode, str | None]:
        """An episode and its user; `KeyError` if it is not stored. The task fingerprint it was stored with, if any,
        is in `episode.metadata["fingerprint"]`."""
        rows = self._read("SELECT data, owner, fingerprint FROM episodes WHERE id = ?", (episode_id,))
        if not rows:
            raise KeyError(episode_id)
        episode = Episode.from_dict(json.loads(rows[0][0]))
        if rows[0][2] is not None:
            episode.metadata["fingerprint"] = rows[0][2]
        return episode, rows[0][1]

    def owner(self, episode_id: str) -> tuple[bool, str | None]:
        """(whether the episode is stored, its user)."""
        rows = self._read("SELECT owner FROM episodes WHERE id = ?", (episode_id,))
        return (True, rows[0][0]) if rows else (False, None)

    def episodes_of(self, user: str) -> list[str]:
        """The ids of a user's stored episodes, oldest first."""
        return [r[0] for r in self._read("SELECT id FROM episodes WHERE owner = ? ORDER BY seq", (user,))]

    # Rewards

    def add_reward(self, episode_id: str, value: float, source: str, giver: str, note: str | None = None) -> int:
        """Store a reward (durable when this returns) and return its id. `KeyError` for an episode not stored.
        A reward for an episode already claimed for training is kept with `use="evaluation"`."""
        with self._transaction() as db:
            row = db.execute("SELECT claim_step FROM episodes WHERE id = ?" + self._row_lock, (episode_id,)).fetchone()
            if row is None:
                raise KeyError(episode_id)
            use = "pending" if row[0] is None else "evaluation"
            cursor = db.execute(
                "INSERT INTO rewards (episode_id, value, source, giver, note, use, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
                (episode_id, float(value), source, giver, note, use, time.time()),
            )
            return cursor.fetchone()[0]

    def rewards(self, episode_id: str) -> list[Reward]:
        """An episode's rewards, in arrival order."""
        rows = self._read(
            "SELECT id, episode_id, value, source, giver, note, use, created FROM rewards WHERE episode_id = ? "
            "ORDER BY id",
            (episode_id,),
        )
        return [Reward(*row) for row in rows]

    # Training

    def claim_for_training(
        self,
        limit: int,
        step: int,
        versions: list[int] | None = None,
        newest_first: bool = False,
        group: int | None = None,
    ) -> Claim:
        """Hand at most `limit` rewarded, unclaimed episodes to optimizer step `step`, with their pending rewards;
        both are marked in the same transaction, so no other claim gets them.

        Args:
            versions: only episodes whose oldest token was sampled by one of these versions (`None`: any); the
                trainer passes those within its staleness bound, and older ones are never trained.
            newest_first: the most recent episodes first (when traffic outruns training, train on the freshest),
                else the oldest first.
            group: only whole groups of `group` episodes of one task fingerprint, each group's members together
                (the groups in the order they fill up); episodes without a fingerprint, and those of a fingerprint
                with fewer than `group` eligible ones, stay for a later claim. `None`: any episode.
        """
        claim = Claim(step)
        where = ""
        params: tuple = ()
        if versions is not None:
            if not versions:
                return claim
            where = f" AND version IN ({', '.join('?' * len(versions))})"
            params = tuple(int(v) for v in versions)
        if group is not None:
            if group < 1:
                raise ValueError(f"group must be at least 1, not {group}.")
            where += " AND fingerprint IS NOT NULL"
        order = "DESC" if newest_first else "ASC"
        eligible = (
            "SELECT id, fingerprint FROM episodes WHERE claim_step IS NULL AND EXISTS "
            "(SELECT 1 FROM rewards WHERE rewards.episode_id = episodes.id AND use = 'pending')"
            f"{where} ORDER BY seq {order}"
        )
        with self._transaction() as db:
            if group is None:
                rows = db.execute(eligible + " LIMIT ?" + self._claim_lock, (*params, limit)).fetchall()
                ids = [row[0] for row in rows]
            else:
                ids = _whole_groups(db.execute(eligible + self._claim_lock, params).fetchall(), group, limit)
            for episode_id in ids:
                data, fingerprint = db.execute(
                    "SELECT data, fingerprint FROM episodes WHERE id = ?", (episode_id,)
                ).fetchone()
                db.execute("UPDATE episodes SET claim_step = ? WHERE id = ?", (step, episode_id))
                rewards = db.execute(
                    "SELECT id, episode_id, value, source, giver, note, 'trained', created FROM rewards "
                    "WHERE episode_id = ? AND use = 'pending' ORDER BY id",
                    (episode_id,),
                ).fetchall()
                db.execute("UPDATE rewards SET use = 'trained' WHERE episode_id = ? AND use = 'pending'", (episode_id,))
                episode = Episode.from_dict(json.loads(data))
                if fingerprint is not None:
                    episode.metadata["fingerprint"] = fingerprint
                claim.items.append((episode, [Reward(*r) for r in rewards]))
        return claim

    def release_claims_after(self, step: int) -> int:
        """Hand back the episodes claimed by steps after `step` (a restart from step `step`'s checkpoint: those
        steps' updates were lost), with the rewards claimed with them; returns how many episodes."""
        with self._transaction() as db:
            rows = db.execute("SELECT id FROM episodes WHERE claim_step > ?" + self._row_lock, (step,)).fetchall()
            for (episode_id,) in rows:
                db.execute("UPDATE episodes SET claim_step = NULL WHERE id = ?", (episode_id,))
                db.execute("UPDATE rewards SET use = 'pending' WHERE episode_id = ? AND use = 'trained'", (episode_id,))
        return len(rows)

    # Versions (serving and training in two processes: the trainer publishes, serving rolls out and decides)

    def publish_version(self, version: int, path: str | None, state: str = VERSION_PUBLISHED) -> None:
        """Record a version a trainer saved at `path` (a folder the serving machine can read: a shared disk), for
        serving to put on trial (`endpoint/version_sync.py`). Publishing a version twice is refused."""
        try:
            with self._transaction() as db:
                db.execute(
                    "INSERT INTO versions (version, path, state, published) VALUES (?, ?, ?, ?)",
                    (int(version), path, state, time.time()),
                )
        except self._integrity_error:
            raise ValueError(f"Version {version} is published already; each optimizer step makes a new one.") from None

    def published_versions(self, after: int = -1) -> list[dict]:
        """The versions with a number above `after`, oldest first: version, path, state, reason (what serving
        decided: `published`, then `candidate`, `incumbent`, `retired`, `rolled_back` or `superseded`)."""
        rows = self._read(
            "SELECT version, path, state, reason FROM versions WHERE version > ? ORDER BY version", (int(after),)
        )
        return [{"version": v, "path": p, "state": s, "reason": r} for v, p, s, r in rows]

    def set_version_state(self, version: int, state: str, reason: str | None = None) -> None:
        """Record a version's state (serving's rollout decisions; a version serving loaded on its own, such as the
        first incumbent, is added)."""
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE versions SET state = ?, reason = COALESCE(?, reason) WHERE version = ?",
                (state, reason, int(version)),
            )
            if cursor.rowcount == 0:
                db.execute(
                    "INSERT INTO versions (version, path, state, reason, published) VALUES (?, NULL, ?, ?, ?)",
                    (int(version), state, reason, time.time()),
                )

    def claimed_episode_ids(self) -> set[str]:
        return {r[0] for r in self._read("SELECT id FROM episodes WHERE claim_step IS NOT NULL", ())}

    def rewarded_episode_ids(self) -> set[str]:
        return {r[0] for r in self._read("SELECT DISTINCT episode_id FROM rewards", ())}

    # What each engine provides

    def _read(self, sql: str, params: tuple) -> list[tuple]:
        raise NotImplementedError

    def _transaction(self):
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def _whole_groups(rows: list[tuple[str, str]], group: int, limit: int) -> list[str]:
    """The ids of the first `limit // group` whole groups of one fingerprint in `rows` ((id, fingerprint), in claim
    order): a group is taken when its `group`-th member is reached, its members together."""
    filling: dict[str, list[str]] = {}
    ids: list[str] = []
    for episode_id, fingerprint in rows:
        if len(ids) + group > limit:
            break
        members = filling.setdefault(fingerprint, [])
        members.append(episode_id)
        if len(members) == group:
            ids += members
            filling[fingerprint] = []
    return ids


class SQLiteEpisodeStore(SQLEpisodeStore):
    """`EpisodeStore` in one SQLite file (write-ahead log, `synchronous=FULL`); safe to share between threads, and
    between processes on one machine (SQLite's file locks: a server and a trainer process may open the same file).

    Args:
        path: the database file (created with its folder if missing).
        timeout: seconds a write waits for another process's write lock before failing.
    """

    _integrity_error = sqlite3.IntegrityError

    def __init__(self, path: str | Path, timeout: float = 30.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, timeout=timeout, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        with self._lock:
            self._db.executescript(_SCHEMA.format(serial="INTEGER PRIMARY KEY AUTOINCREMENT", float="REAL"))

    def _read(self, sql: str, params: tuple) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def _transaction(self):
        return _SQLiteTransaction(self._db, self._lock)

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _SQLiteTransaction:
    """`BEGIN IMMEDIATE` ... `COMMIT` (or `ROLLBACK` on an exception) under the store's thread lock: the write lock is
    taken up front, so two processes' claims cannot interleave between a read and its update."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock):
        self.db, self.lock = db, lock

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        return self.db

    def __exit__(self, kind, error, traceback) -> None:
        try:
            self.db.execute("COMMIT" if kind is None else "ROLLBACK")
        finally:
            self.lock.release()


class PostgresEpisodeStore(SQLEpisodeStore):
    """`EpisodeStore` in a PostgreSQL database, for serving and training on different machines (`pip install
    "trl-agentic[postgres]"`, psycopg 3). Each transaction commits before its method returns (PostgreSQL's default
    `synchronous_commit=on`: durable); claims lock their rows (`FOR UPDATE SKIP LOCKED`), so trainers on several
    machines never claim one episode twice.

    Args:
        dsn: a libpq connection string or URL, e.g. `"postgresql://trl@db-host/online"`.
    """

    _row_lock = " FOR UPDATE"
    _claim_lock = " FOR UPDATE SKIP LOCKED"

    def __init__(self, dsn: str):
        import psycopg

        self._integrity_error = psycopg.errors.IntegrityError
        self._db = psycopg.connect(dsn, autocommit=True)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute(
                _SCHEMA.format(serial="BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY", float="DOUBLE PRECISION")
            )

    def _read(self, sql: str, params: tuple) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql.replace("?", "%s"), params).fetchall()

    def _transaction(self):
        return _PostgresTransaction(self._db, self._lock)

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _PostgresTransaction:
    """One psycopg transaction under the store's thread lock; `execute` takes the `?` placeholders of the shared
    queries."""

    def __init__(self, db, lock: threading.Lock):
        self.db, self.lock, self.transaction = db, lock, None

    def __enter__(self):
        self.lock.acquire()
        try:
            self.transaction = self.db.transaction()
            self.transaction.__enter__()
        except BaseException:
            self.lock.release()
            raise
        return self

    def execute(self, sql: str, params: tuple):
        return self.db.execute(sql.replace("?", "%s"), params)

    def __exit__(self, kind, error, traceback) -> None:
        try:
            self.transaction.__exit__(kind, error, traceback)
        finally:
            self.lock.release()


def open_store(location: str | Path) -> SQLEpisodeStore:
    """The store at `location`: a `postgresql://...` URL opens [`PostgresEpisodeStore`], anything else is a SQLite
    file ([`SQLiteEpisodeStore`])."""
    text = str(location)
    if text.startswith(("postgresql://", "postgres://")):
        return PostgresEpisodeStore(text)
    return SQLiteEpisodeStore(location)
