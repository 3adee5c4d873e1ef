//! Slot commands (raft entry payloads): any bytes decode to a command or a typed error, and a decoded
//! command round-trips.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tidings_slot::command::Command;

fuzz_target!(|data: &[u8]| {
    if let Ok(command) = Command::decode(data) {
        assert_eq!(Command::decode(&command.encode()).ok(), Some(command));
    }
});
