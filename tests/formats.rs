//! The encodings that outlive a build: wire frames (read by other nodes, maybe of another build), slot
//! commands (kept in raft logs and snapshots) and stored message-log values (journal frames, packs and
//! channel states in sled). The files under `fuzz/seeds/` were written by `cargo run --example
//! fuzz_corpus` and are committed: this build must read every one of them and write it back byte for
//! byte. When this fails, a layout changed. For frames, bump `FRAME_VERSION` and write the files again.
//! For commands and stored values, which stay on disk across an upgrade, keep the old layout readable:
//! add a version or a flag, then add the new encoding beside the old one.

use std::path::{Path, PathBuf};
use tidings::frame::{decode, encode, FrameLimits, FRAME_VERSION};
use tidings::slot::command::Command;
use tidings::store::message::stored;

fn fixtures(kind: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds").join(kind);
    let mut files: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.expect("directory entry").path();
            let bytes = std::fs::read(&path).expect("fixture reads");
            (path, bytes)
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no fixtures under {}", dir.display());
    files
}

#[test]
fn every_committed_frame_decodes_and_encodes_to_the_same_bytes() {
    for (path, bytes) in fixtures("frame_decode") {
        assert_eq!(bytes[2], FRAME_VERSION, "{}: written by another frame version", path.display());
        let frame = decode(&bytes, &FrameLimits::default())
            .unwrap_or_else(|e| panic!("{}: {e} (a frame layout changed: bump FRAME_VERSION)", path.display()));
        assert_eq!(encode(&frame)[..], bytes[..], "{}: a frame layout changed: bump FRAME_VERSION", path.display());
    }
}

#[test]
fn every_committed_slot_command_decodes_and_encodes_to_the_same_bytes() {
    for (path, bytes) in fixtures("slot_command") {
        let command = Command::decode(&bytes)
            .unwrap_or_else(|e| panic!("{}: {e}: raft logs holding it would not replay", path.display()));
        assert_eq!(command.encode(), bytes, "{}: the command's layout changed", path.display());
    }
}

#[test]
fn every_committed_stored_value_decodes_and_encodes_to_the_same_bytes() {
    let files = fixtures("stored_records");
    let read =
        |name: &str| files.iter().find(|(p, _)| p.ends_with(name)).map(|(_, b)| b.clone()).expect("fixture present");
    let batch = stored::batch_from_bytes(&read("batch")).expect("the journal frame body decodes");
    assert_eq!(stored::batch_to_bytes(&batch), read("batch"));
    let pack = stored::pack_from_bytes(&read("pack")).expect("the pack decodes");
    assert_eq!(stored::pack_to_bytes(&pack), read("pack"));
    let state = stored::state_from_bytes(&read("state")).expect("the channel state decodes");
    assert_eq!(stored::state_to_bytes(&state), read("state"));
}
