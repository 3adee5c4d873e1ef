//! The clients' side of a seed: appends with idempotency keys and their retries, metadata writes and
//! reads, leader transfers, replica replacements, slot-replica moves, drains and hash-slot migrations.

use super::{slot_of_user, World};
use crate::oracle::ReadAsked;
use bytes::Bytes;
use tidings::channel::machine::AppendRecord;
use tidings::node::ApiId;
use tidings::slot::command::{Command, MemberList, RoutingKey};
use tidings::slot::model::{Device, Membership, PluginBinding, Uid, User};
use tidings::store::message::IdempotencyKey;
use tidings::types::{ChannelId, DetRng, GroupId, HashSlot, NodeId, Seq};

impl World {
    /// One client request: an append (half with an idempotency key; some through `append_from` with
    /// a sender, see `senders`), a retry of an earlier keyed append with the same key and payload, a
    /// read, a metadata write or read, or (with
    /// `leader_transfers`) an operator call. The order of the draws is part of each seed's run.
    pub(super) fn request(&mut self) {
        let ids = self.serving_nodes();
        let node = *self.rng.pick(&ids).expect("nodes");
        let api = self.api();
        let roll = self.rng.below(100);
        if roll < 15 && self.retry_keyed_append(node, api) {
            return;
        }
        if roll >= 92 && self.params.metadata_workload {
            self.metadata_request(node, api, roll);
            return;
        }
        let channel = self.channels[usize::try_from(self.rng.below(self.channels.len() as u64)).unwrap_or(0)].clone();
        if self.params.leader_transfers && self.operator_request(node, api, roll, &ids, &channel) {
            return;
        }
        let now = self.node_now(node);
        if roll == 85 && self.params.retention_moves && splitmix(api.0) % 4 == 0 {
            self.retention_request(node, api, &channel);
            return;
        }
        if roll < 30 {
            // Where the page starts and how long it may be come from the request's id, not the seed's
            // generator: the draws of every seed stay as they were (pinned seeds replay the same run).
            let mix = splitmix(api.0);
            let from = Seq::new(1 + mix % (self.oracle.last_acked(&channel) + 2));
            let limit = 1 + usize::try_from((mix >> 32) % 64).unwrap_or(0);
            // The node returns at most its `read_records_max` whatever the caller asks.
            let limit = limit.min(self.nodes[&node].config.read_records_max);
            if let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) {
                // The read first, as before this check: asked after it, at the same instant, the HW is the
                // one it read under and asks nothing of anyone (the replica is active).
                if let Ok(records) = core.read(&channel, from, limit) {
                    let hw = match core.latest(&channel) {
                        Ok(hw) => hw,
                        // An inactive replica reads its meta from the store for each call: the second
                        // read may take a failure the first did not.
                        Err(_) if self.params.meta_read_errors => return,
                        Err(error) => panic!("the replica that answered the read is active: {error:?}"),
                    };
                    // A short page: what a read from just past it finds, at the same instant (reads change
                    // nothing the run depends on).
                    let next = match records.last() {
                        Some(last) if records.len() < limit => {
                            core.read(&channel, last.seq.next(), 1).ok().and_then(|more| more.first().map(|r| r.seq))
                        }
                        _ => None,
                    };
                    // The retention boundary the replica's meta holds: nothing at or below it may be read.
                    let retained_through = core.channel_status(&channel).map_or(Seq::new(0), |s| s.retention_through);
                    let asked = ReadAsked { from, limit, hw, next, retained_through };
                    self.oracle.check_read(node, &channel, &asked, &records);
                }
            }
            return;
        }
        if roll < 45 {
            self.append_from_request(node, api, channel);
            return;
        }
        let payload = Bytes::from(format!("{}-{}", self.params.seed, api.0));
        let key = self.rng.chance(500_000).then(|| IdempotencyKey::new(format!("k{}", api.0)).expect("valid key"));
        let record = AppendRecord { idempotency_key: key.clone(), payload: payload.clone() };
        if let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) {
            core.append(now, api, channel.clone(), vec![record]);
            self.oracle.expect_append(api, node, channel, payload, key);
        }
    }

    /// Gives up `channel`'s records through a seq drawn from the request's id (not the seed's generator):
    /// up to a little past the last acknowledged one, so some moves go past HW and are refused.
    fn retention_request(&mut self, node: NodeId, api: ApiId, channel: &ChannelId) {
        let now = self.node_now(node);
        let last = self.oracle.last_acked(channel);
        let through = Seq::new((splitmix(api.0 ^ 0x7265_7461_696e) % (last + 3)).max(1));
        if let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) {
            core.set_retention(now, api, channel.clone(), through);
            self.oracle.expect_retention(api, node, channel.clone(), through);
            self.retentions.insert(api, channel.clone());
            self.faults.retention_moves += 1;
        }
    }

    /// Sends again an earlier keyed append, same key and payload, through `node`; `false` if there is
    /// none to retry.
    fn retry_keyed_append(&mut self, node: NodeId, api: ApiId) -> bool {
        let Some((channel, key, payload)) = self.oracle.pick_retry(&mut self.rng) else { return false };
        let record = AppendRecord { idempotency_key: Some(key.clone()), payload: payload.clone() };
        let now = self.node_now(node);
        if let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) {
            core.append(now, api, channel.clone(), vec![record]);
            self.oracle.expect_append(api, node, channel, payload, Some(key));
        }
        true
    }

    /// Metadata: write a new user, change a channel's subscribers, or read authoritatively in the group
    /// of a user written before.
    fn metadata_request(&mut self, node: NodeId, api: ApiId, roll: u64) {
        let now = self.node_now(node);
        let acked: Vec<Uid> = self.users_acked.values().flatten().cloned().collect();
        let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) else { return };
        if (94..96).contains(&roll) && !acked.is_empty() {
            // Subscriber changes: add or remove a few known users on a channel (every kind of per-key
            // metadata write with `all_metadata`). With late duplicates, or every kind, a few hot pairs:
            // changes to one pair then follow each other closely.
            let few = self.params.late_duplicates || self.params.all_metadata;
            let hot = |count: usize, at_most: usize| if few { count.min(at_most) } else { count };
            let (channels, users) = (hot(self.channels.len(), 2), hot(acked.len(), 4));
            let channel = self.channels[usize::try_from(self.rng.below(channels as u64)).unwrap_or(0)].clone();
            let count = 1 + self.rng.below(3);
            let uids: Vec<Uid> =
                (0..count).map(|_| acked[usize::try_from(self.rng.below(users as u64)).unwrap_or(0)].clone()).collect();
            let add = roll == 94;
            let command = if self.params.all_metadata {
                any_metadata_write(&mut self.rng, channel, uids, add, api)
            } else if add {
                Command::AddMembers { channel, list: MemberList::Subscribers, uids }
            } else {
                Command::RemoveMembers { channel, list: MemberList::Subscribers, uids }
            };
            core.propose(now, api, command.clone());
            self.register_change_asked(api, &command);
        } else if roll >= 96 || acked.is_empty() {
            let uid = Uid::new(format!("u{}", api.0)).expect("valid uid");
            let user = User { uid: uid.clone(), name: format!("user {}", api.0), banned: false };
            core.propose(now, api, Command::PutUser(user));
            self.user_writes.insert(api, uid);
        } else {
            let uid = acked[usize::try_from(self.rng.below(acked.len() as u64)).unwrap_or(0)].clone();
            core.read_barrier(now, api, RoutingKey::Uid(&uid));
            self.barriers.insert(api, self.users_acked.get(&slot_of_user(&uid)).cloned().unwrap_or_default());
        }
    }

    /// An operator call through `node` when `roll` picks one: a preferred slot leader, a drain, a
    /// hash-slot migration, a slot-replica move, a channel leader transfer or replica replacement (each
    /// an abort now and then). `false` if `roll` picked none.
    fn operator_request(&mut self, node: NodeId, api: ApiId, roll: u64, ids: &[NodeId], channel: &ChannelId) -> bool {
        if !(86..=91).contains(&roll) {
            return false;
        }
        let now = self.node_now(node);
        let groups: Vec<GroupId> = self.nodes[&node].config.table().groups().collect();
        let targets = self.operator_targets(ids);
        let ids = &targets[..];
        match roll {
            89 => {
                // The group's leader hands over when it fits.
                let group = *self.rng.pick(&groups).expect("groups");
                let preferred = *self.rng.pick(ids).expect("nodes");
                let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) else { return true };
                core.set_preferred_leader(now, api, group, Some(preferred));
                self.faults.transfers += 1;
            }
            87 if self.rng.chance(200_000) => {
                // Slot and channel replicas move off the drained node (or its drain is stopped).
                let target = *self.rng.pick(ids).expect("nodes");
                let drain = self.rng.chance(500_000);
                let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) else { return true };
                core.drain_node(now, api, target, drain);
                self.faults.drains += 1;
            }
            86 if self.rng.chance(300_000) => {
                // Refused when the slot is in that group already, or migrating.
                let to = *self.rng.pick(&groups).expect("groups");
                let slot = HashSlot::new(u16::try_from(self.rng.below(256)).unwrap_or(0)).expect("below 256");
                let abort = self.rng.chance(250_000);
                let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) else { return true };
                if abort {
                    core.abort_slot_migration(now, api, slot);
                } else {
                    core.migrate_slot(now, api, slot, to);
                }
                self.faults.slot_migrations += 1;
            }
            88 => {
                // From a random node to a random node: the group refuses what does not fit its membership.
                let group = *self.rng.pick(&groups).expect("groups");
                let (from, to) = (*self.rng.pick(ids).expect("nodes"), *self.rng.pick(ids).expect("nodes"));
                let abort = self.rng.chance(250_000);
                let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) else { return true };
                if abort {
                    core.abort_slot_move(now, api, group);
                } else {
                    core.move_slot_replica(now, api, group, from, to);
                }
                self.slot_moves.insert(api);
                self.faults.slot_moves += 1;
            }
            90 | 91 => {
                let target = *self.rng.pick(ids).expect("nodes");
                let from = *self.rng.pick(ids).expect("nodes");
                let Some(core) = self.nodes.get_mut(&node).and_then(|n| n.core.as_mut()) else { return true };
                if roll == 91 {
                    core.transfer_leader(now, api, channel.clone(), target);
                } else {
                    core.replace_replica(now, api, channel.clone(), from, target);
                }
                self.faults.transfers += 1;
            }
            _ => return false,
        }
        true
    }
}

/// A put (`add`) or a removal of one kind of per-key metadata, drawn (`SimParams::all_metadata`): a
/// change of one of `channel`'s lists for `uids`, or of the first of `uids`' device, membership of
/// `channel`, plugin binding or system-uid mark. What it puts comes from the request's id.
fn any_metadata_write(rng: &mut DetRng, channel: ChannelId, uids: Vec<Uid>, add: bool, api: ApiId) -> Command {
    let mix = splitmix(api.0 ^ 0x6d65_7461);
    let uid = uids[0].clone();
    match rng.below(7) {
        kind @ 0..=2 => {
            let list =
                [MemberList::Subscribers, MemberList::Allow, MemberList::Deny][usize::try_from(kind).unwrap_or(0)];
            if add {
                Command::AddMembers { channel, list, uids }
            } else {
                Command::RemoveMembers { channel, list, uids }
            }
        }
        3 => {
            let device_flag = u8::from(mix % 2 == 1);
            if add {
                let level = u8::from((mix >> 8) % 2 == 1);
                Command::PutDevice(Device { uid, device_flag, token: format!("t{}", api.0), level })
            } else {
                Command::RemoveDevice { uid, device_flag }
            }
        }
        4 if add => {
            let read = mix % 50;
            let membership = Membership {
                join_seq: Seq::new(read / 2),
                read_seq: Seq::new(read),
                deleted_to_seq: Seq::new(read / 3),
                hidden: (mix >> 8) % 2 == 1,
                active: (mix >> 9) % 4 != 0,
            };
            Command::PutMembership { uid, channel, membership }
        }
        4 => Command::RemoveMembership { uid, channel },
        5 => {
            let plugin = format!("p{}", mix % 2);
            if add {
                Command::PutPluginBinding(PluginBinding { uid, plugin })
            } else {
                Command::RemovePluginBinding { uid, plugin }
            }
        }
        _ if add => Command::AddSystemUid(uid),
        _ => Command::RemoveSystemUid(uid),
    }
}

/// SplitMix64's output function: an even spread of `x`'s bits.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
