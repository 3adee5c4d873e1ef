//! Wire frames: any bytes decode to a frame or a typed error; a decoded frame encodes back to bytes
//! that decode to the same frame.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tidings::frame::{decode, encode, seal, FrameLimits};

fuzz_target!(|data: &[u8]| {
    let limits = FrameLimits { frame_bytes_max: 1 << 20 };
    if let Ok(frame) = decode(data, &limits) {
        assert_eq!(decode(&encode(&frame), &limits).ok(), Some(frame));
    }
    // The same bytes as a body behind a valid header reach the body decoder past the checksum.
    if let Ok(frame) = decode(&seal(data), &limits) {
        assert_eq!(decode(&encode(&frame), &limits).ok(), Some(frame));
    }
});
