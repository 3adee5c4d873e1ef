//! Hostile input thrown at a live three-node cluster (virtual time): random bytes, bit flips, truncations
//! and spoofed senders of real frames are refused with a typed error and counted, and change nothing;
//! real frames with a mutated body sealed again (so they pass the checksum) reach the protocols and
//! must not panic them. Throughout, the cluster keeps serving and every acknowledged message stays
//! readable, in order, on every replica.

mod support;

use proptest::prelude::*;
use support::{read_all, Cluster};
use tidings::types::{ChannelId, ChannelType, NodeId, Seq};

#[derive(Clone, Debug)]
enum Hostile {
    Random { to: u64, bytes: Vec<u8> },
    Flip { to: u64, frame: usize, position: usize, mask: u8 },
    Truncate { to: u64, frame: usize, cut: usize },
    Spoof { to: u64, frame: usize, claimed: u64 },
    Reseal { to: u64, frame: usize, position: usize, mask: u8 },
}

fn hostile() -> impl Strategy<Value = Hostile> {
    let to = 1u64..=3;
    let frame = 0usize..200;
    prop_oneof![
        (to.clone(), proptest::collection::vec(any::<u8>(), 0..300))
            .prop_map(|(to, bytes)| Hostile::Random { to, bytes }),
        (to.clone(), frame.clone(), any::<usize>(), 1u8..=255).prop_map(|(to, frame, position, mask)| Hostile::Flip {
            to,
            frame,
            position,
            mask
        }),
        (to.clone(), frame.clone(), 1usize..64).prop_map(|(to, frame, cut)| Hostile::Truncate { to, frame, cut }),
        (to.clone(), frame.clone(), 0u64..6).prop_map(|(to, frame, claimed)| Hostile::Spoof { to, frame, claimed }),
        (to, frame, any::<usize>(), 1u8..=255).prop_map(|(to, frame, position, mask)| Hostile::Reseal {
            to,
            frame,
            position,
            mask
        }),
    ]
}

/// The frame body of sealed `bytes` (after the 11-byte header the frame module documents).
const HEADER: usize = 11;

proptest! {
    // `TIDINGS_HOSTILE_CASES=N` for a longer run.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("TIDINGS_HOSTILE_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(24),
        ..ProptestConfig::default()
    })]

    #[test]
    fn a_live_cluster_refuses_garbage_and_keeps_serving(inputs in proptest::collection::vec(hostile(), 1..80)) {
        let mut cluster = Cluster::new(3);
        cluster.capture_max = 200;
        cluster.run_for(3_000);
        let room = ChannelId::new(ChannelType::GROUP, "hostile").unwrap();
        cluster.create_channel(1, &room);
        let mut acked: Vec<(Seq, String)> = Vec::new();
        let mut pending = Vec::new();
        let mut refused = 0u64;
        for (i, input) in inputs.iter().enumerate() {
            if i % 8 == 0 {
                let text = format!("m{i}");
                pending.push((cluster.append(1 + (i as u64 % 3), &room, &[&text]), text));
            }
            let captured = cluster.captured.clone();
            let pick = |frame: usize| captured[frame % captured.len()].clone();
            let now = cluster.now;
            let (to, from, bytes, must_refuse) = match input {
                Hostile::Random { to, bytes } => (*to, NodeId::new(1 + to % 3), bytes.clone(), false),
                Hostile::Flip { to, frame, position, mask } => {
                    let (from, _, bytes) = pick(*frame);
                    let mut bytes = bytes.to_vec();
                    let at = position % bytes.len();
                    bytes[at] ^= mask;
                    (*to, from, bytes, true)
                }
                Hostile::Truncate { to, frame, cut } => {
                    let (from, _, bytes) = pick(*frame);
                    let keep = bytes.len().saturating_sub(*cut);
                    (*to, from, bytes[..keep].to_vec(), true)
                }
                Hostile::Spoof { to, frame, claimed } => {
                    let (from, _, bytes) = pick(*frame);
                    let claimed = NodeId::new(*claimed);
                    if claimed == from {
                        continue;
                    }
                    (*to, claimed, bytes.to_vec(), true)
                }
                Hostile::Reseal { to, frame, position, mask } => {
                    let (from, _, bytes) = pick(*frame);
                    let mut body = bytes[HEADER..].to_vec();
                    let at = position % body.len();
                    body[at] ^= mask;
                    (*to, from, tidings::frame::seal(&body).to_vec(), false)
                }
            };
            let result = cluster.core(to).handle_frame(now, from, &bytes);
            if must_refuse {
                prop_assert!(result.is_err(), "{input:?} was accepted");
            }
            refused += u64::from(result.as_ref().is_err_and(|e| !about_starts(e.kind())));
            cluster.run_for(5);
        }
        // Whatever it was fed, the cluster still takes appends through every node.
        cluster.run_for(2_000);
        for n in 1..=3 {
            let text = format!("after-{n}");
            let mut ok = false;
            for _ in 0..40 {
                let id = cluster.append(n, &room, &[&text]);
                cluster.run_for(500);
                if let Some(seqs) = cluster.appended.get(&id) {
                    acked.push((seqs[0], text.clone()));
                    ok = true;
                    break;
                }
            }
            prop_assert!(ok, "node {n} no longer serves appends: {:?}", cluster.results);
        }
        for (id, text) in pending {
            if let Some(seqs) = cluster.appended.get(&id) {
                acked.push((seqs[0], text));
            }
        }
        // Refusals are counted, and every acknowledged message is readable, in order, on every replica.
        // Leaving out refusals for a start: a frame resealed with another start in it teaches its
        // receiver that start of the sender, and the cluster's own frames to the sender are refused
        // until its next frame teaches the right one again (see `node::peer_starts`).
        let counted: u64 = (1..=3)
            .flat_map(|n| cluster.core(n).status().refused_frames)
            .filter(|(kind, _)| !about_starts(kind))
            .map(|(_, count)| count)
            .sum();
        prop_assert_eq!(counted, refused);
        // Long enough for a follower whose pull answer was refused to pull again: a resealed frame may
        // have taught its receiver another start of the sender, whose next frame (a ping at the
        // latest) teaches the right one again.
        cluster.run_for(5_000);
        for n in 1..=3 {
            let read = read_all(cluster.core(n), &room).unwrap();
            let got: Vec<(Seq, String)> =
                read.iter().map(|r| (r.seq, String::from_utf8_lossy(&r.payload).into_owned())).collect();
            prop_assert!(got.windows(2).all(|w| w[0].0 < w[1].0), "node {n} out of order");
            for a in &acked {
                prop_assert!(got.contains(a), "node {n} misses acknowledged {a:?}");
            }
        }
    }
}

/// `true` for the refusals of a frame meant for another start of its receiver, or a forward meant for
/// none.
fn about_starts(kind: &str) -> bool {
    matches!(kind, "earlier_start" | "unaddressed_forward")
}
