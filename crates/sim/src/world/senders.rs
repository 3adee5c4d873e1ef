//! Senders and fanout under faults. Setup names three users on every channel's subscriber list: one who
//! may send, one banned, one on the channel's deny list (never changed afterwards). Part of the appends
//! go through `append_from` with one of them as sender, through any node — with more nodes than slot
//! replicas, often one that must ask other nodes to check the sender. Every committed message fans out
//! to a host that records each delivery. The invariants:
//!
//! - an append from the banned or the denied sender is never acknowledged, and never on any replica's
//!   log;
//! - fanout delivers only committed messages (a delivered seq is a message at or below some replica's
//!   HW at the end), and never to the member on the deny list.

use super::World;
use bytes::Bytes;
use std::collections::BTreeSet;
use std::sync::Mutex;
use tidings::channel::fanout::DeliveryPlan;
use tidings::channel::machine::AppendRecord;
use tidings::node::{ApiId, FanoutHost};
use tidings::slot::command::{Command, MemberList};
use tidings::slot::model::{Uid, User};
use tidings::store::message::{Record, RecordKind};
use tidings::types::{ChannelId, NodeId, Seq};

/// May send.
pub(super) const ALLOWED: &str = "sender-allowed";
/// Banned: may not send anywhere.
pub(super) const BANNED: &str = "sender-banned";
/// On every channel's deny list: may not send there, and gets no fanout.
pub(super) const DENIED: &str = "sender-denied";

/// A host whose every member is online on node 1; it records each delivery.
#[derive(Default)]
pub(super) struct RecordingHost {
    deliveries: Mutex<Vec<(ChannelId, Seq, String)>>,
}

impl FanoutHost for RecordingHost {
    fn locate(&self, uids: &[String]) -> Vec<Option<NodeId>> {
        vec![Some(NodeId::new(1)); uids.len()]
    }

    fn deliver(&self, plan: &DeliveryPlan) -> bool {
        let mut deliveries = self.deliveries.lock().expect("one thread");
        let message = &plan.message;
        deliveries.extend(plan.members.iter().map(|m| (message.channel.clone(), message.seq, m.uid.clone())));
        true
    }
}

impl RecordingHost {
    /// The deliveries of `channel`'s messages: seq and member.
    fn of(&self, channel: &ChannelId) -> Vec<(Seq, String)> {
        let deliveries = self.deliveries.lock().expect("one thread");
        deliveries.iter().filter(|(c, ..)| c == channel).map(|(_, seq, uid)| (*seq, uid.clone())).collect()
    }

    /// Deliveries recorded in all.
    pub(super) fn count(&self) -> usize {
        self.deliveries.lock().expect("one thread").len()
    }
}

fn uid(name: &str) -> Uid {
    Uid::new(name).expect("valid uid")
}

impl World {
    /// The setup writes: the banned user, and on every channel the three senders as subscribers and
    /// the denied one on the deny list. `false` until every one is acknowledged.
    pub(super) fn set_up_senders(&mut self) -> bool {
        let mut writes: Vec<(String, Command)> = Vec::new();
        let banned = User { uid: uid(BANNED), name: "banned".into(), banned: true };
        writes.push(("banned user".into(), Command::PutUser(banned)));
        for channel in &self.channels {
            let members = vec![uid(ALLOWED), uid(BANNED), uid(DENIED)];
            let add = Command::AddMembers { channel: channel.clone(), list: MemberList::Subscribers, uids: members };
            let deny =
                Command::AddMembers { channel: channel.clone(), list: MemberList::Deny, uids: vec![uid(DENIED)] };
            writes.push((format!("subscribers of {channel}"), add));
            writes.push((format!("deny list of {channel}"), deny));
        }
        let first = *self.nodes.keys().next().expect("nodes");
        let mut all_done = true;
        for (label, command) in writes {
            if self.oracle.setup_done(&label) {
                continue;
            }
            all_done = false;
            let api = self.api();
            let now = self.node_now(first);
            if let Some(core) = self.nodes.get_mut(&first).and_then(|n| n.core.as_mut()) {
                core.propose(now, api, command);
                self.oracle.expect_setup(api, first, label);
            }
        }
        all_done
    }

    /// An append through `node` with one of the three senders, chosen by the seed.
    pub(super) fn append_from_request(&mut self, node: NodeId, api: ApiId, channel: ChannelId) {
        let sender = *self.rng.pick(&[ALLOWED, BANNED, DENIED]).expect("three");
        let payload = Bytes::from(format!("{}-{}-{sender}", self.params.seed, api.0));
        let record = AppendRecord { idempotency_key: None, payload: payload.clone() };
        let now = self.node_now(node);
        let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) else { return };
        if self.params.unsafe_unchecked_senders && sender != ALLOWED {
            core.append(now, api, channel.clone(), vec![record]);
        } else {
            core.append_from(now, api, channel.clone(), uid(sender), vec![record]);
        }
        if sender == ALLOWED {
            self.oracle.expect_append(api, node, channel, payload, None);
        } else {
            self.oracle.expect_refused_sender(api, node, channel, sender);
        }
    }

    /// The invariants above, for `channel` given its replicas' logs and HWs at the end.
    pub(super) fn check_senders_and_fanout(&mut self, channel: &ChannelId, logs: &[(NodeId, Seq, Vec<Record>)]) {
        for (node, _, records) in logs {
            for record in records.iter().filter(|r| r.kind == RecordKind::Message) {
                let from_refused =
                    [BANNED, DENIED].iter().any(|s| record.payload.ends_with(format!("-{s}").as_bytes()));
                if from_refused {
                    let seq = record.seq;
                    self.oracle.violation(format!("{channel}: a refused sender's message is on {node}'s log at {seq}"));
                }
            }
        }
        for (node, _, records) in logs {
            // One barrier per leader epoch, at its start: what a new leader relies on to fan out again
            // the messages of earlier epochs without reading them.
            for pair in records.windows(2) {
                let new_epoch = pair[1].leader_epoch > pair[0].leader_epoch;
                if new_epoch != (pair[1].kind == RecordKind::Barrier) {
                    let seq = pair[1].seq;
                    let (kind, epoch) = (pair[1].kind, pair[1].leader_epoch);
                    let starts = if new_epoch { "starts" } else { "does not start" };
                    self.oracle
                        .violation(format!("{channel}: on {node}, {kind:?} record {seq} {starts} epoch {epoch}"));
                }
            }
        }
        let committed_through = self.committed_through(channel, logs.iter().map(|(_, hw, _)| *hw));
        let messages: BTreeSet<Seq> = logs
            .iter()
            .flat_map(|(_, _, records)| records.iter().filter(|r| r.kind == RecordKind::Message).map(|r| r.seq))
            .collect();
        // A message given up since it fanned out is in no log any more.
        let retained_through = self.oracle.retained_through(channel);
        self.check_fanout_reached_every_message(channel, logs, retained_through);
        for (seq, member) in self.fanout_host.of(channel) {
            if member == DENIED {
                self.oracle.violation(format!("{channel}: seq {seq} fanned out to a member on the deny list"));
            }
            if seq > committed_through || (!messages.contains(&seq) && seq > retained_through) {
                self.oracle.violation(format!(
                    "{channel}: seq {seq} fanned out to {member} but is not a committed message (HW {committed_through})"
                ));
            }
        }
    }

    /// At least once: every committed message reached the allowed subscriber (every member is online),
    /// whatever crashed or changed leader meanwhile. A message whose subscriber page no node served for
    /// 30 s ends its fanout undelivered by design: in such a run misses are only counted.
    fn check_fanout_reached_every_message(
        &mut self,
        channel: &ChannelId,
        logs: &[(NodeId, Seq, Vec<Record>)],
        retained_through: Seq,
    ) {
        // The replica with the highest HW holds the committed log through it.
        let Some((_, hw, records)) = logs.iter().max_by_key(|(_, hw, _)| *hw) else { return };
        let delivered: BTreeSet<Seq> =
            self.fanout_host.of(channel).into_iter().filter(|(_, uid)| uid == ALLOWED).map(|(seq, _)| seq).collect();
        let missed: Vec<Seq> = records
            .iter()
            .filter(|r| r.kind == RecordKind::Message && r.seq <= *hw && r.seq > retained_through)
            .map(|r| r.seq)
            .filter(|seq| !delivered.contains(seq))
            .collect();
        if missed.is_empty() {
            return;
        }
        self.faults.fanout_missed += missed.len() as u64;
        if std::env::var("SIM_DEBUG_FANOUT").is_ok() {
            eprintln!("{channel}: never fanned out to {ALLOWED}: {missed:?}");
            for (id, node) in &self.nodes {
                let Some(core) = node.core.as_ref() else { continue };
                let status = core.status();
                let role = core.channel_status(channel).map(|c| (c.role, c.hw));
                eprintln!("  {id}: fanout backlog {}, replica {role:?}", status.fanout_backlog);
            }
        }
        let abandoned: u64 = self.running_cores().map(|c| c.status().fanout_pages_abandoned).sum();
        if abandoned == 0 {
            self.oracle.violation(format!("{channel}: committed messages {missed:?} never fanned out to {ALLOWED}"));
        }
    }
}
