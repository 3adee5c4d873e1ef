//! The channel replicas a node holds in memory, with what the core needs to drive them cheaply: which
//! ones took an input since their effects were last drained, when each one's next timer fires, and
//! when each one was last used (for eviction).
//!
//! At 10,000 active channels the core handles about one input per channel per group commit, so the
//! bookkeeping around a machine must cost O(1) per input, not a walk of ordered maps keyed by channel
//! names. Replicas live in slots of a vector, found by name through one hash map; the drain list and the
//! timers name slots, not channels, so draining a replica or firing its timer hashes and compares no
//! channel name (perf at 10,000 channels: those lookups, each a cache miss on the stored name's bytes,
//! were about a fifth of a reactor's time). Timers sit in a min-heap ordered by `(time, filing number)`;
//! a filed timer is current only while its slot's replica names its filing number, so outdated entries
//! (refiled, removed, or a slot reused by another replica) are skipped when they reach the top.

use crate::machine::{ChannelMachine, Effect};
use rustc_hash::FxHashMap;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use tidings_types::{ChannelId, Time};

pub use tidings_store::shrink_if_sparse;

use super::warm::WARM_RUN;

/// Most emptied effect buffers kept to lend to replicas put on the drain list (see
/// [`ChannelMachine::lend_effect_buffer`]): about one drain's worth.
const SPARE_BUFFERS_MAX: usize = 256;
/// Largest buffer (in effects) kept for lending; a larger one, left by a burst, is given back.
const SPARE_BUFFER_EFFECTS_MAX: usize = 16;

/// One replica in memory.
struct Active {
    channel: ChannelId,
    /// Boxed: slots stay small, so the slot vector of a burst costs little once most are evicted.
    machine: Box<ChannelMachine>,
    /// The timer filed in the heap for this replica: its time and filing number (`None`: none filed).
    timer: Option<(Time, u64)>,
    /// When the replica last had an input (eviction picks idle ones).
    last_used: Time,
    /// When the replica came into memory (a replica is not evicted for another's room right after).
    active_since: Time,
    /// On the drain list.
    dirty: bool,
}

/// A timer filed in the heap: current only while its slot's replica names its filing number.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Filed {
    at: Time,
    /// Filing order: ties at one millisecond fire in the order they were filed. Unique, so it also
    /// tells a current entry from an outdated one.
    number: u64,
    slot: u32,
}

/// Active channel replicas (see the module docs).
#[derive(Default)]
pub struct ActiveChannels {
    index: FxHashMap<ChannelId, u32>,
    slots: Vec<Option<Active>>,
    /// Empty slots, reused before the vector grows.
    free: Vec<u32>,
    /// Slots to drain. May name a slot twice or an emptied one: draining skips a slot whose replica is
    /// not marked dirty.
    dirty: Vec<u32>,
    timers: BinaryHeap<Reverse<Filed>>,
    filed: u64,
    /// Drains left before the next run of the drain list is touched (see [`ActiveChannels::drain_next`]);
    /// 0 at the start of each drain.
    drain_warmed: usize,
    /// Emptied effect buffers, lent to replicas as they go on the drain list and taken back when they are
    /// drained: an input then costs no allocation for its effects (at most [`SPARE_BUFFERS_MAX`]).
    spare: Vec<VecDeque<Effect>>,
}

impl ActiveChannels {
    /// Number of replicas in memory.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// `true` when no replica is in memory.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// `true` if `channel`'s replica is in memory.
    pub fn contains(&self, channel: &ChannelId) -> bool {
        self.index.contains_key(channel)
    }

    fn slot(&self, channel: &ChannelId) -> Option<&Active> {
        let &slot = self.index.get(channel)?;
        self.slots[slot as usize].as_ref()
    }

    fn slot_mut(&mut self, channel: &ChannelId) -> Option<(u32, &mut Active)> {
        let &slot = self.index.get(channel)?;
        Some((slot, self.slots[slot as usize].as_mut()?))
    }

    /// The replica of `channel`, untouched (not put on the drain list).
    pub fn get(&self, channel: &ChannelId) -> Option<&ChannelMachine> {
        self.slot(channel).map(|a| &*a.machine)
    }

    /// Puts `slot`'s replica on the drain list unless it is on it, lending it a spare effect buffer.
    fn mark(dirty: &mut Vec<u32>, spare: &mut Vec<VecDeque<Effect>>, slot: u32, active: &mut Active) {
        if !active.dirty {
            active.dirty = true;
            dirty.push(slot);
            if let Some(refused) = spare.pop().and_then(|buffer| active.machine.lend_effect_buffer(buffer)) {
                spare.push(refused);
            }
        }
    }

    /// The replica, put on the drain list: whatever the caller feeds it, its effects will be drained and
    /// its timer filed again.
    pub fn get_marked(&mut self, channel: &ChannelId) -> Option<&mut ChannelMachine> {
        let &slot = self.index.get(channel)?;
        let active = self.slots[slot as usize].as_mut()?;
        Self::mark(&mut self.dirty, &mut self.spare, slot, active);
        Some(&mut active.machine)
    }

    /// The replica, put on the drain list and marked as used now: one lookup for what an input to an
    /// active replica needs.
    pub fn get_used(&mut self, channel: &ChannelId, now: Time) -> Option<&mut ChannelMachine> {
        let &slot = self.index.get(channel)?;
        let active = self.slots[slot as usize].as_mut()?;
        active.last_used = now;
        Self::mark(&mut self.dirty, &mut self.spare, slot, active);
        Some(&mut active.machine)
    }

    /// Touches `channel`'s replica, if it is in memory, ahead of feeding it (see [`ChannelMachine::warm`]
    /// and [`WARM_RUN`]). Returns a value only so that the reads stay.
    pub fn warm(&self, channel: &ChannelId) -> u64 {
        self.index.get(channel).map_or(0, |&slot| self.warm_slot(slot))
    }

    fn warm_slot(&self, slot: u32) -> u64 {
        self.slots[slot as usize].as_ref().map_or(0, |a| a.last_used.as_millis() ^ a.machine.warm())
    }

    /// Takes the next replica off the drain list with every effect its machine has, and files its timer
    /// again — no lookup by name. Feeding the replica while handling those effects puts it back on the
    /// drain list.
    pub fn drain_next(&mut self, effects: &mut Vec<Effect>) -> Option<ChannelId> {
        if self.drain_warmed == 0 {
            // The drain list is taken from its end: touch the next run's replicas in one loop.
            let run = self.dirty.len().saturating_sub(WARM_RUN);
            std::hint::black_box(self.dirty[run..].iter().fold(0, |acc, &slot| acc ^ self.warm_slot(slot)));
            self.drain_warmed = WARM_RUN;
        }
        self.drain_warmed -= 1;
        while let Some(slot) = self.dirty.pop() {
            let Some(active) = self.slots[slot as usize].as_mut().filter(|a| a.dirty) else { continue };
            active.dirty = false;
            let buffer = active.machine.drain_effects_returning_buffer(effects);
            if buffer.capacity() > 0
                && buffer.capacity() <= SPARE_BUFFER_EFFECTS_MAX
                && self.spare.len() < SPARE_BUFFERS_MAX
            {
                self.spare.push(buffer);
            }
            let channel = active.channel.clone();
            self.refile(slot);
            return Some(channel);
        }
        // The drain ended: the next one starts by touching its first run.
        self.drain_warmed = 0;
        None
    }

    /// Every replica, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&ChannelId, &ChannelMachine)> {
        self.slots.iter().flatten().map(|a| (&a.channel, &*a.machine))
    }

    /// Adds a new replica, used now and on the drain list (replacing one of the same channel in place).
    pub fn insert(&mut self, channel: ChannelId, machine: ChannelMachine, now: Time) {
        let active =
            Active { channel, machine: Box::new(machine), timer: None, last_used: now, active_since: now, dirty: true };
        let slot = match self.index.get(&active.channel) {
            // Replaced in place: its filed timers name another number now, so they are outdated.
            Some(&slot) => slot,
            None => {
                let slot = self.free.pop().unwrap_or_else(|| {
                    self.slots.push(None);
                    u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 replicas")
                });
                self.index.insert(active.channel.clone(), slot);
                slot
            }
        };
        self.slots[slot as usize] = Some(active);
        self.dirty.push(slot);
        self.forget_outdated();
    }

    /// Takes a replica out (its heap entries become outdated; its drain-list entries are skipped).
    pub fn remove(&mut self, channel: &ChannelId) -> Option<ChannelMachine> {
        let slot = self.index.remove(channel)?;
        let active = self.slots[slot as usize].take()?;
        self.free.push(slot);
        self.forget_outdated();
        shrink_if_sparse(&mut self.index);
        self.compact_if_sparse();
        Some(*active.machine)
    }

    /// Marks the replica as used now.
    pub fn touch(&mut self, channel: &ChannelId, now: Time) {
        if let Some((_, active)) = self.slot_mut(channel) {
            active.last_used = now;
        }
    }

    /// When the replica was last used.
    pub fn last_used(&self, channel: &ChannelId) -> Option<Time> {
        self.slot(channel).map(|a| a.last_used)
    }

    /// When the replica came into memory (its last [`ActiveChannels::insert`]).
    pub fn active_since(&self, channel: &ChannelId) -> Option<Time> {
        self.slot(channel).map(|a| a.active_since)
    }

    /// The replica's machine, to drain its effects (not put on the drain list again).
    pub fn machine_mut(&mut self, channel: &ChannelId) -> Option<&mut ChannelMachine> {
        self.slot_mut(channel).map(|(_, a)| &mut *a.machine)
    }

    /// Files `slot`'s next timer as its machine now asks, unless a timer filed earlier is still current:
    /// that one fires first and [`ActiveChannels::pop_due`] then files the one asked for. Most inputs move
    /// a replica's timer later (a pull moves the park deadline); filing each move cost a heap push per
    /// input and left the old entry for a rebuild to collect, where an early entry costs one check when
    /// it comes due.
    fn refile(&mut self, slot: u32) {
        let Some(active) = self.slots[slot as usize].as_mut() else { return };
        let next = active.machine.poll_timeout();
        let filed = active.timer.map(|(at, _)| at);
        if filed.is_some_and(|filed| next.is_none_or(|next| next >= filed)) || (next.is_none() && filed.is_none()) {
            return;
        }
        active.timer = next.map(|at| {
            self.filed += 1;
            self.timers.push(Reverse(Filed { at, number: self.filed, slot }));
            (at, self.filed)
        });
        self.forget_outdated();
    }

    /// Files again every replica on the drain list (their machines may want an earlier timer).
    pub fn reschedule_dirty(&mut self) {
        // `refile` leaves the drain list as it is: walk it by index rather than copy it.
        for i in 0..self.dirty.len() {
            let slot = self.dirty[i];
            if self.slots[slot as usize].as_ref().is_some_and(|a| a.dirty) {
                self.refile(slot);
            }
        }
    }

    /// The earliest timer: of the filed ones, and of the replicas on the drain list (their machines
    /// took inputs since they were last filed).
    pub fn next_timeout(&self) -> Option<Time> {
        let filed = self.timers.peek().map(|Reverse(f)| f.at);
        let touched = self
            .dirty
            .iter()
            .filter_map(|&slot| self.slots[slot as usize].as_ref().filter(|a| a.dirty)?.machine.poll_timeout());
        touched.chain(filed).min()
    }

    /// The next replica whose timer is due at `now` by its machine (its timer is then unfiled; the
    /// caller fires it, and it is on the drain list). An entry that comes due before the time its machine
    /// now wants (see `refile`) is filed again at that time instead.
    pub fn pop_due(&mut self, now: Time) -> Option<ChannelId> {
        loop {
            let Reverse(head) = self.timers.peek()?;
            if head.at > now {
                return None;
            }
            let Reverse(filed) = self.timers.pop().expect("peeked");
            // The top is kept current (`forget_outdated`); an outdated one would be skipped all the same.
            if !Self::is_current(&self.slots, &filed) {
                continue;
            }
            let active = self.slots[filed.slot as usize].as_mut().expect("current: its slot holds a replica");
            active.timer = None;
            if active.machine.poll_timeout().is_none_or(|at| at > now) {
                // Filed before the machine moved its timer later (see `refile`): file the one it wants.
                self.refile(filed.slot);
                self.forget_outdated();
                continue;
            }
            Self::mark(&mut self.dirty, &mut self.spare, filed.slot, active);
            let channel = active.channel.clone();
            self.forget_outdated();
            return Some(channel);
        }
    }

    /// `true` if `filed` is the timer its slot's replica has filed now.
    fn is_current(slots: &[Option<Active>], filed: &Filed) -> bool {
        slots[filed.slot as usize].as_ref().is_some_and(|a| a.timer.is_some_and(|(_, n)| n == filed.number))
    }

    /// Keeps the heap's top current (so [`ActiveChannels::next_timeout`] never reports an outdated time)
    /// and its size within a few times the number of replicas.
    fn forget_outdated(&mut self) {
        while let Some(Reverse(head)) = self.timers.peek() {
            if Self::is_current(&self.slots, head) {
                break;
            }
            self.timers.pop();
        }
        if self.timers.len() > 4 * self.index.len() + 1024 {
            let slots = &self.slots;
            let kept: Vec<_> = std::mem::take(&mut self.timers)
                .into_vec()
                .into_iter()
                .filter(|Reverse(f)| Self::is_current(slots, f))
                .collect();
            self.timers = BinaryHeap::from(kept);
        }
        if self.timers.capacity() > 4 * self.timers.len() + 1024 {
            // Room left by a burst: the rebuild above collects in place, keeping the old allocation
            // (heaptrack: ~130 B per evicted replica once 10,000 were evicted).
            self.timers.shrink_to(2 * self.timers.len());
        }
    }

    /// Once most slots are empty (a burst evicted), moves the replicas to the front and gives the rest
    /// back: slots, drain list and timers are renumbered together.
    fn compact_if_sparse(&mut self) {
        if self.slots.len() <= 4 * self.index.len() + 1024 {
            return;
        }
        let mut renumbered = vec![u32::MAX; self.slots.len()];
        let mut slots = Vec::with_capacity(2 * self.index.len());
        for (old, active) in std::mem::take(&mut self.slots).into_iter().enumerate() {
            if let Some(active) = active {
                let new = u32::try_from(slots.len()).expect("fewer than 2^32 replicas");
                renumbered[old] = new;
                *self.index.get_mut(&active.channel).expect("indexed") = new;
                slots.push(Some(active));
            }
        }
        self.slots = slots;
        self.free = Vec::new();
        let dirty = std::mem::take(&mut self.dirty);
        self.dirty = dirty.into_iter().map(|old| renumbered[old as usize]).filter(|&new| new != u32::MAX).collect();
        let timers = std::mem::take(&mut self.timers).into_vec();
        let timers: Vec<_> = timers
            .into_iter()
            .filter_map(|Reverse(f)| {
                let slot = renumbered[f.slot as usize];
                (slot != u32::MAX).then_some(Reverse(Filed { slot, ..f }))
            })
            .collect();
        self.timers = BinaryHeap::from(timers);
        self.forget_outdated();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::{ChannelMessage, Effect, MachineConfig, PullBody, PullRequest, PullResponse};
    use tidings_store::message::ChannelLogState;
    use tidings_types::{ChannelRuntimeMeta, ChannelType, Epoch, LeaderEpoch, NodeId, Seq};

    /// A follower replica created at `now_ms`: its only timer is the resend of the pull it just sent.
    fn follower(name: &str, now_ms: u64) -> (ChannelId, ChannelMachine) {
        let (channel, machine, _) = follower_with(name, now_ms, MachineConfig::default());
        (channel, machine)
    }

    /// Like [`follower`], with `config`; also returns the pull it sent.
    fn follower_with(name: &str, now_ms: u64, config: MachineConfig) -> (ChannelId, ChannelMachine, PullRequest) {
        let channel = ChannelId::new(ChannelType::GROUP, name).expect("channel id");
        let now = Time::from_millis(now_ms);
        let mut machine =
            ChannelMachine::new(channel.clone(), NodeId::new(2), config, 1, now, ChannelLogState::default(), vec![]);
        let meta = ChannelRuntimeMeta {
            channel: channel.clone(),
            version: 1,
            leader: NodeId::new(1),
            replicas: vec![NodeId::new(1), NodeId::new(2)],
            isr: vec![NodeId::new(1), NodeId::new(2)],
            min_isr: 1,
            epoch: Epoch::new(1),
            leader_epoch: LeaderEpoch::new(1),
            write_fence: None,
            retention_through: Seq::new(0),
        };
        machine.handle_meta(now, meta).expect("first meta");
        let pull = pulls(&mut machine).pop().expect("a follower pulls once it has a meta");
        assert_eq!(machine.effects_capacity(), 0, "a drained machine keeps no effect buffer");
        assert!(machine.poll_timeout().is_some(), "a follower waiting for its pull has a timer");
        (channel, machine, pull)
    }

    /// Drains the machine's effects; returns the pulls it sent.
    fn pulls(machine: &mut ChannelMachine) -> Vec<PullRequest> {
        std::iter::from_fn(|| machine.poll_effect())
            .filter_map(|effect| match effect {
                Effect::Send { message: ChannelMessage::Pull(request), .. } => Some(request),
                _ => None,
            })
            .collect()
    }

    /// `count` follower replicas inserted and drained (each has filed its timer); returns their channels.
    fn burst(active: &mut ActiveChannels, count: usize) -> Vec<ChannelId> {
        let channels = (0..count)
            .map(|i| {
                let (channel, machine) = follower(&format!("burst-{i}"), 0);
                active.insert(channel.clone(), machine, Time::ZERO);
                channel
            })
            .collect();
        let _ = drain(active);
        channels
    }

    /// Drains every replica on the drain list and files its timer; returns the pulls sent.
    fn drain(active: &mut ActiveChannels) -> (Vec<ChannelId>, Vec<PullRequest>) {
        let (mut drained, mut sent, mut effects) = (Vec::new(), Vec::new(), Vec::new());
        while let Some(channel) = active.drain_next(&mut effects) {
            sent.extend(effects.drain(..).filter_map(|effect| match effect {
                Effect::Send { message: ChannelMessage::Pull(request), .. } => Some(request),
                _ => None,
            }));
            drained.push(channel);
        }
        (drained, sent)
    }

    #[test]
    fn timers_fire_in_time_order_once_each_and_never_for_removed_replicas() {
        let mut active = ActiveChannels::default();
        let mut deadlines = Vec::new();
        for (name, at) in [("c", 20), ("a", 0), ("b", 10), ("gone", 5)] {
            let (channel, machine) = follower(name, at);
            deadlines.push((machine.poll_timeout().expect("timer"), channel.clone()));
            active.insert(channel, machine, Time::from_millis(at));
        }
        deadlines.sort();
        // Touched replicas count before they are filed.
        assert_eq!(active.next_timeout(), Some(deadlines[0].0));
        let (mut drained, _) = drain(&mut active);
        drained.sort();
        let mut expected: Vec<ChannelId> = deadlines.iter().map(|(_, c)| c.clone()).collect();
        expected.sort();
        assert_eq!(drained, expected, "each inserted replica drained once");
        let gone = ChannelId::new(ChannelType::GROUP, "gone").expect("channel id");
        assert!(active.remove(&gone).is_some());
        let deadlines: Vec<_> = deadlines.into_iter().filter(|(_, c)| *c != gone).collect();
        assert_eq!(active.next_timeout(), Some(deadlines[0].0));
        assert_eq!(active.pop_due(Time::from_millis(deadlines[0].0.as_millis() - 1)), None, "nothing due yet");
        let fired: Vec<ChannelId> = std::iter::from_fn(|| active.pop_due(Time::from_millis(u64::MAX / 2))).collect();
        assert_eq!(fired, deadlines.iter().map(|(_, c)| c.clone()).collect::<Vec<_>>(), "in time order, once each");
        assert!(active.timers.is_empty(), "fired timers are unfiled");
        assert_eq!(drain(&mut active).0.len(), 3, "fired replicas are on the drain list");
    }

    #[test]
    fn effect_buffers_pass_from_drained_replicas_to_marked_ones_and_none_stays_with_a_drained_one() {
        let mut active = ActiveChannels::default();
        let (a, machine_a) = follower("a", 0);
        let (b, machine_b) = follower("b", 0);
        active.insert(a.clone(), machine_a, Time::ZERO);
        active.insert(b.clone(), machine_b, Time::ZERO);
        let _ = drain(&mut active);
        assert!(active.spare.is_empty(), "replicas drained with no effects hand back no buffer");
        // a's pull resend: an effect pushed into a buffer a's machine allocates itself.
        let resend = active.get(&a).and_then(ChannelMachine::poll_timeout).expect("a waits for its pull");
        active.get_marked(&a).expect("a is active").handle_timeout(resend);
        let (_, sent) = drain(&mut active);
        assert_eq!(sent.len(), 1, "a sent its pull again");
        assert_eq!(active.get(&a).expect("a").effects_capacity(), 0, "a drained replica keeps no effect buffer");
        assert_eq!(active.spare.len(), 1, "its emptied buffer is kept to lend");
        let lent = active.spare[0].capacity();
        active.get_marked(&b).expect("b is active");
        assert_eq!(active.get(&b).expect("b").effects_capacity(), lent, "b, put on the drain list, holds it");
        assert!(active.spare.is_empty());
        let _ = drain(&mut active);
        assert_eq!(active.get(&b).expect("b").effects_capacity(), 0);
        assert_eq!(active.spare.len(), 1, "b's drain hands the buffer back");
    }

    #[test]
    fn a_map_emptied_after_a_burst_gives_its_capacity_back() {
        let mut map: FxHashMap<u32, [u8; 64]> = FxHashMap::default();
        map.extend((0..100_000).map(|i| (i, [0; 64])));
        let burst = map.capacity();
        for i in 10..100_000 {
            map.remove(&i);
            shrink_if_sparse(&mut map);
        }
        assert_eq!(map.len(), 10);
        assert!(map.capacity() <= 4 * 10 + 1024, "{} slots kept of {burst}", map.capacity());
    }

    #[test]
    fn a_timer_heap_emptied_after_a_burst_gives_its_room_back() {
        let mut active = ActiveChannels::default();
        let channels = burst(&mut active, 3_000);
        let burst = active.timers.capacity();
        assert!(burst >= 3_000, "every replica filed a timer");
        for channel in &channels[10..] {
            active.remove(channel);
        }
        assert!(
            active.timers.capacity() <= 4 * active.timers.len() + 1024,
            "{} of {burst} kept",
            active.timers.capacity()
        );
        assert_eq!(std::iter::from_fn(|| active.pop_due(Time::from_millis(u64::MAX / 2))).count(), 10);
    }

    #[test]
    fn a_reused_slot_never_fires_its_former_replicas_timer() {
        let mut active = ActiveChannels::default();
        let (gone, machine) = follower("gone", 0);
        let gone_at = machine.poll_timeout().expect("timer");
        active.insert(gone.clone(), machine, Time::ZERO);
        let _ = drain(&mut active);
        active.remove(&gone);
        let (next, machine) = follower("next", 60_000);
        let next_at = machine.poll_timeout().expect("timer");
        assert!(gone_at < next_at);
        active.insert(next.clone(), machine, Time::from_millis(60_000));
        assert_eq!(active.slots.len(), 1, "the slot was reused");
        let _ = drain(&mut active);
        assert_eq!(active.next_timeout(), Some(next_at), "the former replica's time is not reported");
        assert_eq!(active.pop_due(Time::from_millis(next_at.as_millis() - 1)), None, "nor fired");
        assert_eq!(active.pop_due(next_at), Some(next));
        assert_eq!(active.pop_due(Time::from_millis(u64::MAX / 2)), None, "once");
    }

    #[test]
    fn compaction_after_a_burst_keeps_the_survivors_whole() {
        let mut active = ActiveChannels::default();
        let channels = burst(&mut active, 3_000);
        // Survivors spread over the slots, some on the drain list when the compaction happens.
        let survivors: Vec<ChannelId> = channels.iter().step_by(300).cloned().collect();
        for channel in &survivors[..5] {
            active.get_used(channel, Time::from_millis(5)).expect("active");
        }
        for channel in channels.iter().filter(|c| !survivors.contains(c)) {
            active.remove(channel);
        }
        assert!(active.slots.len() <= 4 * active.len() + 1024, "{} slots for {}", active.slots.len(), active.len());
        for channel in &survivors {
            assert!(active.get(channel).is_some(), "found by name after renumbering");
        }
        let (mut drained, _) = drain(&mut active);
        drained.sort();
        let mut marked = survivors[..5].to_vec();
        marked.sort();
        assert_eq!(drained, marked, "the drain list survived the renumbering");
        let mut fired: Vec<ChannelId> =
            std::iter::from_fn(|| active.pop_due(Time::from_millis(u64::MAX / 2))).collect();
        fired.sort();
        let mut expected = survivors.clone();
        expected.sort();
        assert_eq!(fired, expected, "each survivor's timer fires once");
    }

    #[test]
    fn a_timer_moved_later_stays_filed_once_and_fires_only_when_its_machine_wants_it() {
        let mut active = ActiveChannels::default();
        let (early, machine) = follower("early", 0);
        active.insert(early.clone(), machine, Time::ZERO);
        // Never idles after empty answers: it pulls again after each one, and its timer moves later.
        let config = MachineConfig { idle_after_empty_pulls: u32::MAX, ..MachineConfig::default() };
        let (busy, machine, first_pull) = follower_with("busy", 1, config);
        active.insert(busy.clone(), machine, Time::from_millis(1));
        let mut pull = Some(first_pull);
        let _ = drain(&mut active);
        let first_filed = active.slot(&busy).and_then(|a| a.timer).expect("busy filed a timer").0;
        let mut most_filed = 0;
        let mut now = Time::ZERO;
        for step in 0..5_000u64 {
            pull = drain(&mut active).1.pop().or(pull);
            most_filed = most_filed.max(active.timers.len());
            // The leader answers `busy`'s pull with nothing: `busy` pulls again, its timer moves later.
            let request = pull.take().expect("busy pulled");
            let answer = ChannelMessage::PullResponse(PullResponse {
                channel: busy.clone(),
                pull_id: request.pull_id,
                leader_epoch: LeaderEpoch::new(1),
                body: PullBody::Records { records: vec![], hw: Seq::new(0), fanned_through: Seq::new(0) },
            });
            now = Time::from_millis(2 + step);
            active.get_marked(&busy).expect("active").handle_message(now, NodeId::new(1), answer);
        }
        let _ = drain(&mut active);
        assert_eq!(most_filed, 2, "one entry per replica: a later timer is not filed again");
        let wanted = active.get(&busy).and_then(ChannelMachine::poll_timeout).expect("busy wants a timer");
        assert!(wanted > first_filed && wanted > now, "busy's timer moved later ({first_filed:?} -> {wanted:?})");
        // `early`'s pull times out first; then busy's first entry comes due and is filed again, unfired.
        let early_due = Time::ZERO + MachineConfig::default().pull_timeout;
        assert_eq!(active.pop_due(early_due), Some(early.clone()), "the current timers still fire");
        assert!(active.remove(&early).is_some());
        assert_eq!(active.pop_due(first_filed), None, "busy's timer is not due: it does not fire early");
        assert_eq!(active.next_timeout(), Some(wanted), "busy is filed at the time its machine wants");
        assert_eq!(active.pop_due(wanted), Some(busy), "and fires then");
    }

    #[test]
    fn outdated_timer_entries_keep_the_heap_bounded() {
        let mut active = ActiveChannels::default();
        let (early, machine) = follower("early", 0);
        active.insert(early.clone(), machine, Time::ZERO);
        let (late, machine) = follower("late", 10);
        active.insert(late.clone(), machine, Time::from_millis(10));
        let _ = drain(&mut active);
        let slot = *active.index.get(&late).expect("indexed");
        let mut most_filed = 0;
        // Each refile after forgetting the filed timer leaves the old entry outdated below `early`'s,
        // where only the rebuild collects it (timers that keep moving earlier do this).
        for _ in 0..5_000 {
            active.slots[slot as usize].as_mut().expect("active").timer = None;
            active.refile(slot);
            most_filed = most_filed.max(active.timers.len());
        }
        assert!(most_filed > 1_000, "outdated entries piled up ({most_filed}): the test reaches the rebuild");
        assert!(most_filed <= 4 * active.len() + 1024 + 1, "{most_filed} filed for {} replicas", active.len());
        assert_eq!(active.pop_due(Time::ZERO + MachineConfig::default().pull_timeout), Some(early));
    }

    #[test]
    fn an_input_through_get_used_marks_the_replica_used_and_drains_it_once() {
        let mut active = ActiveChannels::default();
        let config = MachineConfig { idle_after_empty_pulls: u32::MAX, ..MachineConfig::default() };
        let (channel, machine, pull) = follower_with("used", 0, config);
        active.insert(channel.clone(), machine, Time::ZERO);
        let _ = drain(&mut active);
        assert!(active.get_used(&channel, Time::from_millis(70)).is_some());
        // An empty answer to its pull: the follower pulls again, so the drain below has an effect to move.
        let answer = ChannelMessage::PullResponse(PullResponse {
            channel: channel.clone(),
            pull_id: pull.pull_id,
            leader_epoch: LeaderEpoch::new(1),
            body: PullBody::Records { records: vec![], hw: Seq::new(0), fanned_through: Seq::new(0) },
        });
        let machine = active.get_used(&channel, Time::from_millis(90)).expect("active");
        machine.handle_message(Time::from_millis(90), NodeId::new(1), answer);
        assert_eq!(active.last_used(&channel), Some(Time::from_millis(90)));
        assert_eq!(active.active_since(&channel), Some(Time::ZERO), "in memory since its insert");
        let (drained, pulls) = drain(&mut active);
        assert_eq!(drained, vec![channel.clone()], "on the drain list once however often it was fed");
        assert_eq!(pulls.len(), 1, "the drain moved the machine's pull");
        assert_eq!(active.get(&channel).expect("active").effects_capacity(), 0, "drained in bulk, buffer freed");
        let unknown = ChannelId::new(ChannelType::GROUP, "unknown").expect("channel id");
        assert!(active.get_used(&unknown, Time::from_millis(90)).is_none());
        assert_eq!(drain(&mut active).0, Vec::<ChannelId>::new());
    }
}
