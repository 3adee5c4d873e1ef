//! Rendezvous (highest-random-weight) hashing: every node scores each candidate for a key, and the
//! highest scores win. Channel placement, repair targets and drain targets all choose this way, so that
//! every node computes the same choice from the same inputs and choices spread evenly over the nodes.
//!
//! The score must mix the key and the candidate thoroughly. CRC32, used here before, does not: it is
//! affine over GF(2), so for keys of one length the scores of two candidates differ by a constant that
//! depends only on the candidates, and which one wins is decided by one or two bits of the key's CRC.
//! With three nodes that gave one node half of all channel leaderships and the two others a quarter
//! each (see the test below). The score is now FNV-1a over the key, combined with the candidate and run
//! through a 64-bit finalizer (MurmurHash3's `fmix64` constants), which spreads every input bit over the
//! whole score. The function is fixed here, not taken from `std`'s hasher, whose output may change
//! between Rust releases: nodes built by different compilers must agree.

use tidings_types::NodeId;

/// The score of `candidate` for `key`: the candidate with the highest score wins.
pub(crate) fn score(key: &[u8], candidate: NodeId) -> u64 {
    finalize(fnv1a(key) ^ finalize(candidate.get()))
}

/// The candidate with the highest score for `key`, if any.
pub(crate) fn best(key: &[u8], candidates: impl IntoIterator<Item = NodeId>) -> Option<NodeId> {
    candidates.into_iter().max_by_key(|candidate| score(key, *candidate))
}

/// `candidates` ordered by their score for `key`, highest first.
pub(crate) fn ranked(key: &[u8], candidates: impl IntoIterator<Item = NodeId>) -> Vec<NodeId> {
    let mut scored: Vec<(u64, NodeId)> = candidates.into_iter().map(|c| (score(key, c), c)).collect();
    scored.sort_unstable_by(|a, b| b.cmp(a));
    scored.into_iter().map(|(_, candidate)| candidate).collect()
}

fn fnv1a(bytes: &[u8]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes.iter().fold(OFFSET, |hash, byte| (hash ^ u64::from(*byte)).wrapping_mul(PRIME))
}

/// A bijection on 64-bit words in which every input bit flips each output bit with probability ~1/2.
fn finalize(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(count: u64) -> Vec<NodeId> {
        (1..=count).map(NodeId::new).collect()
    }

    /// Keys shaped like the ones callers hash: channel keys of one length, as a workload names them.
    fn keys(count: usize) -> impl Iterator<Item = Vec<u8>> {
        (0..count).map(|i| format!("room-{i:06}").into_bytes())
    }

    /// How many of `keys` each node wins, as a share of them.
    fn shares(keys: impl Iterator<Item = Vec<u8>>, nodes: &[NodeId], winner: impl Fn(&[u8]) -> NodeId) -> Vec<f64> {
        let mut wins = vec![0u32; nodes.len()];
        let mut total = 0u32;
        for key in keys {
            let won = winner(&key);
            wins[nodes.iter().position(|n| *n == won).expect("a candidate wins")] += 1;
            total += 1;
        }
        wins.into_iter().map(|w| f64::from(w) / f64::from(total)).collect()
    }

    #[test]
    fn each_node_wins_its_fair_share_of_keys() {
        for count in [3, 4, 5, 7] {
            let nodes = nodes(count);
            let fair = 1.0 / count as f64;
            let shares = shares(keys(30_000), &nodes, |key| best(key, nodes.iter().copied()).expect("candidates"));
            for (node, share) in nodes.iter().zip(&shares) {
                // 30,000 keys: one standard deviation of a share is under 0.3 points.
                assert!((share - fair).abs() < 0.015, "{count} nodes: node {node} wins {share:.3}, fair {fair:.3}");
            }
        }
    }

    #[test]
    fn a_crc32_score_is_biased_which_is_why_it_is_not_used() {
        let nodes = nodes(3);
        let crc_best = |key: &[u8]| {
            *nodes
                .iter()
                .max_by_key(|n| {
                    let mut hasher = crc32fast::Hasher::new();
                    hasher.update(key);
                    hasher.update(&n.get().to_le_bytes());
                    hasher.finalize()
                })
                .expect("candidates")
        };
        let shares = shares(keys(30_000), &nodes, crc_best);
        // Exactly, for these keys: the winner is decided by two bits of the key's CRC.
        assert_eq!(shares, vec![0.25, 0.5, 0.25], "CRC32 rendezvous gives one of three nodes half the keys");
    }

    #[test]
    fn second_places_spread_too_so_replica_sets_are_even() {
        // Five nodes, three replicas each: every node should hold three fifths of the keys.
        let nodes = nodes(5);
        let mut held = vec![0u32; nodes.len()];
        let total = 20_000;
        for key in keys(total) {
            for replica in ranked(&key, nodes.iter().copied()).into_iter().take(3) {
                held[nodes.iter().position(|n| *n == replica).expect("a node")] += 1;
            }
        }
        for (node, count) in nodes.iter().zip(held) {
            let share = f64::from(count) / total as f64;
            assert!((share - 0.6).abs() < 0.02, "node {node} holds {share:.3} of the keys, fair 0.6");
        }
    }

    #[test]
    fn ranking_is_a_stable_function_of_key_and_candidates() {
        let nodes = nodes(4);
        let key = b"room-000042";
        let forward = ranked(key, nodes.iter().copied());
        let backward = ranked(key, nodes.iter().rev().copied());
        assert_eq!(forward, backward, "the order candidates are offered in does not matter");
        assert_eq!(forward.len(), 4);
        assert_eq!(best(key, nodes.iter().copied()), Some(forward[0]));
        assert_eq!(best(key, std::iter::empty()), None);
        // A fixed function: these values must never change, or nodes of two builds place channels apart.
        assert_eq!(score(b"", NodeId::new(1)), 9_636_248_883_060_146_568);
        assert_eq!(score(b"room-000042", NodeId::new(2)), 4_891_472_515_383_742_404);
        assert_eq!(score(&[7, 4, b'r', b'o', b'o', b'm'], NodeId::new(3)), 5_157_972_279_894_518_415);
    }
}
