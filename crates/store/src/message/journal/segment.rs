//! The journal's files: preallocated segments of CRC-checked frames, one `fdatasync` per sync, and
//! recovery that replays from a checkpoint and cuts a torn tail at the last good frame.
//!
//! Frame: `[body length u32][crc32 u32][frame seq u64][body]`, little endian; the CRC covers the frame
//! seq and the body. Frame seqs are consecutive across segments and a segment is named after its first
//! frame seq, so a stale or misplaced frame never passes for the next one. A zero length marks the unused
//! (preallocated, zeroed) end of a segment.
//!
//! Segments are recycled: a segment whose frames are all checkpointed is renamed to a spare and reused by
//! the next roll. Overwriting blocks that were already written makes an `fdatasync` cheaper than writing
//! into fresh (unwritten) extents, which needs a file system journal commit; measured here: p50 165 µs
//! versus 240 µs. A recycled segment still holds old frames, but their frame seqs are older than any the
//! journal expects, so recovery stops at them.

use crate::error::{CorruptLocation, StoreError, StoreResult};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One sync of the journal, run outside its lock: the write of the frames still buffered, then
/// `fdatasync` of the segments written since the last sync, and of the directory if segments were created.
///
/// Jobs must run one at a time and none may run while the journal is rolled back: the write lands outside
/// the lock, and a rollback that zeroed the file before it would see its frames reappear.
pub(crate) struct SyncJob {
    /// Frames appended since the last write, and where they go (the active segment's file, at `offset`).
    pending: Option<(Arc<File>, u64, Vec<u8>)>,
    files: Vec<Arc<File>>,
    dir: Option<PathBuf>,
    closed: usize,
    dir_changes: u64,
    /// The position after the last frame this job makes durable.
    pub(crate) position: Position,
}

impl SyncJob {
    /// Carries out the `fdatasync`s.
    pub(crate) fn run(&self) -> StoreResult<()> {
        if let Some((file, offset, bytes)) = &self.pending {
            file.write_all_at(bytes, *offset).map_err(|e| StoreError::io("journal write", e))?;
        }
        for file in &self.files {
            file.sync_data().map_err(|e| StoreError::io("journal fdatasync", e))?;
        }
        if let Some(dir) = &self.dir {
            sync_dir(dir)?;
        }
        Ok(())
    }
}

/// Bytes of a frame header.
pub(crate) const FRAME_HEADER_BYTES: u64 = 16;

/// A point in the journal: a segment (by its first frame seq), a byte offset in it, and the seq of the
/// frame that starts there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Position {
    pub(crate) segment: u64,
    pub(crate) offset: u64,
    pub(crate) next_frame: u64,
}

impl Position {
    /// The start of a journal that never held a frame.
    pub(crate) const ORIGIN: Position = Position { segment: 1, offset: 0, next_frame: 1 };

    pub(crate) fn encode(&self) -> Vec<u8> {
        [self.segment, self.offset, self.next_frame].iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    pub(crate) fn decode(bytes: &[u8]) -> Option<Position> {
        if bytes.len() != 24 {
            return None;
        }
        let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        Some(Position { segment: word(0), offset: word(1), next_frame: word(2) })
    }
}

struct Segment {
    first_frame: u64,
    /// Shared with sync jobs, which `fdatasync` it outside the journal's lock.
    file: Arc<File>,
    /// Write offset.
    len: u64,
}

/// The journal's writer: frames go to the active segment; [`Journal::sync`] makes them durable.
pub(crate) struct Journal {
    dir: PathBuf,
    capacity: u64,
    active: Segment,
    /// Segments filled since the last sync: their data still needs an `fdatasync`.
    closed_unsynced: Vec<Arc<File>>,
    /// Segment files created so far, and how many of those creations a directory `fsync` covered.
    dir_changes: u64,
    dir_synced: u64,
    next_frame: u64,
    /// Segment files on disk, by first frame seq.
    segments: BTreeMap<u64, PathBuf>,
    synced: Position,
    /// Frames appended but not yet written to the file, starting at file offset `buf_offset`: one
    /// `pwrite` per sync instead of one per frame.
    buf: Vec<u8>,
    /// The buffer a finished sync job gave back, for the next one (no 1 MiB allocation per sync).
    spare_buf: Option<Vec<u8>>,
    /// An append failed: nothing may be made durable before [`Journal::rollback`] ran.
    rollback_due: bool,
    /// Tests: the next append fails as an IO error would.
    #[cfg(test)]
    pub(crate) fail_next_append: bool,
    buf_offset: u64,
    /// Checkpointed segment files kept for reuse by the next rolls.
    spares: Vec<PathBuf>,
    /// The active segment was a spare (every block written before), not created preallocated.
    active_was_spare: bool,
}

/// Most spare segments kept ready for the next rolls; older checkpointed segments are deleted.
const SPARES_MAX: usize = 2;

/// A spare being zero-filled ([`zero_filled_spare`]); one left by a crash is deleted at open.
const ZEROING_NAME: &str = "zeroing.tmp";

/// Bytes of zeros a spare is written and made durable in, one piece after another: the disk's queue then
/// never holds more than this ahead of the journal's own `fdatasync`s, which run meanwhile.
const ZERO_FILL_CHUNK: usize = 1 << 20;

/// Appended frames are written out once this many bytes wait in the buffer.
const WRITE_BUFFER_BYTES: usize = 1 << 20;

impl Journal {
    /// Opens the journal in `dir`, replays every frame from `checkpoint` on through `replay` (called with
    /// the frame's position and body), cuts whatever follows the last good frame, and deletes segments that
    /// end before the checkpoint.
    pub(crate) fn open(
        dir: &Path,
        capacity: u64,
        checkpoint: Position,
        mut replay: impl FnMut(Position, &[u8]) -> StoreResult<()>,
    ) -> StoreResult<Journal> {
        fs::create_dir_all(dir).map_err(|e| StoreError::io("create journal directory", e))?;
        let mut segments = list_segments(dir)?;
        if !segments.contains_key(&checkpoint.segment) {
            if checkpoint != Position::ORIGIN || !segments.is_empty() {
                return Err(StoreError::Corrupt {
                    location: CorruptLocation::Journal { segment: checkpoint.segment, offset: checkpoint.offset },
                    detail: "the journal segment named by the checkpoint is missing",
                });
            }
            let path = segment_path(dir, checkpoint.segment);
            create_segment(&path, capacity)?;
            segments.insert(checkpoint.segment, path);
        }
        // Segments before the checkpoint's are all in sled (a crash between the sled batch and their deletion
        // leaves them behind).
        let stale: Vec<u64> = segments.range(..checkpoint.segment).map(|(first, _)| *first).collect();
        for first in stale {
            let path = segments.remove(&first).expect("listed");
            fs::remove_file(&path).map_err(|e| StoreError::io("delete journal segment", e))?;
        }
        let end = scan(&segments, checkpoint, &mut replay)?;
        // Cut: zero everything after the last good frame and drop later segments, so garbage left by a torn
        // write can never be read as frames after new ones are written over part of it.
        let later: Vec<u64> = segments.range(end.segment + 1..).map(|(first, _)| *first).collect();
        for first in later {
            let path = segments.remove(&first).expect("listed");
            fs::remove_file(&path).map_err(|e| StoreError::io("delete journal segment", e))?;
        }
        let path = &segments[&end.segment];
        let file =
            OpenOptions::new().read(true).write(true).open(path).map_err(|e| StoreError::io("open segment", e))?;
        zero_from(&file, end.offset, capacity)?;
        sync_dir(dir)?;
        let active = Segment { first_frame: end.segment, file: Arc::new(file), len: end.offset };
        match fs::remove_file(dir.join(ZEROING_NAME)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(StoreError::io("delete unfinished spare", e)),
            _ => {}
        }
        Ok(Journal {
            dir: dir.to_path_buf(),
            capacity,
            active,
            closed_unsynced: Vec::new(),
            dir_changes: 0,
            dir_synced: 0,
            next_frame: end.next_frame,
            segments,
            synced: end,
            buf: Vec::with_capacity(WRITE_BUFFER_BYTES),
            spare_buf: None,
            rollback_due: false,
            #[cfg(test)]
            fail_next_append: false,
            buf_offset: end.offset,
            spares: list_spares(dir)?,
            active_was_spare: false,
        })
    }

    /// Largest body a frame can carry.
    pub(crate) fn body_bytes_max(&self) -> u64 {
        self.capacity - FRAME_HEADER_BYTES
    }

    /// Appends a frame carrying `body` (not yet durable; possibly not yet written to the file).
    #[cfg(test)]
    pub(crate) fn append(&mut self, body: &[u8]) -> StoreResult<()> {
        self.append_encoded(body.len(), |out| out.extend_from_slice(body))
    }

    /// Appends a frame whose body `encode` writes straight into the journal's buffer; the body must take
    /// at most `body_len_max` bytes (which decides whether the frame still fits in the active segment).
    pub(crate) fn append_encoded(&mut self, body_len_max: usize, encode: impl FnOnce(&mut Vec<u8>)) -> StoreResult<()> {
        let max = u32::try_from(body_len_max).ok().filter(|len| u64::from(*len) <= self.body_bytes_max());
        let Some(max) = max else {
            return Err(StoreError::io("journal append", io::Error::other("frame larger than a segment")));
        };
        #[cfg(test)]
        if std::mem::take(&mut self.fail_next_append) {
            return Err(StoreError::io("journal write", io::Error::other("injected by a test")));
        }
        if self.active.len + FRAME_HEADER_BYTES + u64::from(max) > self.capacity {
            self.roll()?;
        }
        let frame_seq = self.next_frame;
        let start = self.buf.len();
        self.buf.extend_from_slice(&[0; 8]); // length and CRC, filled in below
        self.buf.extend_from_slice(&frame_seq.to_le_bytes());
        encode(&mut self.buf);
        let body_start = start + 16;
        // The bound was promised up front (it decided the segment roll): a longer body is a bug, and
        // writing such a frame could run past the segment, so it is refused.
        let len = match u32::try_from(self.buf.len() - body_start).ok().filter(|len| *len <= max) {
            Some(len) => len,
            None => {
                self.buf.truncate(start);
                return Err(StoreError::io("journal append", io::Error::other("encoded frame longer than promised")));
            }
        };
        let crc = frame_crc(frame_seq, &self.buf[body_start..]);
        self.buf[start..start + 4].copy_from_slice(&len.to_le_bytes());
        self.buf[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
        self.active.len += FRAME_HEADER_BYTES + u64::from(len);
        self.next_frame += 1;
        if self.buf.len() >= WRITE_BUFFER_BYTES {
            self.write_buffer()?;
        }
        Ok(())
    }

    /// Writes the buffered frames to the active segment.
    fn write_buffer(&mut self) -> StoreResult<()> {
        if !self.buf.is_empty() {
            self.active
                .file
                .write_all_at(&self.buf, self.buf_offset)
                .map_err(|e| StoreError::io("journal write", e))?;
            self.buf.clear();
        }
        self.buf_offset = self.active.len;
        Ok(())
    }

    fn roll(&mut self) -> StoreResult<()> {
        self.write_buffer()?;
        let path = segment_path(&self.dir, self.next_frame);
        self.active_was_spare = !self.spares.is_empty();
        let file = match self.spares.pop() {
            Some(spare) => {
                fs::rename(&spare, &path).map_err(|e| StoreError::io("reuse journal segment", e))?;
                OpenOptions::new().read(true).write(true).open(&path).map_err(|e| StoreError::io("open segment", e))?
            }
            None => create_segment(&path, self.capacity)?,
        };
        let old =
            std::mem::replace(&mut self.active, Segment { first_frame: self.next_frame, file: Arc::new(file), len: 0 });
        self.closed_unsynced.push(old.file);
        self.segments.insert(self.next_frame, path);
        self.dir_changes += 1;
        self.buf_offset = 0;
        Ok(())
    }

    /// Makes every appended frame durable: one `fdatasync` of the active segment (plus any segment filled
    /// since the last sync, and the directory if a segment was created). Returns the position after the last
    /// frame.
    #[cfg(test)]
    pub(crate) fn sync(&mut self) -> StoreResult<Position> {
        let job = self.prepare_sync();
        job.run()?;
        let position = job.position;
        self.complete_sync(job);
        Ok(position)
    }

    /// Hands the buffered frames to a job that writes them and makes everything appended durable. The job
    /// runs without the journal (frames appended meanwhile wait for the next sync);
    /// [`Journal::complete_sync`] records its success.
    pub(crate) fn prepare_sync(&mut self) -> SyncJob {
        // The buffer is written by the job, outside the lock: appends go on into a fresh buffer meanwhile
        // (at later offsets), instead of waiting for the copy into the page cache.
        let pending = (!self.buf.is_empty()).then(|| {
            let fresh = self.spare_buf.take().unwrap_or_else(|| Vec::with_capacity(WRITE_BUFFER_BYTES));
            (Arc::clone(&self.active.file), self.buf_offset, std::mem::replace(&mut self.buf, fresh))
        });
        self.buf_offset = self.active.len;
        let mut files = self.closed_unsynced.clone();
        files.push(Arc::clone(&self.active.file));
        let dir = (self.dir_changes > self.dir_synced).then(|| self.dir.clone());
        SyncJob {
            pending,
            files,
            dir,
            closed: self.closed_unsynced.len(),
            dir_changes: self.dir_changes,
            position: self.position(),
        }
    }

    /// Records that `job` succeeded.
    pub(crate) fn complete_sync(&mut self, job: SyncJob) {
        if let Some((_, _, mut bytes)) = job.pending {
            bytes.clear();
            self.spare_buf = Some(bytes);
        }
        let closed = job.closed.min(self.closed_unsynced.len());
        self.closed_unsynced.drain(..closed);
        if job.dir.is_some() {
            self.dir_synced = self.dir_synced.max(job.dir_changes);
        }
        if (job.position.segment, job.position.offset) > (self.synced.segment, self.synced.offset) {
            self.synced = job.position;
        }
    }

    /// The position after the last appended frame.
    pub(crate) fn position(&self) -> Position {
        Position { segment: self.active.first_frame, offset: self.active.len, next_frame: self.next_frame }
    }

    /// Records that appends failed and the journal must be rolled back before the next sync: the rollback
    /// waits for any sync job still running (see [`SyncJob`]), and a sync that comes first must not make
    /// the failed frames durable.
    pub(crate) fn mark_rollback_due(&mut self) {
        self.rollback_due = true;
    }

    /// `true` between [`Journal::mark_rollback_due`] and the next [`Journal::rollback`].
    pub(crate) fn rollback_due(&self) -> bool {
        self.rollback_due
    }

    /// Undoes every frame appended since the last sync (after a failed write or sync).
    pub(crate) fn rollback(&mut self) -> StoreResult<()> {
        self.rollback_due = false;
        let synced = self.synced;
        let later: Vec<u64> = self.segments.range(synced.segment + 1..).map(|(first, _)| *first).collect();
        for first in later {
            let path = self.segments.remove(&first).expect("listed");
            fs::remove_file(&path).map_err(|e| StoreError::io("delete journal segment", e))?;
        }
        if self.active.first_frame != synced.segment {
            let path = &self.segments[&synced.segment];
            let file =
                OpenOptions::new().read(true).write(true).open(path).map_err(|e| StoreError::io("open segment", e))?;
            self.active = Segment { first_frame: synced.segment, file: Arc::new(file), len: synced.offset };
        }
        self.buf.clear();
        self.buf_offset = synced.offset;
        zero_from(&self.active.file, synced.offset, self.capacity)?;
        sync_dir(&self.dir)?;
        self.active.len = synced.offset;
        self.next_frame = synced.next_frame;
        self.closed_unsynced.clear();
        self.dir_synced = self.dir_changes;
        Ok(())
    }

    /// Deletes every segment that ends before `checkpoint` (their frames are all in sled). Returns how many.
    pub(crate) fn delete_before(&mut self, checkpoint: Position) -> StoreResult<usize> {
        let stale: Vec<u64> = self.segments.range(..checkpoint.segment).map(|(first, _)| *first).collect();
        for first in &stale {
            let path = self.segments.remove(first).expect("listed");
            if self.spares.len() < SPARES_MAX {
                let spare = self.dir.join(format!("{first:020}.spare"));
                fs::rename(&path, &spare).map_err(|e| StoreError::io("keep journal segment", e))?;
                self.spares.push(spare);
            } else {
                fs::remove_file(&path).map_err(|e| StoreError::io("delete journal segment", e))?;
            }
        }
        Ok(stale.len())
    }

    /// Number of segment files on disk.
    pub(crate) fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Spares wanted before the journal holds [`SPARES_MAX`].
    pub(crate) fn spares_missing(&self) -> usize {
        SPARES_MAX.saturating_sub(self.spares.len())
    }

    /// Puts a spare in place of an active segment that was created preallocated and holds no frame yet
    /// (a journal just created starts in one); `true` if it did. Its syncs are then as cheap as in any
    /// later segment (see [`zero_filled_spare`]).
    pub(crate) fn start_in_a_spare(&mut self) -> StoreResult<bool> {
        if self.active_was_spare || self.active.len != 0 || !self.buf.is_empty() {
            return Ok(false);
        }
        let Some(spare) = self.spares.pop() else { return Ok(false) };
        let path = segment_path(&self.dir, self.active.first_frame);
        // Either file at this path is a valid empty segment, so a crash around the rename loses nothing.
        fs::rename(&spare, &path).map_err(|e| StoreError::io("reuse journal segment", e))?;
        let file =
            OpenOptions::new().read(true).write(true).open(&path).map_err(|e| StoreError::io("open segment", e))?;
        self.active.file = Arc::new(file);
        self.active_was_spare = true;
        self.dir_changes += 1;
        Ok(true)
    }

    /// The journal's directory and segment size, for [`zero_filled_spare`].
    pub(crate) fn spare_shape(&self) -> (PathBuf, u64) {
        (self.dir.clone(), self.capacity)
    }

    /// Keeps the spare at `path` (from [`zero_filled_spare`]) for the next rolls, or deletes it if
    /// recycled segments filled the spares meanwhile.
    pub(crate) fn add_spare(&mut self, path: PathBuf) -> StoreResult<()> {
        if self.spares.len() < SPARES_MAX {
            self.spares.push(path);
            Ok(())
        } else {
            fs::remove_file(&path).map_err(|e| StoreError::io("delete spare segment", e))
        }
    }
}

/// Writes a new spare segment of `capacity` bytes of zeros in `dir`, durable, and returns its path (for
/// [`Journal::add_spare`]), or `None` if `go_on` said stop between two pieces (the log is closing).
/// Runs without the journal's lock; one at a time per directory.
///
/// Why zeros and not only reserved blocks: a preallocated segment's blocks are reserved but unwritten,
/// and the first write into each makes the next `fdatasync` also commit the file system's record of
/// them. Measured here (store_bench's journal at 10,000 channels): runs into recycled or zero-filled
/// segments reach 1.75–1.87 M records/s against 1.44–1.70 M into fresh preallocated ones. PostgreSQL
/// zero-fills its WAL segments for the same reason.
pub(crate) fn zero_filled_spare(dir: &Path, capacity: u64, go_on: impl Fn() -> bool) -> StoreResult<Option<PathBuf>> {
    let staging = dir.join(ZEROING_NAME);
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&staging)
        .map_err(|e| StoreError::io("create spare segment", e))?;
    let zeros = vec![0u8; ZERO_FILL_CHUNK];
    let mut offset = 0;
    while offset < capacity {
        if !go_on() {
            drop(file);
            fs::remove_file(&staging).map_err(|e| StoreError::io("delete unfinished spare", e))?;
            return Ok(None);
        }
        let len = usize::try_from(capacity - offset).map_or(zeros.len(), |rest| rest.min(zeros.len()));
        file.write_all_at(&zeros[..len], offset).map_err(|e| StoreError::io("zero-fill spare segment", e))?;
        file.sync_data().map_err(|e| StoreError::io("fdatasync spare segment", e))?;
        offset += len as u64;
    }
    file.sync_all().map_err(|e| StoreError::io("fsync spare segment", e))?;
    // A name no spare has: recycled ones are named after their first frame, these after a free number.
    let path = (0u64..)
        .map(|n| dir.join(format!("zeroed-{n}.spare")))
        .find(|candidate| !candidate.exists())
        .expect("some number is free");
    fs::rename(&staging, &path).map_err(|e| StoreError::io("keep spare segment", e))?;
    sync_dir(dir)?;
    Ok(Some(path))
}

fn frame_crc(frame_seq: u64, body: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&frame_seq.to_le_bytes());
    hasher.update(body);
    hasher.finalize()
}

/// Replays frames from `from` through the last good one; returns the position after it.
fn scan(
    segments: &BTreeMap<u64, PathBuf>,
    from: Position,
    replay: &mut impl FnMut(Position, &[u8]) -> StoreResult<()>,
) -> StoreResult<Position> {
    let mut pos = from;
    loop {
        let bytes = fs::read(&segments[&pos.segment]).map_err(|e| StoreError::io("read journal segment", e))?;
        while let Some(body) = frame_at(&bytes, pos) {
            replay(pos, body)?;
            pos.offset += FRAME_HEADER_BYTES + body.len() as u64;
            pos.next_frame += 1;
        }
        // No good frame here: the segment is full or the log ends. It goes on only in a segment that starts
        // exactly at the next frame.
        if segments.contains_key(&pos.next_frame) && pos.next_frame != pos.segment {
            pos = Position { segment: pos.next_frame, offset: 0, next_frame: pos.next_frame };
        } else {
            return Ok(pos);
        }
    }
}

/// The body of the frame at `pos`, if a good frame with the expected seq is there.
fn frame_at(bytes: &[u8], pos: Position) -> Option<&[u8]> {
    let start = usize::try_from(pos.offset).ok()?;
    let header = bytes.get(start..start.checked_add(16)?)?;
    let body_len = usize::try_from(u32::from_le_bytes(header[0..4].try_into().ok()?)).ok()?;
    let crc = u32::from_le_bytes(header[4..8].try_into().ok()?);
    let frame_seq = u64::from_le_bytes(header[8..16].try_into().ok()?);
    if body_len == 0 || frame_seq != pos.next_frame {
        return None;
    }
    let body = bytes.get(start + 16..(start + 16).checked_add(body_len)?)?;
    (frame_crc(frame_seq, body) == crc).then_some(body)
}

fn segment_path(dir: &Path, first_frame: u64) -> PathBuf {
    dir.join(format!("{first_frame:020}.seg"))
}

pub(super) fn list_segments(dir: &Path) -> StoreResult<BTreeMap<u64, PathBuf>> {
    let mut segments = BTreeMap::new();
    for entry in fs::read_dir(dir).map_err(|e| StoreError::io("list journal", e))? {
        let entry = entry.map_err(|e| StoreError::io("list journal", e))?;
        let name = entry.file_name();
        let first = name.to_str().and_then(|n| n.strip_suffix(".seg")).and_then(|n| n.parse::<u64>().ok());
        if let Some(first) = first {
            segments.insert(first, entry.path());
        }
    }
    Ok(segments)
}

/// Spare segments left by an earlier run (any beyond [`SPARES_MAX`] are deleted).
fn list_spares(dir: &Path) -> StoreResult<Vec<PathBuf>> {
    let mut spares = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| StoreError::io("list journal", e))? {
        let path = entry.map_err(|e| StoreError::io("list journal", e))?.path();
        if path.extension().is_some_and(|e| e == "spare") {
            if spares.len() < SPARES_MAX {
                spares.push(path);
            } else {
                fs::remove_file(&path).map_err(|e| StoreError::io("delete spare segment", e))?;
            }
        }
    }
    Ok(spares)
}

/// Creates a segment and reserves its blocks, so appends do not allocate and an `fdatasync` has no file
/// size or allocation metadata to write.
fn create_segment(path: &Path, capacity: u64) -> StoreResult<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| StoreError::io("create journal segment", e))?;
    preallocate(&file, 0, capacity)?;
    file.sync_all().map_err(|e| StoreError::io("fsync new segment", e))?;
    Ok(file)
}

fn preallocate(file: &File, from: u64, capacity: u64) -> StoreResult<()> {
    if from >= capacity {
        return Ok(());
    }
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), from, capacity - from) {
        Ok(()) => Ok(()),
        // A file system without fallocate: a sparse file of the right length still reads as zeros.
        Err(rustix::io::Errno::OPNOTSUPP) => file.set_len(capacity).map_err(|e| StoreError::io("size segment", e)),
        Err(e) => Err(StoreError::io("preallocate journal segment", e.into())),
    }
}

/// Zeroes `[offset, capacity)` of a segment (truncate, then preallocate again) and makes it durable.
fn zero_from(file: &File, offset: u64, capacity: u64) -> StoreResult<()> {
    file.set_len(offset).map_err(|e| StoreError::io("truncate journal segment", e))?;
    preallocate(file, offset, capacity)?;
    file.sync_all().map_err(|e| StoreError::io("fsync journal segment", e))
}

fn sync_dir(dir: &Path) -> StoreResult<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| StoreError::io("fsync journal directory", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(dir: &Path, checkpoint: Position, seen: &mut Vec<Vec<u8>>) -> Journal {
        Journal::open(dir, 4096, checkpoint, |_, body| {
            seen.push(body.to_vec());
            Ok(())
        })
        .unwrap()
    }

    /// The frames a journal opened in `dir` from `checkpoint` replays.
    fn replayed(dir: &Path, checkpoint: Position) -> Vec<Vec<u8>> {
        let mut seen = Vec::new();
        open(dir, checkpoint, &mut seen);
        seen
    }

    /// The first little-endian `u32` of each frame replayed from `checkpoint` (the tests write a counter
    /// there).
    fn first_words_replayed(dir: &Path, checkpoint: Position) -> Vec<u32> {
        replayed(dir, checkpoint).iter().map(|b| u32::from_le_bytes(b[..4].try_into().unwrap())).collect()
    }

    /// Overwrites the byte at `offset` of the segment whose first frame is `segment`.
    fn overwrite_byte(dir: &Path, segment: u64, offset: u64) {
        let file = OpenOptions::new().write(true).open(segment_path(dir, segment)).unwrap();
        file.write_all_at(b"X", offset).unwrap();
    }

    /// Appends a frame to `journal`, opened after a cut that kept `kept` frames, and checks that the
    /// journal reopened replays the kept frames and then it: nothing of what was cut comes back.
    fn next_frame_follows_the_cut(mut journal: Journal, dir: &Path, kept: usize) {
        journal.append(b"after").unwrap();
        journal.sync().unwrap();
        drop(journal);
        let seen = replayed(dir, Position::ORIGIN);
        assert_eq!(seen.len(), kept + 1);
        assert_eq!(seen[kept], b"after");
    }

    #[test]
    fn frames_survive_reopen_and_roll_across_segments() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = open(dir.path(), Position::ORIGIN, &mut Vec::new());
        for i in 0..100u32 {
            journal.append(&[u8::try_from(i % 256).unwrap(); 100]).unwrap();
        }
        journal.sync().unwrap();
        assert!(journal.segment_count() > 2, "100 frames of 116 bytes fill several 4 KiB segments");
        drop(journal);
        let mut seen = Vec::new();
        let journal = open(dir.path(), Position::ORIGIN, &mut seen);
        assert_eq!(seen.len(), 100);
        assert!(seen.iter().enumerate().all(|(i, b)| b[0] == u8::try_from(i % 256).unwrap()));
        assert_eq!(journal.position().next_frame, 101);
    }

    #[test]
    fn torn_tail_is_cut_at_the_last_good_frame() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = open(dir.path(), Position::ORIGIN, &mut Vec::new());
        for _ in 0..5 {
            journal.append(b"hello journal").unwrap();
        }
        journal.sync().unwrap();
        let end = journal.position();
        drop(journal);
        // Tear the last frame: flip a byte of its body.
        overwrite_byte(dir.path(), 1, end.offset - 2);
        let mut seen = Vec::new();
        let journal = open(dir.path(), Position::ORIGIN, &mut seen);
        assert_eq!(seen.len(), 4);
        // New frames continue right after the good ones, and the torn bytes are gone.
        next_frame_follows_the_cut(journal, dir.path(), 4);
    }

    /// A bad frame in the middle of the journal, with whole segments after it: everything from it on is
    /// cut, the later segments' files too (their frames follow a gap and can never be replayed), and new
    /// frames follow the last good one.
    #[test]
    fn a_bad_frame_cuts_every_later_segment_and_new_frames_follow_the_last_good_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = open(dir.path(), Position::ORIGIN, &mut Vec::new());
        let mut third_end = None;
        for i in 0..100u32 {
            let mut body = i.to_le_bytes().to_vec();
            body.resize(100, 7);
            journal.append(&body).unwrap();
            if i == 2 {
                third_end = Some(journal.position());
            }
        }
        journal.sync().unwrap();
        assert!(journal.segment_count() > 2, "100 frames of 116 bytes fill several 4 KiB segments");
        drop(journal);
        let third_end = third_end.unwrap();
        assert_eq!(third_end.segment, 1, "the fourth frame is in the first segment");
        overwrite_byte(dir.path(), 1, third_end.offset + FRAME_HEADER_BYTES + 50);
        let mut seen = Vec::new();
        let journal = open(dir.path(), Position::ORIGIN, &mut seen);
        assert_eq!(seen.len(), 3, "replay stops at the bad frame");
        assert_eq!(journal.segment_count(), 1, "the later segments are gone from the journal");
        assert_eq!(list_segments(dir.path()).unwrap().len(), 1, "and from the disk");
        next_frame_follows_the_cut(journal, dir.path(), 3);
    }

    #[test]
    fn frames_appended_while_a_sync_job_writes_follow_its_frames() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = open(dir.path(), Position::ORIGIN, &mut Vec::new());
        journal.append(b"one").unwrap();
        journal.append(b"two").unwrap();
        let job = journal.prepare_sync();
        // The job holds the buffered frames; appends go on (past a roll, too) before it writes them.
        for _ in 0..40 {
            journal.append(&[3u8; 100]).unwrap();
        }
        assert!(journal.segment_count() > 1);
        job.run().unwrap();
        let position = job.position;
        journal.complete_sync(job);
        assert_eq!(position.next_frame, 3, "the job made the first two frames durable");
        journal.append(b"last").unwrap();
        journal.sync().unwrap();
        drop(journal);
        let seen = replayed(dir.path(), Position::ORIGIN);
        assert_eq!(seen.len(), 43);
        assert_eq!(
            (seen[0].as_slice(), seen[1].as_slice(), seen[42].as_slice()),
            (&b"one"[..], &b"two"[..], &b"last"[..])
        );
        assert!(seen[2..42].iter().all(|frame| frame == &[3u8; 100]));
    }

    #[test]
    fn rollback_undoes_unsynced_frames_across_a_roll() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = open(dir.path(), Position::ORIGIN, &mut Vec::new());
        journal.append(b"kept").unwrap();
        journal.sync().unwrap();
        for _ in 0..60 {
            journal.append(&[7u8; 100]).unwrap();
        }
        assert!(journal.segment_count() > 1);
        journal.rollback().unwrap();
        assert_eq!(journal.segment_count(), 1);
        journal.append(b"next").unwrap();
        journal.sync().unwrap();
        drop(journal);
        let seen = replayed(dir.path(), Position::ORIGIN);
        assert_eq!(seen, vec![b"kept".to_vec(), b"next".to_vec()]);
    }

    #[test]
    fn replay_starts_at_the_checkpoint_and_old_segments_are_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = open(dir.path(), Position::ORIGIN, &mut Vec::new());
        for _ in 0..80 {
            journal.append(&[1u8; 100]).unwrap();
        }
        let checkpoint = journal.sync().unwrap();
        journal.append(b"after checkpoint").unwrap();
        journal.sync().unwrap();
        let before = journal.segment_count();
        drop(journal);
        let mut seen = Vec::new();
        let journal = open(dir.path(), checkpoint, &mut seen);
        assert_eq!(seen, vec![b"after checkpoint".to_vec()]);
        assert!(journal.segment_count() < before);
        assert_eq!(journal.segment_count(), 1);
    }

    #[test]
    fn recycled_segments_never_replay_their_old_frames() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = open(dir.path(), Position::ORIGIN, &mut Vec::new());
        for i in 0..200u32 {
            journal.append(&i.to_le_bytes().repeat(25)).unwrap();
        }
        let checkpoint = journal.sync().unwrap();
        assert!(journal.delete_before(checkpoint).unwrap() >= 2);
        assert_eq!(journal.spares.len(), SPARES_MAX);
        // The next rolls reuse the spares, full of old frames.
        for i in 0..60u32 {
            journal.append(&(1000 + i).to_le_bytes().repeat(25)).unwrap();
        }
        journal.sync().unwrap();
        assert!(journal.spares.len() < SPARES_MAX, "a spare was reused");
        drop(journal);
        assert_eq!(first_words_replayed(dir.path(), checkpoint), (1000..1060).collect::<Vec<_>>());
    }

    #[test]
    fn zero_filled_spares_are_taken_by_the_next_rolls_and_replay_nothing_of_their_own() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = open(dir.path(), Position::ORIGIN, &mut Vec::new());
        assert_eq!(journal.spares_missing(), SPARES_MAX);
        let (spare_dir, capacity) = journal.spare_shape();
        for _ in 0..SPARES_MAX {
            let spare = zero_filled_spare(&spare_dir, capacity, || true).unwrap().expect("not stopped");
            let bytes = fs::read(&spare).unwrap();
            assert_eq!(bytes.len() as u64, capacity);
            assert!(bytes.iter().all(|&b| b == 0), "a spare holds zeros only");
            journal.add_spare(spare).unwrap();
        }
        assert_eq!(journal.spares_missing(), 0);
        assert!(journal.start_in_a_spare().unwrap(), "the new journal's empty first segment is replaced");
        assert!(!journal.start_in_a_spare().unwrap(), "only once");
        assert_eq!(journal.spares_missing(), 1);
        journal.add_spare(zero_filled_spare(&spare_dir, capacity, || true).unwrap().unwrap()).unwrap();
        let extra = zero_filled_spare(&spare_dir, capacity, || true).unwrap().unwrap();
        journal.add_spare(extra.clone()).unwrap();
        assert!(!extra.exists(), "a spare beyond the most kept is deleted");
        assert!(zero_filled_spare(&spare_dir, capacity, || false).unwrap().is_none(), "stopped");
        assert!(!spare_dir.join(ZEROING_NAME).exists(), "a stopped fill leaves nothing behind");
        for i in 0..60u32 {
            journal.append(&i.to_le_bytes().repeat(25)).unwrap();
        }
        journal.sync().unwrap();
        assert!(journal.segment_count() > 1 && journal.spares_missing() > 0, "rolls took spares");
        drop(journal);
        assert_eq!(first_words_replayed(dir.path(), Position::ORIGIN), (0..60).collect::<Vec<_>>());
    }

    #[test]
    fn a_segment_holding_frames_is_never_replaced_by_a_spare() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = open(dir.path(), Position::ORIGIN, &mut Vec::new());
        journal.append(b"kept").unwrap();
        let (spare_dir, capacity) = journal.spare_shape();
        journal.add_spare(zero_filled_spare(&spare_dir, capacity, || true).unwrap().unwrap()).unwrap();
        assert!(!journal.start_in_a_spare().unwrap(), "a frame is buffered");
        journal.sync().unwrap();
        assert!(!journal.start_in_a_spare().unwrap(), "a frame is written");
        drop(journal);
        assert_eq!(replayed(dir.path(), Position::ORIGIN), vec![b"kept".to_vec()]);
    }

    #[test]
    fn a_spare_left_half_filled_by_a_crash_is_deleted_at_open() {
        let dir = tempfile::tempdir().unwrap();
        drop(open(dir.path(), Position::ORIGIN, &mut Vec::new()));
        fs::write(dir.path().join(ZEROING_NAME), [0u8; 100]).unwrap();
        let journal = open(dir.path(), Position::ORIGIN, &mut Vec::new());
        assert!(!dir.path().join(ZEROING_NAME).exists());
        assert_eq!(journal.spares_missing(), SPARES_MAX, "not taken for a spare");
    }

    #[test]
    fn missing_checkpoint_segment_is_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let mut journal = open(dir.path(), Position::ORIGIN, &mut Vec::new());
        journal.append(b"x").unwrap();
        journal.sync().unwrap();
        drop(journal);
        let checkpoint = Position { segment: 500, offset: 0, next_frame: 500 };
        let result = Journal::open(dir.path(), 4096, checkpoint, |_, _| Ok(()));
        assert!(matches!(result, Err(StoreError::Corrupt { .. })));
    }
}
