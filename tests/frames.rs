//! Wire frames against random and mutated bytes: a typed error or the original frame, never a panic.

use proptest::prelude::*;
use tidings::channel::machine::{ChannelMessage, PullHint, PullRequest};
use tidings::frame::{decode, encode, Frame, FrameBody, FrameLimits};
use tidings::types::{ChannelId, ChannelType, Epoch, LeaderEpoch, NodeId, Seq, StorageId};

fn sample() -> Frame {
    let pull = PullRequest {
        channel: ChannelId::new(ChannelType::GROUP, "room").unwrap(),
        pull_id: 9,
        leader_epoch: LeaderEpoch::new(2),
        epoch: Epoch::new(1),
        next_seq: Seq::new(40),
        last_epoch: LeaderEpoch::new(2),
        max_bytes: 1 << 20,
    };
    Frame {
        cluster: 1,
        from: NodeId::new(2),
        storage: StorageId::new(7),
        start: 5,
        to_start: 6,
        body: FrameBody::Channel(ChannelMessage::Pull(pull)),
    }
}

proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&bytes, &FrameLimits::default());
    }

    #[test]
    fn mutated_frames_are_refused_or_unchanged(position in any::<prop::sample::Index>(), mask in 1u8..=255) {
        let frame = sample();
        let mut bytes = encode(&frame).to_vec();
        let i = position.index(bytes.len());
        bytes[i] ^= mask;
        // A flipped bit anywhere is caught by the header checks or the checksum.
        prop_assert!(decode(&bytes, &FrameLimits::default()).is_err());
    }

    #[test]
    fn truncated_frames_are_refused(cut in 0usize..64) {
        let bytes = encode(&sample());
        let cut = cut.min(bytes.len() - 1);
        prop_assert!(decode(&bytes[..cut], &FrameLimits::default()).is_err());
    }
}

#[test]
fn hint_round_trips() {
    let hint =
        PullHint { channel: ChannelId::new(ChannelType::PERSON, "a@b").unwrap(), leader_epoch: LeaderEpoch::new(1) };
    let body = FrameBody::Channel(ChannelMessage::Hint(hint));
    let frame = Frame { cluster: 3, from: NodeId::new(1), storage: StorageId::new(7), start: 5, to_start: 6, body };
    assert_eq!(decode(&encode(&frame), &FrameLimits::default()).unwrap(), frame);
}

#[test]
fn a_batch_of_channel_messages_round_trips_in_order() {
    let FrameBody::Channel(pull) = sample().body else { unreachable!("the sample carries one message") };
    let hint = ChannelMessage::Hint(PullHint {
        channel: ChannelId::new(ChannelType::GROUP, "other").unwrap(),
        leader_epoch: LeaderEpoch::new(3),
    });
    let body = FrameBody::Channels(vec![hint.clone(), pull, hint]);
    let frame = Frame { cluster: 3, from: NodeId::new(1), storage: StorageId::new(7), start: 5, to_start: 6, body };
    assert_eq!(decode(&encode(&frame), &FrameLimits::default()).unwrap(), frame);
}
