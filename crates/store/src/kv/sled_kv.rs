//! [`Kv`] on sled, with a real fsync behind every [`Kv::sync`].
//!
//! sled 0.34's `flush()` writes its log with `pwrite` and then only calls `sync_file_range`, which does not
//! flush the disk's volatile write cache nor the file's metadata: data "flushed" that way can be lost on
//! power failure. So [`SledKv::sync`] calls `flush()` and then `fdatasync`s sled's files itself (the log
//! file `db`, each large-value file under `blobs/` once, and the directories that name new files).

use super::{Direction, KeyRange, Keyspace, Kv, KvBatch, KvOp, KvPair};
use crate::error::{StoreError, StoreResult};
use parking_lot::Mutex;
use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// What one [`SledKv::sync_report`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Bytes sled's `flush()` wrote out.
    pub bytes_flushed: usize,
    /// Files and directories this sync `fdatasync`ed / `fsync`ed, relative to the store's directory.
    pub synced: Vec<PathBuf>,
}

/// A [`Kv`] in one sled database: each keyspace is a one-byte key prefix in the default tree, so a batch
/// across keyspaces is one atomic sled batch.
pub struct SledKv {
    db: sled::Db,
    dir: PathBuf,
    /// Blob files already made durable (sled never rewrites a blob file in place).
    synced_blobs: Mutex<BTreeSet<OsString>>,
    syncs: AtomicU64,
    cache_epoch: AtomicU64,
}

impl SledKv {
    /// How long [`SledKv::open`] waits for a lock held by a database that is still closing.
    pub const LOCK_WAIT: Duration = Duration::from_secs(2);

    /// Opens (or creates) the database in `dir`, with sled's page cache bounded to `cache_bytes`.
    ///
    /// A database closed a moment ago may still be locked while sled's background threads wind down; the
    /// open is retried for up to [`SledKv::LOCK_WAIT`] before the lock error is returned.
    pub fn open(dir: impl AsRef<Path>, cache_bytes: u64) -> StoreResult<Self> {
        let dir = dir.as_ref().to_path_buf();
        let config = sled::Config::new().path(&dir).cache_capacity(cache_bytes);
        let mut waited = Duration::ZERO;
        let db = loop {
            match config.open() {
                Ok(db) => break db,
                Err(sled::Error::Io(e)) if is_lock_conflict(&e) && waited < Self::LOCK_WAIT => {
                    std::thread::sleep(LOCK_RETRY);
                    waited += LOCK_RETRY;
                }
                Err(e) => return Err(e.into()),
            }
        };
        let kv = Self {
            db,
            dir,
            synced_blobs: Mutex::new(BTreeSet::new()),
            syncs: AtomicU64::new(0),
            cache_epoch: AtomicU64::new(0),
        };
        // Make the directory entries sled just created durable before anything relies on them.
        sync_path(&kv.dir).map_err(|e| StoreError::io("fsync directory", e))?;
        Ok(kv)
    }

    /// The database's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Number of completed syncs.
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    /// [`Kv::sync`], reporting what it made durable.
    pub fn sync_report(&self) -> StoreResult<SyncReport> {
        let bytes_flushed = self.db.flush()?;
        // One sync at a time: the blob set is shared, and concurrent fsyncs of one file gain nothing.
        let mut synced_blobs = self.synced_blobs.lock();
        let mut synced = Vec::new();
        let log = self.dir.join("db");
        File::open(&log).and_then(|f| f.sync_data()).map_err(|e| StoreError::io("fdatasync sled log", e))?;
        synced.push(PathBuf::from("db"));
        let blobs = self.dir.join("blobs");
        let mut new_blob = false;
        if blobs.is_dir() {
            let entries = std::fs::read_dir(&blobs).map_err(|e| StoreError::io("list sled blobs", e))?;
            for entry in entries {
                let entry = entry.map_err(|e| StoreError::io("list sled blobs", e))?;
                let name = entry.file_name();
                if synced_blobs.contains(&name) {
                    continue;
                }
                match File::open(entry.path()).and_then(|f| f.sync_data()) {
                    Ok(()) => {}
                    // sled removed the blob meanwhile: nothing left to make durable.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(StoreError::io("fdatasync sled blob", e)),
                }
                synced.push(Path::new("blobs").join(&name));
                synced_blobs.insert(name);
                new_blob = true;
            }
            if new_blob {
                sync_path(&blobs).map_err(|e| StoreError::io("fsync sled blob directory", e))?;
                synced.push(PathBuf::from("blobs"));
            }
        }
        self.syncs.fetch_add(1, Ordering::Relaxed);
        Ok(SyncReport { bytes_flushed, synced })
    }
}

const LOCK_RETRY: Duration = Duration::from_millis(10);

/// sled reports a held file lock as an untyped IO error; its message is the only way to tell it apart.
fn is_lock_conflict(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::WouldBlock || e.to_string().contains("could not acquire lock")
}

/// `fsync` of a file or directory by path.
fn sync_path(path: &Path) -> std::io::Result<()> {
    File::open(path)?.sync_all()
}

fn full_key(keyspace: Keyspace, key: &[u8]) -> Vec<u8> {
    let mut full = Vec::with_capacity(1 + key.len());
    full.push(keyspace.tag());
    full.extend_from_slice(key);
    full
}

impl Kv for SledKv {
    fn get_sealed(&self, keyspace: Keyspace, key: &[u8]) -> StoreResult<Option<Vec<u8>>> {
        Ok(self.db.get(full_key(keyspace, key))?.map(|v| v.to_vec()))
    }

    fn scan_sealed(
        &self,
        keyspace: Keyspace,
        range: &KeyRange,
        direction: Direction,
        limit: usize,
    ) -> StoreResult<Vec<KvPair>> {
        let start = full_key(keyspace, &range.start);
        let end = match &range.end {
            Some(end) => full_key(keyspace, end),
            None => vec![keyspace.tag() + 1],
        };
        let iter = self.db.range(start..end);
        let strip = |item: sled::Result<(sled::IVec, sled::IVec)>| -> StoreResult<KvPair> {
            let (k, v) = item?;
            Ok((k[1..].to_vec(), v.to_vec()))
        };
        match direction {
            Direction::Forward => iter.take(limit).map(strip).collect(),
            Direction::Reverse => iter.rev().take(limit).map(strip).collect(),
        }
    }

    fn apply(&self, batch: KvBatch) -> StoreResult<()> {
        let mut sled_batch = sled::Batch::default();
        for op in batch.ops() {
            match op {
                KvOp::Put { keyspace, key, sealed } => sled_batch.insert(full_key(*keyspace, key), sealed.as_slice()),
                KvOp::Delete { keyspace, key } => sled_batch.remove(full_key(*keyspace, key)),
            }
        }
        self.db.apply_batch(sled_batch)?;
        Ok(())
    }

    fn write_out(&self) -> StoreResult<()> {
        // sled's flush writes its IO buffers out (it does not fsync: see `sync_report`). It holds sled's
        // process-wide lock for reading while it runs, and a batch waiting behind it holds up every
        // reader after that: writing out in small steps keeps each such wait short.
        self.db.flush()?;
        Ok(())
    }

    fn sync(&self) -> StoreResult<()> {
        self.sync_report().map(drop)
    }

    fn cache_epoch(&self) -> &AtomicU64 {
        &self.cache_epoch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sync_fsyncs_the_log_file_and_new_blobs() {
        let dir = tempfile::tempdir().unwrap();
        let kv = SledKv::open(dir.path(), 8 << 20).unwrap();
        let mut batch = KvBatch::new();
        batch.put(Keyspace::Meta, b"small".to_vec(), b"v");
        // Large enough for sled to store it as a blob file.
        batch.put(Keyspace::Meta, b"large".to_vec(), &vec![7u8; 4 << 20]);
        kv.apply(batch).unwrap();
        let report = kv.sync_report().unwrap();
        assert!(report.bytes_flushed > 0, "flush wrote nothing: {report:?}");
        assert_eq!(report.synced[0], PathBuf::from("db"), "the log file was not fsynced: {report:?}");
        assert_eq!(kv.syncs(), 1);
        let first_blobs = report.synced.iter().filter(|p| p.starts_with("blobs/")).count();
        assert!(first_blobs >= 1, "the large value's blob file was not fsynced: {report:?}");
        assert!(report.synced.contains(&PathBuf::from("blobs")), "blob directory entry not fsynced: {report:?}");
        // A second sync does not fsync the same blob again.
        let again = kv.sync_report().unwrap();
        assert!(again.synced.iter().all(|p| !p.starts_with("blobs/")), "{again:?} after {first_blobs} blobs");
        assert_eq!(kv.get(Keyspace::Meta, b"large").unwrap().unwrap().len(), 4 << 20);
    }

    #[test]
    fn an_open_waits_for_a_closing_database_s_lock_and_then_gives_up_with_the_lock_error() {
        let dir = tempfile::tempdir().unwrap();
        let held = SledKv::open(dir.path(), 8 << 20).unwrap();
        // Still held after the wait: the lock error, typed as IO.
        match SledKv::open(dir.path(), 8 << 20) {
            Err(StoreError::Io { source, .. }) => assert!(is_lock_conflict(&source), "{source}"),
            other => panic!("a held database opened twice: {:?}", other.map(|_| ())),
        }
        // Let go while a second open waits: that open takes it.
        let closer = std::thread::spawn(move || {
            std::thread::sleep(SledKv::LOCK_WAIT / 4);
            drop(held);
        });
        let kv = SledKv::open(dir.path(), 8 << 20).expect("the open waits for the lock");
        closer.join().unwrap();
        kv.sync().unwrap();
    }

    #[test]
    fn reopen_keeps_synced_data() {
        let dir = tempfile::tempdir().unwrap();
        {
            let kv = SledKv::open(dir.path(), 8 << 20).unwrap();
            let mut batch = KvBatch::new();
            batch.put(Keyspace::RaftEntry, b"k".to_vec(), b"v");
            batch.put(Keyspace::Meta, b"k".to_vec(), b"w");
            kv.apply(batch).unwrap();
            kv.sync().unwrap();
        }
        let kv = SledKv::open(dir.path(), 8 << 20).unwrap();
        assert_eq!(kv.get(Keyspace::RaftEntry, b"k").unwrap(), Some(b"v".to_vec()));
        let all = kv.scan(Keyspace::Meta, &KeyRange::prefix(b""), Direction::Forward, 10).unwrap();
        assert_eq!(all, vec![(b"k".to_vec(), b"w".to_vec())]);
    }
}
