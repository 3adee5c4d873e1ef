//! Storage identities: a node started again on a new or emptied data directory is refused by the peers
//! that knew it, until it has been drained.
//!
//! Raft's safety rests on every voter keeping its votes and its log, and a channel's on every ISR member
//! keeping the records it acknowledged: a voter that comes back without them could vote twice in one
//! term, and a replica could hand a failover evidence of less than it acknowledged. Node ids are
//! static, so nothing else tells such a node from the one it was. Each data directory therefore draws a
//! [`StorageId`] when it is first initialized (kept in it, durable before any frame names it), every
//! frame names its sender's, and each node records the first identity it sees of every peer
//! ([`tidings_store::IdentityStore`], synced at once).
//!
//! A frame naming another identity than the one recorded is refused before anything reads its body
//! ([`FrameError::StorageChanged`](crate::frame::FrameError::StorageChanged), counted in
//! `NodeStatus::refused_frames` as `storage_changed`), and its sender is told, at most once a second
//! ([`NodeMessage::StorageRefused`](super::NodeMessage::StorageRefused)), so that it can say why it
//! hears from nobody (`NodeStatus::storage_refused_by`, and an error in its log). Its raft messages,
//! votes included, never reach raft-rs; its pulls, acknowledgements and evidence never reach a channel.
//!
//! A node holds itself back ([`Identities::quarantined`]) until a majority of the cluster took its
//! identity and none refused it: it takes no frame but identity messages and sends none but hellos.
//! A new cluster's nodes release each other within a round trip; a node back on an emptied directory
//! stays held back, so it builds nothing from what its peers sent before they heard from it, and
//! serves nothing.
//!
//! The one way back is the procedure for a lost directory (`docs/operations.md`): drain the node while
//! it is down; once nothing is left on it, every node is told to forget the identity it knew
//! (`Node::forget_storage_identity`, `NodeCore::forget_storage_identity`), and the next one the node
//! names is recorded as a first. Nothing is taken back on its own: whether a drained node still holds
//! a channel replica the cluster counts on is known only to the leaders of every slot group together
//! (an earlier form took a new identity once the slot groups a node kept had the node drained and out of
//! their configurations; the simulator found a channel whose meta still named the emptied node its leader,
//! which then led it with an empty log).
//!
//! What this does not catch: a directory restored from an older copy keeps its identity (and lost what
//! came after the copy); a node that loses its directory before any peer recorded its identity (a
//! record is durable with the peer's next slot-store sync at once); and two nodes of three that lose
//! theirs together while the third is down, which then take each other (beyond what any majority
//! quorum survives; with the third up, its refusal holds both back: see `Identities::try_release`).

use crate::frame::{Frame, FrameBody, FrameError};
use crate::node::peer_starts::PeerStarts;
use parking_lot::RwLock;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tidings_store::{IdentityStore, StoreResult};
use tidings_types::{NodeId, StorageId, Time};

/// How often a refused peer is told so.
const TELL_EVERY: std::time::Duration = std::time::Duration::from_secs(1);
/// How long a peer's frames are refused, without one of its known identity between, before it is sent
/// nothing more.
const CUT_OFF_AFTER: std::time::Duration = std::time::Duration::from_secs(1);
/// How often the refusal of a peer is logged while it lasts.
const LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(60);
/// How long a node held back waits, once a majority took its identity, for a later refusal.
const RELEASE_AFTER: std::time::Duration = std::time::Duration::from_millis(300);
/// How often a node held back says hello to its peers.
const HELLO_EVERY: std::time::Duration = std::time::Duration::from_millis(100);
/// How long a peer's refusal shows in `NodeStatus::storage_refused_by` after it was last heard.
const REFUSAL_SHOWN_FOR: std::time::Duration = std::time::Duration::from_secs(10);

/// This node's storage identity and what it knows of its peers', shared with whoever sends or checks
/// frames beside the core (channel shards, the threaded runtime's receiving threads): a frame whose
/// sender's identity is known and matches may go straight to its reactors, any other goes to the
/// core, which decides; and nothing but the notice of its refusal is sent to a peer this node refuses,
/// so that a node back on an empty directory builds no state from its peers' frames (it cannot answer
/// them) — such as a leadership of a channel its empty log cannot hold, or HWs it never had.
#[derive(Debug)]
pub(crate) struct KnownStorages {
    own: StorageId,
    table: RwLock<PeerTable>,
    /// This node's start and its peers' (see `node::peer_starts`).
    starts: PeerStarts,
    /// This node is held back until a majority of the cluster took its identity (see
    /// [`Identities::quarantined`]): every inbound frame goes to the core, which takes only identity
    /// messages meanwhile.
    quarantined: AtomicBool,
}

#[derive(Debug, Default)]
struct PeerTable {
    known: Vec<(NodeId, StorageId)>,
    /// Peers refused for their identity for `CUT_OFF_AFTER` (a frame of the identity known takes a
    /// peer off: a mangled frame does not cut a healthy peer off).
    refused: Vec<NodeId>,
}

impl KnownStorages {
    /// `true` if `node` is known with identity `storage`.
    pub(crate) fn matches(&self, node: NodeId, storage: StorageId) -> bool {
        self.table.read().known.iter().any(|(n, s)| *n == node && *s == storage)
    }

    /// `true` if this node refuses `node` (it came back with another identity): send it nothing.
    pub(crate) fn refuses(&self, node: NodeId) -> bool {
        self.table.read().refused.contains(&node)
    }

    /// `true` while this node is held back (see [`Identities::quarantined`]).
    pub(crate) fn quarantined(&self) -> bool {
        self.quarantined.load(Ordering::Acquire)
    }

    /// The frame `from` (this node) sends `to`: it names this node's storage identity and start, and
    /// the start of `to` this node last heard from.
    pub(crate) fn frame(&self, cluster: u64, from: NodeId, to: NodeId, body: FrameBody) -> Frame {
        let (start, to_start) = (self.starts.own(), self.starts.of(from, to));
        Frame { cluster, from, storage: self.own, start, to_start, body }
    }

    /// This node's start, as its frames name it.
    pub(crate) fn own_start(&self) -> u64 {
        self.starts.own()
    }

    /// Checks that `frame` is addressed to this start of the node, and records its sender's start (see
    /// `node::peer_starts`).
    pub(crate) fn accept_start(&self, frame: &Frame) -> Result<(), FrameError> {
        self.starts.accept(frame)
    }

    /// A table knowing no peer, for the unit tests of the parts that send frames.
    #[cfg(test)]
    pub(crate) fn for_tests() -> Arc<Self> {
        Arc::new(Self {
            own: StorageId::new(1),
            table: RwLock::default(),
            starts: PeerStarts::new(1),
            quarantined: AtomicBool::new(false),
        })
    }

    /// Refuses `node` as if it had come back with another identity, for unit tests.
    #[cfg(test)]
    pub(crate) fn refuse_for_tests(&self, node: NodeId) {
        self.set(node, Some(StorageId::new(2)), true);
    }

    fn set(&self, node: NodeId, known: Option<StorageId>, refused: bool) {
        let mut table = self.table.write();
        table.known.retain(|(n, _)| *n != node);
        table.known.extend(known.map(|s| (node, s)));
        table.refused.retain(|n| *n != node);
        if refused {
            table.refused.push(node);
        }
    }
}

/// What a frame's storage identity means for its sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// The identity recorded for the sender.
    Known,
    /// The first this node sees of the sender.
    First,
    /// Another identity than the one recorded.
    Changed { known: StorageId },
}

/// This node's storage identity, and those of its peers (see the module docs).
pub(crate) struct Identities {
    store: IdentityStore,
    known: BTreeMap<NodeId, StorageId>,
    shared: Arc<KnownStorages>,
    /// Refused peers: when each was last told.
    told: BTreeMap<NodeId, Time>,
    /// Refused peers: when the refusal was last logged.
    logged: BTreeMap<NodeId, Time>,
    /// Peers whose frames are refused: since when, without a frame of their known identity between.
    refused_since: BTreeMap<NodeId, Time>,
    /// Peers that refuse this node: the identity they know for it, and when they last said so.
    refused_by: BTreeMap<NodeId, (StorageId, Time)>,
    /// While held back: the peers that took this node's identity so far, and when to ask the others
    /// again (`None` once released).
    quarantine: Option<Quarantine>,
    /// Nodes that make a majority of the cluster, this one included.
    majority: usize,
}

/// A node held back until a majority of the cluster took its identity.
#[derive(Debug)]
struct Quarantine {
    accepted_by: Vec<NodeId>,
    next_hello: Time,
    /// Since when a majority took the identity with no peer refusing it.
    majority_since: Option<Time>,
}

impl Identities {
    /// This directory's identity (drawn with `draw` if it has none yet: a new or emptied directory)
    /// and the peers' identities it recorded, for a node of a cluster of `nodes` (this one included).
    /// Held back until a majority of them took its identity, unless its directory recorded that
    /// already or it is the cluster's only node.
    /// `boot_id` names this start of the node in its frames (see `node::peer_starts`).
    pub(crate) fn open(
        store: IdentityStore,
        nodes: usize,
        boot_id: u64,
        now: Time,
        draw: impl FnOnce() -> u64,
    ) -> StoreResult<Self> {
        let own = store.own_or_create(draw)?;
        let known: BTreeMap<NodeId, StorageId> = store.peers()?.into_iter().collect();
        let majority = nodes / 2 + 1;
        let quarantine = (majority > 1 && !store.accepted()?).then(|| Quarantine {
            accepted_by: Vec::new(),
            next_hello: now,
            majority_since: None,
        });
        let table = PeerTable { known: known.iter().map(|(n, s)| (*n, *s)).collect(), refused: Vec::new() };
        let quarantined = AtomicBool::new(quarantine.is_some());
        let starts = PeerStarts::new(boot_id);
        let shared = Arc::new(KnownStorages { own, table: RwLock::new(table), starts, quarantined });
        Ok(Self {
            store,
            known,
            shared,
            told: BTreeMap::new(),
            logged: BTreeMap::new(),
            refused_since: BTreeMap::new(),
            refused_by: BTreeMap::new(),
            quarantine,
            majority,
        })
    }

    /// `true` while this node is held back: its directory's identity was not taken by a majority of
    /// the cluster yet (a new cluster's first start, or a node started on a new or emptied directory).
    /// It then takes no frame but identity messages and sends none but its hellos, so that a node its
    /// peers refuse builds nothing from what they sent before they heard from it — no channel it
    /// would lead with an empty log, no HW it never had — and serves nothing from it.
    pub(crate) fn quarantined(&self) -> bool {
        self.quarantine.is_some()
    }

    /// When to say hello again while held back.
    pub(crate) fn next_hello(&self) -> Option<Time> {
        self.quarantine.as_ref().map(|q| q.next_hello)
    }

    /// `true` if a hello is due (and files the next one).
    pub(crate) fn hello_due(&mut self, now: Time) -> bool {
        match self.quarantine.as_mut() {
            Some(q) if q.next_hello <= now => {
                q.next_hello = now + HELLO_EVERY;
                true
            }
            _ => false,
        }
    }

    /// `peer` took this node's identity `storage` (its answer to a hello). `true` if that releases this
    /// node (see [`Identities::try_release`]).
    pub(crate) fn accepted_by(&mut self, now: Time, peer: NodeId, storage: StorageId) -> StoreResult<bool> {
        let Some(q) = self.quarantine.as_mut() else { return Ok(false) };
        if storage != self.shared.own {
            return Ok(false);
        }
        if !q.accepted_by.contains(&peer) {
            q.accepted_by.push(peer);
        }
        self.try_release(now)
    }

    /// Releases this node if a majority of the cluster, this one included, took its identity, no peer
    /// refused it lately, and `RELEASE_AFTER` went by since that was so — time for a refusal from a
    /// peer that answers later than the majority to arrive: two nodes of three back on emptied
    /// directories take each other, and the third, refusing both, holds both back (the cluster stops
    /// rather than start afresh beside the records it holds; were the third down then, nothing could
    /// tell). The release is recorded durably first. `true` if it released this node now.
    pub(crate) fn try_release(&mut self, now: Time) -> StoreResult<bool> {
        let refused = self.refused_by.values().any(|(_, at)| now < *at + REFUSAL_SHOWN_FOR);
        let majority = self.majority;
        let Some(q) = self.quarantine.as_mut() else { return Ok(false) };
        if refused || q.accepted_by.len() + 1 < majority {
            q.majority_since = None;
            return Ok(false);
        }
        let since = *q.majority_since.get_or_insert(now);
        if now < since + RELEASE_AFTER {
            return Ok(false);
        }
        self.store.set_accepted()?;
        self.quarantine = None;
        self.shared.quarantined.store(false, Ordering::Release);
        tracing::info!(own = %self.shared.own, "a majority of the cluster took this node's storage identity");
        Ok(true)
    }

    /// This node's storage identity.
    pub(crate) fn own(&self) -> StorageId {
        self.shared.own
    }

    /// The identity recorded for `node`, if any.
    pub(crate) fn known(&self, node: NodeId) -> Option<StorageId> {
        self.known.get(&node).copied()
    }

    /// The table the runtime's receiving threads check frames against.
    pub(crate) fn shared(&self) -> Arc<KnownStorages> {
        Arc::clone(&self.shared)
    }

    /// What [`Identities::shared`] hands out, borrowed.
    pub(crate) fn peers(&self) -> &KnownStorages {
        &self.shared
    }

    /// Decides on a valid frame of `node` naming `storage`: `Ok(true)` to go on with it having recorded
    /// a first identity (the store needs a sync: until then a crash would forget it), `Ok(false)` to go
    /// on, or the refusal, with `true` when the sender is due to be told.
    pub(crate) fn check(&mut self, now: Time, node: NodeId, storage: StorageId) -> Result<bool, (FrameError, bool)> {
        match self.verdict(node, storage) {
            Verdict::Known => {
                // Its own directory after all: a frame naming another identity (one mangled in transit
                // and sealed again, or a hostile one) does not cut a healthy peer off.
                if self.refused_since.remove(&node).is_some() && self.shared.refuses(node) {
                    self.shared.set(node, Some(storage), false);
                }
                Ok(false)
            }
            Verdict::First => {
                self.record(node, storage);
                Ok(true)
            }
            Verdict::Changed { known } => {
                // Sent nothing more once it went on naming another identity, with no frame of the known
                // one between, for `CUT_OFF_AFTER`.
                let since = *self.refused_since.entry(node).or_insert(now);
                if now >= since + CUT_OFF_AFTER && !self.shared.refuses(node) {
                    self.shared.set(node, Some(known), true);
                }
                let tell = self.told.get(&node).is_none_or(|at| now >= *at + TELL_EVERY);
                if tell {
                    self.told.insert(node, now);
                    // Logged when it starts and then once a minute (it is told once a second).
                    let logged = self.logged.get(&node).is_some_and(|at| now < *at + LOG_EVERY);
                    if !logged {
                        self.logged.insert(node, now);
                        tracing::error!(%node, %known, %storage, "refusing a node that came back on another data directory without being drained");
                    }
                }
                Err((FrameError::StorageChanged { node, known, got: storage }, tell))
            }
        }
    }

    /// Forgets the identity recorded for `node` (the operator drained it, and it comes back on a new
    /// directory): the next one it names is taken as a first. `true` if one was recorded. The store
    /// needs a sync for it to outlast a crash.
    pub(crate) fn forget(&mut self, node: NodeId) -> StoreResult<bool> {
        let Some(known) = self.known.remove(&node) else { return Ok(false) };
        self.shared.set(node, None, false);
        self.told.remove(&node);
        self.logged.remove(&node);
        self.refused_since.remove(&node);
        tracing::warn!(%node, %known, "forgot a peer's storage identity: the next one it names is taken");
        self.store.forget_peer(node)?;
        Ok(true)
    }

    fn verdict(&self, node: NodeId, storage: StorageId) -> Verdict {
        match self.known.get(&node) {
            Some(known) if *known == storage => Verdict::Known,
            Some(known) => Verdict::Changed { known: *known },
            None => Verdict::First,
        }
    }

    fn record(&mut self, node: NodeId, storage: StorageId) {
        if let Err(error) = self.store.record_peer(node, storage) {
            // Kept in memory for this run: the check holds until a restart, which reads the store again.
            tracing::warn!(%node, %storage, %error, "could not record a peer's storage identity");
        }
        self.known.insert(node, storage);
        self.shared.set(node, Some(storage), false);
    }

    /// `peer` refuses this node: it knows it as `known`.
    pub(crate) fn refused_by(&mut self, now: Time, peer: NodeId, known: StorageId) {
        if known == self.own() {
            // A refusal of an earlier identity of this directory's? Cannot be: ignore a confused peer.
            return;
        }
        if let Some(q) = self.quarantine.as_mut() {
            q.majority_since = None;
        }
        if self.refused_by.insert(peer, (known, now)).is_none() {
            tracing::error!(
                %peer, %known, own = %self.own(),
                "a peer refuses this node: it knew it with another data directory; drain this node (docs/operations.md, a lost data directory)"
            );
        }
    }

    /// Peers that refused this node lately, with the identity each knows for it.
    pub(crate) fn refusing(&self, now: Time) -> Vec<(NodeId, StorageId)> {
        self.refused_by
            .iter()
            .filter(|(_, (_, at))| now < *at + REFUSAL_SHOWN_FOR)
            .map(|(peer, (known, _))| (*peer, *known))
            .collect()
    }
}

/// Draws a storage identity for a new directory from what differs between a node's starts (its boot
/// id) and between nodes (the node id), mixed with the configured seed.
pub(crate) fn draw_storage_id(seed: u64, node: NodeId, boot_id: u64) -> u64 {
    let mut x = seed ^ node.get().wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ boot_id.rotate_left(29);
    // splitmix64's finalizer: every input bit moves every output bit.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidings_store::{Kv, MemoryKv};

    fn identities(kv: &Arc<MemoryKv>, own: u64) -> Identities {
        Identities::open(IdentityStore::new(kv.clone()), 3, 1, Time::ZERO, || own).unwrap()
    }

    const PEER: NodeId = NodeId::new(2);

    #[test]
    fn the_first_identity_seen_is_kept_and_another_is_refused_and_told_once_a_second() {
        let kv = Arc::new(MemoryKv::new());
        let mut ids = identities(&kv, 1);
        let t0 = Time::from_millis(1_000);
        assert_eq!(ids.check(t0, PEER, StorageId::new(20)), Ok(true), "recorded");
        assert!(ids.shared().matches(PEER, StorageId::new(20)));
        assert_eq!(ids.check(t0, PEER, StorageId::new(20)), Ok(false));
        let refused = FrameError::StorageChanged { node: PEER, known: StorageId::new(20), got: StorageId::new(21) };
        assert_eq!(ids.check(t0, PEER, StorageId::new(21)), Err((refused.clone(), true)));
        assert!(!ids.shared().refuses(PEER), "one refused frame cuts nothing off");
        assert_eq!(ids.check(t0 + TELL_EVERY / 2, PEER, StorageId::new(21)), Err((refused.clone(), false)));
        assert_eq!(ids.check(t0 + TELL_EVERY, PEER, StorageId::new(21)), Err((refused, true)));
        assert!(!ids.shared().matches(PEER, StorageId::new(21)));
        assert!(ids.shared().refuses(PEER), "refused for CUT_OFF_AFTER: nothing more is sent to it");
        // A frame of its old identity again (that one was mangled, or sent before it lost its disk):
        // taken, and it is sent to again until the next refused one.
        assert_eq!(ids.check(t0 + TELL_EVERY, PEER, StorageId::new(20)), Ok(false));
        assert!(!ids.shared().refuses(PEER));
        assert!(ids.check(t0 + TELL_EVERY, PEER, StorageId::new(21)).is_err());
        assert!(!ids.shared().refuses(PEER), "the clock starts again");
        assert!(ids.check(t0 + TELL_EVERY + CUT_OFF_AFTER, PEER, StorageId::new(21)).is_err());
        assert!(ids.shared().refuses(PEER));
        // Recorded in the store: a restart of this node still knows the first one.
        kv.sync().unwrap();
        kv.crash();
        let mut again = identities(&kv, 9);
        assert_eq!(again.own(), StorageId::new(1));
        assert!(again.check(t0, PEER, StorageId::new(21)).is_err());
    }

    #[test]
    fn a_forgotten_identity_lets_the_next_one_in_and_the_old_one_is_refused_then() {
        let kv = Arc::new(MemoryKv::new());
        let mut ids = identities(&kv, 1);
        let t0 = Time::from_millis(1_000);
        ids.check(t0, PEER, StorageId::new(20)).unwrap();
        assert!(ids.check(t0, PEER, StorageId::new(21)).is_err());
        assert!(ids.forget(PEER).unwrap());
        assert!(!ids.forget(PEER).unwrap(), "nothing left to forget");
        assert!(!ids.shared().matches(PEER, StorageId::new(20)));
        assert!(!ids.shared().refuses(PEER));
        assert_eq!(ids.check(t0, PEER, StorageId::new(21)), Ok(true));
        assert!(ids.check(t0, PEER, StorageId::new(20)).is_err());
        // The forget and the new record are in the store: a restart keeps them.
        kv.sync().unwrap();
        kv.crash();
        assert!(identities(&kv, 9).check(t0, PEER, StorageId::new(21)).is_ok());
    }

    #[test]
    fn a_node_is_held_back_until_a_majority_took_its_identity_and_its_directory_remembers() {
        let kv = Arc::new(MemoryKv::new());
        let mut ids = identities(&kv, 1); // one of three nodes: itself and one peer make a majority
        assert!(ids.quarantined() && ids.shared().quarantined());
        assert!(ids.hello_due(Time::ZERO));
        assert!(!ids.hello_due(Time::ZERO + HELLO_EVERY / 2), "one hello per interval");
        assert_eq!(ids.next_hello(), Some(Time::ZERO + HELLO_EVERY));
        let t0 = Time::ZERO;
        assert!(!ids.accepted_by(t0, PEER, StorageId::new(9)).unwrap(), "an answer about another identity");
        assert!(ids.quarantined());
        assert!(!ids.accepted_by(t0, PEER, StorageId::new(1)).unwrap(), "a majority, waiting for a later refusal");
        assert!(!ids.try_release(t0 + RELEASE_AFTER / 2).unwrap());
        assert!(ids.try_release(t0 + RELEASE_AFTER).unwrap());
        assert!(!ids.quarantined() && !ids.shared().quarantined() && ids.next_hello().is_none());
        kv.crash();
        assert!(!identities(&kv, 1).quarantined(), "released for good: the directory recorded it");
        // Alone in its cluster, a node is its own majority.
        let alone = Identities::open(IdentityStore::new(Arc::new(MemoryKv::new())), 1, 1, Time::ZERO, || 5).unwrap();
        assert!(!alone.quarantined());
    }

    /// Two nodes of three back on emptied directories take each other; the third refuses both, and they
    /// stay held back: the cluster stops rather than start afresh beside what the third holds.
    #[test]
    fn a_majority_that_one_peer_refuses_releases_nobody() {
        let kv = Arc::new(MemoryKv::new());
        let mut ids = identities(&kv, 1);
        let t0 = Time::ZERO;
        assert!(!ids.accepted_by(t0, PEER, StorageId::new(1)).unwrap());
        ids.refused_by(t0 + RELEASE_AFTER / 2, NodeId::new(3), StorageId::new(8));
        assert!(!ids.try_release(t0 + RELEASE_AFTER * 2).unwrap());
        assert!(ids.quarantined());
        // Once every peer took it (an operator had them forget the old identity), the refusals age out.
        let later = t0 + RELEASE_AFTER / 2 + REFUSAL_SHOWN_FOR;
        assert!(!ids.accepted_by(later, NodeId::new(3), StorageId::new(1)).unwrap());
        assert!(ids.try_release(later + RELEASE_AFTER).unwrap());
    }

    #[test]
    fn refusals_show_for_a_while_and_a_refusal_of_the_own_identity_is_ignored() {
        let kv = Arc::new(MemoryKv::new());
        let mut ids = identities(&kv, 1);
        let t0 = Time::from_millis(1_000);
        ids.refused_by(t0, PEER, StorageId::new(1));
        assert!(ids.refusing(t0).is_empty());
        ids.refused_by(t0, PEER, StorageId::new(7));
        assert_eq!(ids.refusing(t0 + REFUSAL_SHOWN_FOR / 2), vec![(PEER, StorageId::new(7))]);
        assert!(ids.refusing(t0 + REFUSAL_SHOWN_FOR).is_empty());
    }

    #[test]
    fn drawn_identities_differ_by_node_and_by_start() {
        let a = draw_storage_id(0, NodeId::new(1), 1);
        assert_ne!(a, draw_storage_id(0, NodeId::new(2), 1));
        assert_ne!(a, draw_storage_id(0, NodeId::new(1), 2));
        assert_eq!(a, draw_storage_id(0, NodeId::new(1), 1));
    }
}
