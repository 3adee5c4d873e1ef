//! The core's side of reads across nodes (see [`super::remote_reads`]): asking for fanout pages and
//! sender checks, answering peers, and `append_from`'s checks that a shard could not make here.

use super::remote_reads::{in_turn, ReadAsk, ReadNext, ReadPurpose, PAGE_GIVE_UP, READ_BUSY_PAUSE};
use super::sender_checks::{Question, Verdict};
use super::{ApiId, NodeCore, NodeEffect};
use crate::node::error::NodeError;
use crate::node::fanout::{FanoutWork, PageRead};
use crate::node::message::{FlagQuery, NodeMessage, SlotQuery, SlotReadAnswer};
use crate::node::shard::ShardInput;
use tidings_channel::fanout::JobId;
use tidings_channel::machine::AppendRecord;
use tidings_slot::command::RoutingKey;
use tidings_slot::model::Uid;
use tidings_store::StoreError;
use tidings_types::{ChannelId, GroupId, NodeId};

impl NodeCore {
    /// The slot group holding what `key` routes to.
    fn group_of(&self, key: RoutingKey<'_>) -> GroupId {
        self.slot.table().group_of_key(key.bytes())
    }

    /// `true` if this node holds an applied replica of `group` (one created on demand and not yet given
    /// a snapshot has nothing to read).
    pub(super) fn holds_applied(&self, group: GroupId) -> bool {
        self.slot.applied_index(group).is_some_and(|applied| applied > 0)
    }

    /// `true` if a replica here holds the serving copy of `key`'s hash slot (`SlotReader::owner_copy`):
    /// enough for a fanout page, which may lag a little but must not come from a copy that moved away or
    /// is still importing.
    pub(super) fn holds_serving_copy(&self, key: RoutingKey<'_>) -> bool {
        self.holds_serving_copy_checked(key).unwrap_or(false)
    }

    /// [`NodeCore::holds_serving_copy`], with a store that could not tell as an error.
    fn holds_serving_copy_checked(&self, key: RoutingKey<'_>) -> Result<bool, StoreError> {
        Ok(self.reader.owner_copy_of(key)?.is_some_and(|group| self.holds_applied(group)))
    }

    /// The group whose copy of `key`'s hash slot this node reads, if that copy is the serving one (an
    /// unreadable store counts as none).
    fn serving_copy(&self, key: RoutingKey<'_>) -> Option<GroupId> {
        self.reader.owner_copy_of(key).ok().flatten()
    }

    /// The group whose copy answers a sender check about `key` here, if this node may answer from its
    /// own replicas: the copy it reads is the serving one of the key's hash slot
    /// (`SlotReader::owner_copy`), in a replica that knows its leader and applied all it knows
    /// committed (`MultiRaft::reads_fresh`).
    fn vouching_copy(&self, key: RoutingKey<'_>) -> Option<GroupId> {
        self.serving_copy(key).filter(|group| self.slot.reads_fresh(*group))
    }

    /// A page of `channel`'s subscribers for fanout job `job`: read here if a replica here holds their
    /// serving copy, else asked of a node that does (their slot group lives elsewhere, or their slot's
    /// migration has not reached this node).
    pub(super) fn fetch_fanout_page(&mut self, job: JobId, channel: ChannelId, cursor: Option<Vec<u8>>, limit: usize) {
        let limit = u32::try_from(limit).unwrap_or(u32::MAX);
        let query = SlotQuery::SubscriberPage { channel, cursor, limit };
        let ask = ReadAsk {
            purpose: ReadPurpose::FanoutPage(job),
            query,
            attempts: 0,
            since: self.now,
            give_up_after: PAGE_GIVE_UP,
        };
        self.read_here_or_ask(ask, None);
    }

    /// Sends `ask` to `to`, or by default on a first attempt to the node that last answered for the group
    /// or its known leader, else to the next node in turn.
    fn ask_read(&mut self, ask: ReadAsk, to: Option<NodeId>) {
        let me = self.config.node;
        let group = self.group_of(ask.query.routing_key());
        let others: Vec<NodeId> = self.config.nodes.iter().copied().filter(|n| *n != me).collect();
        let first = (ask.attempts == 0)
            .then(|| self.remote_reads.contact(group).or_else(|| self.known_group_leader(group)))
            .flatten()
            .filter(|n| *n != me);
        // The others in turn from this attempt's place, passing over nodes that let a read time out lately.
        let in_turn = in_turn(group, ask.attempts, &others);
        let Some(to) = to.or(first).or_else(|| self.remote_reads.pick(in_turn, self.now)) else {
            // Nobody else to ask (a single node serves every group: not reached in practice).
            self.read_given_up(ask);
            return;
        };
        let query = ask.query.clone();
        let request = self.remote_reads.asked(ask, to, self.now);
        self.send_node(to, NodeMessage::SlotReadRequest { request, query });
    }

    /// A read that was refused or went unanswered: asked again (`again`: that busy node), later, or given
    /// up.
    pub(super) fn retry_read(&mut self, ask: ReadAsk, again: Option<NodeId>) {
        let others = self.other_nodes();
        if let Some(next) = self.remote_reads.retry(ask, again, self.now, others) {
            self.follow_read(next);
        }
    }

    /// Reads whose time came (no answer, a busy node's pause, a round's pause): asked again or given up.
    pub(super) fn retry_due_reads(&mut self) {
        let others = self.other_nodes();
        for next in self.remote_reads.take_due(self.now, others) {
            self.follow_read(next);
        }
    }

    /// How many nodes a read may be asked of: the cluster's but this one.
    fn other_nodes(&self) -> usize {
        self.config.nodes.len().saturating_sub(1)
    }

    fn follow_read(&mut self, next: ReadNext) {
        match next {
            ReadNext::Ask(ask, to) => self.read_here_or_ask(ask, to),
            ReadNext::GiveUp(ask) => self.read_given_up(ask),
        }
    }

    /// Reads `ask` here if a replica here can answer it (the serving copy for a fanout page; for a sender
    /// check, that copy in a replica that knows its leader), else asks it of another node. Checked on
    /// every attempt: this node may become a replica of the group, or a slot's migration may reach it,
    /// while the read is asked elsewhere (sim seed 429006070).
    fn read_here_or_ask(&mut self, ask: ReadAsk, to: Option<NodeId>) {
        match (ask.purpose, &ask.query) {
            (ReadPurpose::FanoutPage(job), SlotQuery::SubscriberPage { channel, cursor, limit }) => {
                let here = self.holds_serving_copy_checked(RoutingKey::Channel(channel));
                if !matches!(here, Ok(false)) {
                    let read = PageRead {
                        job,
                        channel: channel.clone(),
                        cursor: cursor.clone(),
                        limit: usize::try_from(*limit).unwrap_or(usize::MAX),
                        attempts: ask.attempts,
                        since: ask.since,
                    };
                    match here {
                        Ok(_) => self.effects.push_back(NodeEffect::Fanout(FanoutWork::Page(read))),
                        // Whether this node serves the page is unknown: as for a page it could not read
                        // (a single node, which has nobody else to ask, gave the page up at once).
                        Err(error) => {
                            tracing::warn!(%error, "fanout: cannot tell whether this node serves a subscriber page");
                            self.page_unread(read);
                        }
                    }
                    return;
                }
            }
            (ReadPurpose::SenderCheck(check), SlotQuery::Flag(flag)) => {
                if let Some(copy) = self.vouching_copy(flag.routing_key()) {
                    let verdict = match flag.read(&self.reader, copy) {
                        Ok(yes) => self.sender_checks.answer(check, question_of(flag), yes),
                        Err(error) => self.sender_checks.fail(check, error.into()),
                    };
                    self.carry_out_verdict(verdict);
                    return;
                }
            }
            // Not answerable here (or a purpose and a query that do not go together, which are not built).
            _ => {}
        }
        self.ask_read(ask, to);
    }

    /// This node's store could not read a page for one of its fanout jobs: another node is asked for it
    /// (a round of them that cannot serve it brings it back here after a pause), or, with no other
    /// node, this one again after a pause; given up once the page's patience has passed, as any page.
    pub(super) fn page_unread(&mut self, read: PageRead) {
        self.fanout_page_read_failures += 1;
        let PageRead { job, channel, cursor, limit, attempts, since } = read;
        let limit = u32::try_from(limit).unwrap_or(u32::MAX);
        let query = SlotQuery::SubscriberPage { channel, cursor, limit };
        let mut ask =
            ReadAsk { purpose: ReadPurpose::FanoutPage(job), query, attempts, since, give_up_after: PAGE_GIVE_UP };
        if ask.expired(self.now) {
            self.read_given_up(ask);
        } else if self.other_nodes() == 0 {
            self.remote_reads.defer(ask, self.now + READ_BUSY_PAUSE);
        } else {
            ask.attempts += 1;
            self.ask_read(ask, None);
        }
    }

    fn read_given_up(&mut self, ask: ReadAsk) {
        match ask.purpose {
            ReadPurpose::FanoutPage(job) => {
                self.fanout_pages_abandoned += 1;
                tracing::warn!(query = ?ask.query, "fanout: no node served a subscriber page in time (or this node's store could not read it); this message's fanout stops here");
                self.fanout.handle_page(job, Vec::new(), None);
            }
            ReadPurpose::SenderCheck(check) => {
                let SlotQuery::Flag(flag) = ask.query else { return };
                let verdict = self.sender_checks.fail(check, NodeError::SenderUnverified(flag.uid().clone()));
                self.carry_out_verdict(verdict);
            }
        }
    }

    /// A peer's read: answered from this node's replica of the group (pages on the fanout worker, at most
    /// `PEER_PAGES_SERVING_MAX` at once), `NotServed` without one.
    pub(super) fn serve_read(&mut self, from: NodeId, request: u64, query: SlotQuery) {
        // A page for fanout takes the serving copy in any applied replica; a sender check wants it in a
        // replica that knows its leader.
        let answer = match query {
            SlotQuery::SubscriberPage { channel, cursor, limit } => {
                if !self.holds_serving_copy(RoutingKey::Channel(&channel)) {
                    SlotReadAnswer::NotServed
                } else if !self.remote_reads.start_serving() {
                    SlotReadAnswer::Busy
                } else {
                    let limit =
                        usize::try_from(limit).unwrap_or(usize::MAX).clamp(1, self.config.fanout.page_size.max(1));
                    let work = FanoutWork::PeerPage { to: from, request, channel, cursor, limit };
                    self.effects.push_back(NodeEffect::Fanout(work));
                    return;
                }
            }
            // One key each: read here, as a meta fetch is.
            SlotQuery::Flag(flag) => {
                match self.vouching_copy(flag.routing_key()).map(|copy| flag.read(&self.reader, copy)) {
                    None => SlotReadAnswer::NotServed,
                    Some(Ok(yes)) => SlotReadAnswer::Flag(yes),
                    Some(Err(error)) => {
                        tracing::warn!(%error, "slot read for a peer failed");
                        SlotReadAnswer::NotServed
                    }
                }
            }
        };
        self.send_node(from, NodeMessage::SlotReadReply { request, answer });
    }

    /// A peer's answer to a read this node asked for.
    pub(super) fn read_answered(&mut self, from: NodeId, request: u64, answer: SlotReadAnswer) {
        if answer == SlotReadAnswer::Busy {
            self.remote_reads.busy(request, from, self.now);
            return;
        }
        let Some(ask) = self.remote_reads.answered(request, from) else { return };
        let group = self.group_of(ask.query.routing_key());
        let served = matches!(answer, SlotReadAnswer::Page { .. } | SlotReadAnswer::Flag(_));
        self.remote_reads.answered_for(group, from, served);
        match (ask.purpose, answer) {
            (ReadPurpose::FanoutPage(job), SlotReadAnswer::Page { members, next }) => {
                self.fanout.handle_page(job, members, next);
            }
            (ReadPurpose::SenderCheck(check), SlotReadAnswer::Flag(yes)) => {
                let SlotQuery::Flag(flag) = &ask.query else { return self.retry_read(ask, None) };
                let verdict = self.sender_checks.answer(check, question_of(flag), yes);
                self.carry_out_verdict(verdict);
            }
            // Not served there, or an answer of the wrong kind: ask the next node.
            _ => self.retry_read(ask, None),
        }
    }

    /// `append_from` whose channel shard could not check the sender here: the answers this node's slot
    /// replicas hold are read here, the others asked of nodes that hold them; the append waits (bounded)
    /// and goes on to its shard once the sender may send.
    pub(super) fn verify_sender(&mut self, api: ApiId, channel: ChannelId, sender: Uid, records: Vec<AppendRecord>) {
        let check = match self.sender_checks.start(api, channel.clone(), sender.clone(), records) {
            Ok(check) => check,
            Err(records) => return self.hand_back(api, channel, &sender, records, Err(NodeError::Overloaded)),
        };
        let give_up_after = self.config.machine.append_timeout;
        for flag in [FlagQuery::Banned(sender.clone()), FlagQuery::Denied { channel, uid: sender }] {
            if !self.sender_checks.is_waiting(check) {
                break; // decided by the first answer (a ban), or failed
            }
            let purpose = ReadPurpose::SenderCheck(check);
            let ask = ReadAsk { purpose, query: SlotQuery::Flag(flag), attempts: 0, since: self.now, give_up_after };
            self.read_here_or_ask(ask, None);
        }
    }

    /// Hands a decided check back to the append's shard, where its caller waits (on a reactor thread in
    /// the runtime: the core cannot answer that call itself).
    fn carry_out_verdict(&mut self, verdict: Option<Verdict>) {
        let (append, verdict) = match verdict {
            None => return,
            Some(Verdict::Allowed(append)) => (append, Ok(())),
            Some(Verdict::Refused(append, error)) => (append, Err(error)),
        };
        self.hand_back(append.api, append.channel, &append.sender, append.records, verdict);
    }

    /// Gives an append whose sender check ended (`verdict`) back to its channel's shard.
    fn hand_back(
        &mut self,
        api: ApiId,
        channel: ChannelId,
        sender: &Uid,
        records: Vec<AppendRecord>,
        verdict: Result<(), NodeError>,
    ) {
        let sender = sender.as_str().to_owned();
        let input = ShardInput::SenderChecked { api, channel: channel.clone(), sender, records, verdict };
        self.feed_shard(&channel, input);
    }
}

fn question_of(flag: &FlagQuery) -> Question {
    match flag {
        FlagQuery::Banned(_) => Question::Banned,
        FlagQuery::Denied { .. } => Question::Denied,
    }
}
