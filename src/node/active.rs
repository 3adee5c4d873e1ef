//! The channel replicas a node holds in memory, with what the core needs to drive them cheaply: which
//! ones took an input since their effects were last drained, when each one's next timer fires, and
//! when each one was last used (for eviction).
//!
//! At 10,000 active channels the core handles about one input per channel per group commit, so the
//! bookkeeping around a machine must cost O(1) per input, not a walk of ordered maps keyed by channel
//! names: the replicas live in one hash map, the drain list is a vector with a flag per replica, and
//! timers sit in a min-heap ordered by `(time, filing number)` whose outdated entries are skipped when
//! they reach the top (a replica's filed time in its entry is the truth).

use rustc_hash::FxHashMap;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use tidings_channel::machine::ChannelMachine;
use tidings_types::{ChannelId, Time};

/// One replica in memory.
struct Active {
    machine: ChannelMachine,
    /// The timer filed in the heap for this replica (`None`: none filed).
    timer: Option<Time>,
    /// When the replica last had an input (eviction picks idle ones).
    last_used: Time,
    /// On the drain list.
    dirty: bool,
}

/// A timer filed in the heap: outdated once the replica's entry names another time (or is gone).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Filed {
    at: Time,
    /// Filing order: ties at one millisecond fire in the order they were filed, without comparing names.
    number: u64,
    channel: ChannelId,
}

/// Active channel replicas (see the module docs).
#[derive(Default)]
pub(super) struct ActiveChannels {
    entries: FxHashMap<ChannelId, Active>,
    dirty: Vec<ChannelId>,
    timers: BinaryHeap<Reverse<Filed>>,
    filed: u64,
}

impl ActiveChannels {
    /// Number of replicas in memory.
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(super) fn contains(&self, channel: &ChannelId) -> bool {
        self.entries.contains_key(channel)
    }

    pub(super) fn get(&self, channel: &ChannelId) -> Option<&ChannelMachine> {
        self.entries.get(channel).map(|a| &a.machine)
    }

    /// The replica, put on the drain list: whatever the caller feeds it, its effects will be drained and
    /// its timer filed again.
    pub(super) fn get_marked(&mut self, channel: &ChannelId) -> Option<&mut ChannelMachine> {
        let active = self.entries.get_mut(channel)?;
        if !active.dirty {
            active.dirty = true;
            self.dirty.push(channel.clone());
        }
        Some(&mut active.machine)
    }

    /// Every replica, in no particular order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&ChannelId, &ChannelMachine)> {
        self.entries.iter().map(|(c, a)| (c, &a.machine))
    }

    /// Adds a new replica, used now and on the drain list.
    pub(super) fn insert(&mut self, channel: ChannelId, machine: ChannelMachine, now: Time) {
        self.dirty.push(channel.clone());
        let active = Active { machine, timer: None, last_used: now, dirty: true };
        if self.entries.insert(channel, active).is_some() {
            // Replaced in place: its old heap entries are outdated and skipped.
            self.forget_outdated();
        }
    }

    /// Takes a replica out (its heap entries become outdated; its drain-list entry is skipped).
    pub(super) fn remove(&mut self, channel: &ChannelId) -> Option<ChannelMachine> {
        let active = self.entries.remove(channel)?;
        if active.dirty {
            self.dirty.retain(|c| c != channel);
        }
        self.forget_outdated();
        Some(active.machine)
    }

    /// Marks the replica as used now.
    pub(super) fn touch(&mut self, channel: &ChannelId, now: Time) {
        if let Some(active) = self.entries.get_mut(channel) {
            active.last_used = now;
        }
    }

    /// When the replica was last used.
    pub(super) fn last_used(&self, channel: &ChannelId) -> Option<Time> {
        self.entries.get(channel).map(|a| a.last_used)
    }

    /// Next replica on the drain list (taken off it). The caller drains its effects, then calls
    /// [`ActiveChannels::reschedule`].
    pub(super) fn pop_dirty(&mut self) -> Option<ChannelId> {
        while let Some(channel) = self.dirty.pop() {
            if let Some(active) = self.entries.get_mut(&channel) {
                active.dirty = false;
                return Some(channel);
            }
        }
        None
    }

    /// The replica's machine, to drain its effects (not put on the drain list again).
    pub(super) fn machine_mut(&mut self, channel: &ChannelId) -> Option<&mut ChannelMachine> {
        self.entries.get_mut(channel).map(|a| &mut a.machine)
    }

    /// Files the replica's next timer as its machine now asks.
    pub(super) fn reschedule(&mut self, channel: &ChannelId) {
        let Some(active) = self.entries.get_mut(channel) else { return };
        let next = active.machine.poll_timeout();
        if next == active.timer {
            return;
        }
        active.timer = next;
        if let Some(at) = next {
            self.filed += 1;
            self.timers.push(Reverse(Filed { at, number: self.filed, channel: channel.clone() }));
        }
        self.forget_outdated();
    }

    /// Files again every replica on the drain list (their machines may want an earlier timer).
    pub(super) fn reschedule_dirty(&mut self) {
        for channel in self.dirty.clone() {
            self.reschedule(&channel);
        }
    }

    /// The earliest timer: of the filed ones, and of the replicas on the drain list (their machines
    /// took inputs since they were last filed).
    pub(super) fn next_timeout(&self) -> Option<Time> {
        let filed = self.timers.peek().map(|Reverse(f)| f.at);
        let touched = self.dirty.iter().filter_map(|c| self.entries.get(c)?.machine.poll_timeout());
        touched.chain(filed).min()
    }

    /// The next replica whose filed timer is due at `now` (its timer is then unfiled; the caller fires
    /// it, and it is on the drain list).
    pub(super) fn pop_due(&mut self, now: Time) -> Option<ChannelId> {
        let Reverse(head) = self.timers.peek()?;
        if head.at > now {
            return None;
        }
        let Reverse(Filed { channel, .. }) = self.timers.pop().expect("peeked");
        if let Some(active) = self.entries.get_mut(&channel) {
            active.timer = None;
            if !active.dirty {
                active.dirty = true;
                self.dirty.push(channel.clone());
            }
        }
        self.forget_outdated();
        Some(channel)
    }

    /// Keeps the heap's top current (so [`ActiveChannels::next_timeout`] never reports an outdated time)
    /// and its size within a few times the number of replicas.
    fn forget_outdated(&mut self) {
        while let Some(Reverse(head)) = self.timers.peek() {
            let current = self.entries.get(&head.channel).is_some_and(|a| a.timer == Some(head.at));
            if current {
                break;
            }
            self.timers.pop();
        }
        if self.timers.len() > 4 * self.entries.len() + 1024 {
            let entries = &self.entries;
            let kept: Vec<_> = std::mem::take(&mut self.timers)
                .into_vec()
                .into_iter()
                .filter(|Reverse(f)| entries.get(&f.channel).is_some_and(|a| a.timer == Some(f.at)))
                .collect();
            self.timers = BinaryHeap::from(kept);
        }
    }
}
