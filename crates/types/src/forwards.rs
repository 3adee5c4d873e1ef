//! [`TakenForwards`]: the forwarded requests a node took lately, so that a copy the network delivers
//! again is not taken twice.

use crate::NodeId;
use rustc_hash::FxHashSet;
use std::collections::VecDeque;

/// The forwarded requests a node took lately, by the node that forwarded them and its id for the request.
///
/// A frame delivered twice (a network, or a host transport that resends after a reconnect) must be taken
/// once: taken twice, an append would commit twice, and a metadata write applied again after a later
/// acknowledged write to the same key would undo that write. Ids must not repeat across the forwarding
/// node's starts (the ids tidings hands out carry the start's `boot_id` in their high bits).
///
/// Bounded: past `capacity` the oldest are forgotten first, so a copy arriving after `capacity` newer
/// forwards is taken again (~40 B each).
///
/// ```
/// use tidings_types::{NodeId, TakenForwards};
///
/// let mut taken = TakenForwards::new(2);
/// let n = NodeId::new(1);
/// assert!(taken.first_time(n, 7));
/// assert!(!taken.first_time(n, 7), "a second copy");
/// assert!(taken.first_time(n, 8) && taken.first_time(n, 9));
/// assert!(taken.first_time(n, 7), "forgotten: two newer came since");
/// ```
#[derive(Debug)]
pub struct TakenForwards {
    taken: FxHashSet<(NodeId, u64)>,
    order: VecDeque<(NodeId, u64)>,
    capacity: usize,
}

impl Default for TakenForwards {
    /// Remembers the last [`TakenForwards::REMEMBERED`] forwards.
    fn default() -> Self {
        Self::new(Self::REMEMBERED)
    }
}

impl TakenForwards {
    /// How many forwards a node's channel shards and slot-group driver each remember: a copy delivered
    /// again later than this many newer forwards is taken again (~640 KiB at the most).
    pub const REMEMBERED: usize = 16_384;

    /// Remembers the last `capacity` forwards (at least one).
    pub fn new(capacity: usize) -> Self {
        Self { taken: FxHashSet::default(), order: VecDeque::new(), capacity: capacity.max(1) }
    }

    /// `true` the first time `from`'s forward `id` is offered (among the ones remembered): take it.
    pub fn first_time(&mut self, from: NodeId, id: u64) -> bool {
        if !self.taken.insert((from, id)) {
            return false;
        }
        self.order.push_back((from, id));
        if self.order.len() > self.capacity {
            if let Some(oldest) = self.order.pop_front() {
                self.taken.remove(&oldest);
            }
        }
        true
    }
}
