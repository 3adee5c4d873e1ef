//! Errors of the storage layer, in two tiers: refusals of a request that leave the store as it was, and
//! failures of the medium (IO, corruption) that the caller must treat as fatal for the affected data.

use std::io;
use tidings_types::GroupId;

use crate::kv::Keyspace;
use crate::message::LogRefusal;

/// Where corrupt bytes were found.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CorruptLocation {
    /// A value in the key-value backend.
    Kv {
        /// The keyspace.
        keyspace: Keyspace,
        /// The key, without the keyspace prefix.
        key: Vec<u8>,
    },
    /// A frame in a journal segment.
    Journal {
        /// The segment's number.
        segment: u64,
        /// Byte offset of the frame in the segment.
        offset: u64,
    },
}

impl std::fmt::Display for CorruptLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CorruptLocation::Kv { keyspace, key } => write!(f, "{keyspace:?} key {key:02x?}"),
            CorruptLocation::Journal { segment, offset } => write!(f, "journal segment {segment} offset {offset}"),
        }
    }
}

/// Errors returned by the stores.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// An IO call failed (including failures injected by a failpoint). The operation did not take effect
    /// unless it was a sync, after which durability of unsynced writes is unknown.
    #[error("storage IO failed during {op}")]
    Io {
        /// The operation that failed.
        op: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Bytes read back do not match their checksum or do not decode. Never returned as data.
    #[error("corrupt data at {location}: {detail}")]
    Corrupt {
        /// Where.
        location: CorruptLocation,
        /// What was wrong.
        detail: &'static str,
    },
    /// sled reported an error other than IO (a bug it reports or an unsupported operation).
    #[error("sled failed")]
    Sled(#[source] sled::Error),
    /// A raft log operation was called for a group this store does not hold.
    #[error("raft log of {group} does not exist")]
    UnknownGroup {
        /// The group.
        group: GroupId,
    },
    /// An append would leave a hole in, or rewrite the compacted part of, a group's raft log.
    #[error("{group}: entries starting at {first} cannot follow log [{log_first}, {log_last}]")]
    LogGap {
        /// The group.
        group: GroupId,
        /// First index of the refused entries.
        first: u64,
        /// First index held.
        log_first: u64,
        /// Last index held.
        log_last: u64,
    },
    /// A message-log operation was refused; the log is unchanged.
    #[error(transparent)]
    Refused(LogRefusal),
    /// The message log's memory table is full and write-behind did not drain it in time: retry later.
    #[error("message log is busy: {bytes} bytes wait for write-behind (limit {limit})")]
    Busy {
        /// Bytes waiting in memory.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// A staged batch was dropped by a failed write or sync (possibly another thread's): it is not durable
    /// and will not reappear. Stage it again to retry.
    #[error("staged batch was dropped by a failed journal write or sync")]
    Dropped,
    /// An IO failure left the journal in a state it could not roll back; reopen the log to recover.
    #[error("message log is unusable after an earlier IO failure; reopen it")]
    Unusable,
    /// The message log on disk was written in another layout than this build reads; it was not opened
    /// (nothing was changed). Move its data with the build that wrote it, or start from an empty directory.
    #[error("message log written in format {found}; this build reads format {expected}")]
    IncompatibleFormat {
        /// The format found (1: written before formats were recorded).
        found: u32,
        /// The format this build reads and writes.
        expected: u32,
    },
    /// A configuration value is out of range; the store was not opened.
    #[error("bad store configuration: {what}")]
    BadConfig {
        /// What is wrong.
        what: &'static str,
    },
    /// A compaction past the end of a group's log.
    #[error("{group}: cannot compact to {index}, log ends at {last}")]
    CompactBeyondLog {
        /// The group.
        group: GroupId,
        /// The requested first index.
        index: u64,
        /// Last index held.
        last: u64,
    },
}

impl StoreError {
    /// An IO error for `op`.
    pub fn io(op: &'static str, source: io::Error) -> Self {
        StoreError::Io { op, source }
    }

    /// `true` if the error came from the medium (IO or corruption), as opposed to a refused request.
    pub fn is_medium_failure(&self) -> bool {
        matches!(self, StoreError::Io { .. } | StoreError::Corrupt { .. } | StoreError::Sled(_) | StoreError::Dropped)
    }
}

impl From<sled::Error> for StoreError {
    fn from(e: sled::Error) -> Self {
        match e {
            sled::Error::Io(source) => StoreError::Io { op: "sled", source },
            other => StoreError::Sled(other),
        }
    }
}

/// Result alias of the storage layer.
pub type StoreResult<T> = Result<T, StoreError>;
