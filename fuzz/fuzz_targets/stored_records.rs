//! Stored message-log values: journal frame bodies, sled packs and channel states. Any bytes decode to
//! a value or `None` (the log reports `Corrupt` with its location), and a decoded value round-trips.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tidings_store::message::stored;

fuzz_target!(|data: &[u8]| {
    if let Some(batch) = stored::batch_from_bytes(data) {
        assert_eq!(stored::batch_from_bytes(&stored::batch_to_bytes(&batch)), Some(batch));
    }
    if let Some(records) = stored::pack_from_bytes(data) {
        assert_eq!(stored::pack_from_bytes(&stored::pack_to_bytes(&records)), Some(records));
    }
    if let Some(state) = stored::state_from_bytes(data) {
        assert_eq!(stored::state_from_bytes(&stored::state_to_bytes(&state)), Some(state));
    }
});
