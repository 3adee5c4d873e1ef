//! The sweep over this node's channel logs that finds those of replicas moved away (a replacement, a
//! drain or a surplus removal took the replica off this node, maybe while it was down), so their
//! space is given back.
//!
//! Once a pass ([`StrayLogConfig::pass_interval`]), the core pages through the logs the message log
//! holds, [`StrayLogConfig::page`] channels at a time ([`NodeEffect::ListLogs`], read off the core's
//! thread). A channel whose meta in this node's slot replica names this node is skipped; every other
//! one goes to its shard, which files it as a candidate (unless busy with the channel) and asks for
//! the channel's meta read authoritatively: through this node's replica of the channel's slot group (raft
//! ReadIndex), else through a node that keeps one ([`NodeMessage::MetaConfirm`]). Only a meta read
//! that way, after the candidate was filed, lets the shard forget the log (see `shard::stray` for why
//! that is safe for an ISR member added back).
//!
//! The same pass resumes fanout a restart left unfinished: a log whose stored state has fanned out less
//! than its HW, of a channel this node leads (as its slot replica says, or, when it keeps none of the
//! channel's group, as the candidate's authoritative read says), has its replica activated
//! (`ShardInput::ResumeFanout`, or from the read's answer), and the resumed leadership plans again what
//! was not known to finish.
//! Without it, a leader restarted in place resumed only with the channel's next message, call or pull.
//! So that this does not wait a whole pass interval (and a pass, which pages slowly), a node's start is
//! followed by a resume pass ([`StrayLogConfig::resume_after`]): pages of [`RESUME_PAGE`] logs back to
//! back that only resume fanout, filing no candidate whose fanout is not behind.

use super::metadata::MetaRead;
use super::{NodeCore, NodeEffect};
use crate::node::message::NodeMessage;
use crate::node::shard::ShardInput;
use std::collections::BTreeMap;
use std::time::Duration;
use tidings_slot::query::SlotReader;
use tidings_store::message::MessageLog;
use tidings_store::StoreError;
use tidings_types::{ChannelId, ChannelRuntimeMeta, GroupId, NodeId, Time};

/// How the node sweeps its logs for those of replicas moved away.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StrayLogConfig {
    /// Channels listed per page. Default 64.
    pub page: usize,
    /// Pause between two pages of a pass. Default 1 s (64 channels a second: a pass over 100,000
    /// logs takes about half an hour).
    pub page_interval: Duration,
    /// Pause between the end of one pass and the start of the next, and from the node's start to its
    /// first pass. Default 10 minutes.
    pub pass_interval: Duration,
    /// Pause from the node's start to its resume pass, which activates the channels it leads whose
    /// stored fanout is behind their HW (a restart left it unfinished). Default 2 s: the node's own
    /// slot replicas are open by then and its peers have had a moment to see it back.
    pub resume_after: Duration,
}

impl Default for StrayLogConfig {
    fn default() -> Self {
        Self {
            page: 64,
            page_interval: Duration::from_secs(1),
            pass_interval: Duration::from_secs(600),
            resume_after: Duration::from_secs(2),
        }
    }
}

impl StrayLogConfig {
    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), &'static str> {
        if self.page == 0 || self.page > MAX_PAGE {
            return Err("stray_logs.page must be between 1 and 4,096");
        }
        if self.page_interval.is_zero() || self.pass_interval.is_zero() {
            return Err("stray_logs.page_interval and pass_interval must be positive");
        }
        Ok(())
    }
}

/// Largest page a configuration may ask for.
const MAX_PAGE: usize = 4096;
/// Logs listed per page of the resume pass: it reads the state of each this node may lead, so a pass
/// over 100,000 logs costs about 100 pages.
const RESUME_PAGE: usize = 1024;
/// Pause between two pages of the resume pass: short, since it runs once per start.
const RESUME_PAGE_INTERVAL: Duration = Duration::from_millis(10);
/// A page not answered within this is given up (the next one is asked from the same place).
const PAGE_PATIENCE: Duration = Duration::from_secs(30);
/// Most authoritative reads asked of other nodes at once; a candidate past it is answered `None`
/// (withdrawn: a later pass files it again).
const CONFIRMS_IN_FLIGHT_MAX: usize = 256;
/// A read asked of another node and not answered within this is given up.
const CONFIRM_PATIENCE: Duration = Duration::from_secs(10);

/// One page of the sweep, to carry out off the core's thread ([`LogPage::carry_out`]) and hand to
/// [`NodeCore::handle_logs_listed`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogPage {
    after: Option<ChannelId>,
    limit: usize,
    me: NodeId,
    /// Whether the node fans out (and so whether a log's fanout may be behind).
    fanout: bool,
    /// A page of the resume pass: only logs whose fanout is behind are acted on.
    resume: bool,
}

/// What a [`LogPage`] found.
#[derive(Debug)]
pub struct LogsListed {
    page: LogPage,
    found: Result<Vec<ListedLog>, StoreError>,
}

/// One log a [`LogPage`] listed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ListedLog {
    channel: ChannelId,
    /// This node's slot replica holds a meta naming this node a replica.
    named: bool,
    /// The log's stored state fanned out less than its HW, and this node leads the channel as far as
    /// its slot replica knows (or knows no meta of it).
    fanout_behind: bool,
}

impl LogPage {
    /// Lists the page's logs in `log`, reads each channel's meta from this node's slot replicas
    /// (`reader`), if they hold it, and, for a channel that meta says this node leads or that they hold
    /// no meta of, the log's state (how far its fanout got).
    pub fn carry_out(self, log: &dyn MessageLog, reader: &SlotReader) -> LogsListed {
        let found = log.logs_after(self.after.as_ref(), self.limit).map(|channels| {
            channels
                .into_iter()
                .map(|channel| {
                    let meta = reader.runtime_meta(&channel).ok().flatten();
                    let named = meta.as_ref().is_some_and(|meta| meta.is_replica(self.me));
                    // Unknown here (no replica of its slot group): the authoritative read the sweep
                    // asks for a log it cannot place tells whether this node leads it.
                    let may_lead = self.fanout && meta.is_none_or(|meta| meta.leader == self.me);
                    let fanout_behind = may_lead && log.state(&channel).is_ok_and(|s| s.fanned_through < s.hw);
                    ListedLog { channel, named, fanout_behind }
                })
                .collect()
        });
        LogsListed { page: self, found }
    }
}

/// What an authoritative read of a channel's meta through this node's slot replica is for.
#[derive(Debug)]
pub(super) enum StrayRead {
    /// A candidate of one of this node's shards.
    Candidate { channel: ChannelId, ask: u64 },
    /// A peer's [`NodeMessage::MetaConfirm`].
    Peer { to: NodeId, request: u64, channel: ChannelId },
}

/// A candidate's authoritative read asked of another node.
#[derive(Debug)]
struct Confirming {
    channel: ChannelId,
    ask: u64,
    since: Time,
    /// Nodes asked so far: one that could not read it, or did not answer in time, is followed by the
    /// next, once each.
    tried: usize,
    /// The node asked last.
    asked: NodeId,
}

/// The sweep's state on the core.
#[derive(Debug)]
pub(super) struct StrayLogSweep {
    config: StrayLogConfig,
    /// Where the next page starts (`None`: at the first log).
    cursor: Option<ChannelId>,
    next_page_at: Time,
    /// The resume pass after the node's start has not finished.
    resuming: bool,
    /// When the first regular pass is due (a pass interval after the start).
    first_pass_at: Time,
    /// When the page in flight was asked, if one is.
    page_asked_at: Option<Time>,
    /// Reads asked of other nodes, by request id.
    confirming: BTreeMap<u64, Confirming>,
    /// Request ids of this start of the node (its boot id in the high half): a reply to an earlier
    /// start is never taken for a request of this one.
    request_base: u64,
    requests: u64,
    /// Passes finished since the node started.
    pub(super) passes: u64,
}

impl StrayLogSweep {
    pub(super) fn new(config: StrayLogConfig, boot_id: u64, now: Time) -> Self {
        Self {
            next_page_at: now + config.resume_after,
            resuming: true,
            first_pass_at: now + config.pass_interval,
            config,
            cursor: None,
            page_asked_at: None,
            confirming: BTreeMap::new(),
            request_base: (boot_id & 0xffff_ffff) << 32 | 1 << 30,
            requests: 0,
            passes: 0,
        }
    }

    /// When the sweep has something to do next.
    pub(super) fn poll_timeout(&self) -> Time {
        let page = match self.page_asked_at {
            Some(asked) => asked + PAGE_PATIENCE,
            None => self.next_page_at,
        };
        let confirm = self.confirming.values().map(|c| c.since + CONFIRM_PATIENCE).min();
        confirm.map_or(page, |due| due.min(page))
    }

    /// The page to ask for now, if one is due.
    fn page_due(&mut self, now: Time, me: NodeId, fanout: bool) -> Option<LogPage> {
        if self.page_asked_at.is_some_and(|asked| asked + PAGE_PATIENCE <= now) {
            self.page_asked_at = None; // lost: asked again from the same place
        }
        if self.resuming && !fanout {
            // Nothing to resume: the regular passes keep their schedule.
            self.resuming = false;
            self.next_page_at = self.first_pass_at;
        }
        if self.page_asked_at.is_some() || now < self.next_page_at {
            return None;
        }
        self.page_asked_at = Some(now);
        let limit = if self.resuming { RESUME_PAGE } else { self.config.page };
        Some(LogPage { after: self.cursor.clone(), limit, me, fanout, resume: self.resuming })
    }

    /// The page came back: where the next one starts, and when.
    fn listed(&mut self, now: Time, page: &LogPage, found: Option<&[ListedLog]>) {
        self.page_asked_at = None;
        let page_interval = if self.resuming { RESUME_PAGE_INTERVAL } else { self.config.page_interval };
        match found {
            Some(found) if found.len() >= page.limit => {
                self.cursor = found.last().map(|listed| listed.channel.clone());
                self.next_page_at = now + page_interval;
            }
            Some(_) if self.resuming => {
                self.cursor = None;
                self.resuming = false;
                self.next_page_at = self.first_pass_at.max(now + page_interval);
            }
            Some(_) => {
                self.cursor = None;
                self.passes += 1;
                self.next_page_at = now + self.config.pass_interval;
            }
            // The store could not list: the same page again after a pause (a regular one: a failing
            // store is not to be asked a hundred times a second).
            None => self.next_page_at = now + self.config.page_interval,
        }
    }

    fn next_request(&mut self) -> u64 {
        self.requests = (self.requests + 1) & ((1 << 30) - 1);
        self.request_base | self.requests
    }
}

impl NodeCore {
    /// The sweep's part of a tick: the next page when due, reads of other nodes not answered in time.
    pub(super) fn sweep_stray_logs(&mut self) {
        let now = self.now;
        let expired: Vec<u64> = self
            .stray_logs
            .confirming
            .iter()
            .filter(|(_, c)| c.since + CONFIRM_PATIENCE <= now)
            .map(|(r, _)| *r)
            .collect();
        for request in expired {
            let Some(confirming) = self.stray_logs.confirming.remove(&request) else { continue };
            // Unanswered (the node may have crashed, or refuse this one): the next node, as for one
            // that could not read it, until each was asked once.
            if confirming.tried < self.config.nodes.len().saturating_sub(1) {
                let next = self.next_peer_after(confirming.asked);
                self.ask_confirm(Confirming { since: now, ..confirming }, next);
            } else {
                let Confirming { channel, ask, .. } = confirming;
                self.feed_shard(&channel.clone(), ShardInput::StrayConfirmed { channel, ask, meta: None });
            }
        }
        if let Some(page) = self.stray_logs.page_due(now, self.config.node, self.config.fanout_enabled) {
            self.effects.push_back(NodeEffect::ListLogs(page));
        }
    }

    /// A [`NodeEffect::ListLogs`] was carried out: each listed channel whose meta in this node's slot
    /// replica does not name this node goes to its shard, which may ask for its meta authoritatively.
    pub fn handle_logs_listed(&mut self, now: Time, listed: LogsListed) {
        self.advance(now);
        let LogsListed { page, found } = listed;
        if page.after != self.stray_logs.cursor || self.stray_logs.page_asked_at.is_none() {
            return; // an answer to a page given up meanwhile
        }
        let found = match found {
            Ok(found) => Some(found),
            Err(error) => {
                tracing::warn!(%error, node = %self.config.node, "could not list the logs for the stray-log sweep");
                None
            }
        };
        self.stray_logs.listed(self.now, &page, found.as_deref());
        for ListedLog { channel, named, fanout_behind } in found.into_iter().flatten() {
            if page.resume && !fanout_behind {
                continue; // the resume pass files no stray candidate: the regular passes do
            }
            if !named {
                self.feed_shard(&channel.clone(), ShardInput::MaybeStray { channel, fanout_behind });
            } else if fanout_behind {
                self.feed_shard(&channel.clone(), ShardInput::ResumeFanout(channel));
            }
        }
    }

    /// A shard asks for the authoritative meta of candidate `channel`: read through this node's replica
    /// of its slot group, else (it keeps none, or that replica cannot read: one still being added holds
    /// nothing) asked of a node that keeps one.
    pub(super) fn confirm_stray(&mut self, channel: ChannelId, ask: u64) {
        let group = self.slot.table().group_of_key(channel.route_key());
        if self.serves_group_of(&channel) {
            if let Ok(read) = self.slot.read_index(self.now, group) {
                self.meta_reads.insert(read, MetaRead::Stray(StrayRead::Candidate { channel, ask }));
                return;
            }
        }
        self.confirm_remotely(channel, ask, group);
    }

    fn confirm_remotely(&mut self, channel: ChannelId, ask: u64, group: GroupId) {
        let me = self.config.node;
        let up = |node: &NodeId| *node != me && !self.controller.is_down(*node, self.now);
        let contact = self.group_contact(group).filter(up);
        let contact = contact.or_else(|| (self.config.nodes.len() > 1).then(|| self.next_peer_after(me)));
        match contact {
            Some(to) if self.stray_logs.confirming.len() < CONFIRMS_IN_FLIGHT_MAX => {
                self.ask_confirm(Confirming { channel, ask, since: self.now, tried: 0, asked: to }, to)
            }
            _ => self.feed_shard(&channel.clone(), ShardInput::StrayConfirmed { channel, ask, meta: None }),
        }
    }

    /// The node after `after` in the cluster's order (wrapping, never this one), passing over those
    /// the failure detector holds down while any other is left.
    fn next_peer_after(&self, after: NodeId) -> NodeId {
        let me = self.config.node;
        let nodes = &self.config.nodes;
        let start = nodes.iter().position(|n| *n == after).map_or(0, |at| at + 1);
        let ring = (0..nodes.len()).map(|i| nodes[(start + i) % nodes.len()]).filter(|n| *n != me);
        let candidates: Vec<NodeId> = ring.collect();
        let up = candidates.iter().copied().find(|n| !self.controller.is_down(*n, self.now));
        up.or_else(|| candidates.first().copied()).unwrap_or(me)
    }

    fn ask_confirm(&mut self, confirming: Confirming, to: NodeId) {
        let request = self.stray_logs.next_request();
        let channel = confirming.channel.clone();
        let asked = Confirming { tried: confirming.tried + 1, asked: to, ..confirming };
        self.stray_logs.confirming.insert(request, asked);
        self.send_node(to, NodeMessage::MetaConfirm { request, channel });
    }

    /// A peer asks for `channel`'s meta read authoritatively: through this node's replica of its slot
    /// group, else answered `None` at once.
    pub(super) fn serve_meta_confirm(&mut self, from: NodeId, request: u64, channel: ChannelId) {
        let group = self.slot.table().group_of_key(channel.route_key());
        let read = if self.serves_group_of(&channel) { self.slot.read_index(self.now, group).ok() } else { None };
        match read {
            Some(read) => {
                self.meta_reads.insert(read, MetaRead::Stray(StrayRead::Peer { to: from, request, channel }));
            }
            None => self.send_node(from, NodeMessage::MetaConfirmed { request, channel, meta: None }),
        }
    }

    /// Peer `from` answered a [`NodeMessage::MetaConfirm`] of this node's. One that could not read the
    /// meta (it may keep no replica of the group: the group's leader this node knows may be stale) is
    /// followed by the next node of the cluster, until each was asked once.
    pub(super) fn meta_confirmed(
        &mut self,
        from: NodeId,
        request: u64,
        channel: ChannelId,
        meta: Option<ChannelRuntimeMeta>,
    ) {
        let Some(confirming) = self.stray_logs.confirming.get(&request) else { return };
        // The answer must be about the channel asked for, and a meta must be that channel's.
        if confirming.channel != channel || meta.as_ref().is_some_and(|m| m.channel != channel) {
            return;
        }
        let Some(confirming) = self.stray_logs.confirming.remove(&request) else { return };
        if meta.is_none() && confirming.tried < self.config.nodes.len().saturating_sub(1) {
            let next = self.next_peer_after(from);
            return self.ask_confirm(confirming, next);
        }
        let Confirming { channel, ask, .. } = confirming;
        self.feed_shard(&channel.clone(), ShardInput::StrayConfirmed { channel, ask, meta });
    }

    /// A ReadIndex of `group` asked for a candidate's or a peer's authoritative meta is ready (`None`:
    /// it failed): the meta this node's replica holds now, if the group still serves the channel's
    /// hash slot.
    pub(super) fn stray_read_done(&mut self, group: Option<GroupId>, read: StrayRead) {
        let meta_of = |core: &Self, channel: &ChannelId| {
            let group = group?;
            let slot = tidings_router::hash_slot(channel.route_key());
            let stored = core.reader.slot_record(group, slot).ok()?;
            let record = tidings_slot::fsm::migration::record_in_force(group, core.slot.genesis(), slot, stored);
            tidings_slot::fsm::migration::admits(core.slot.genesis(), slot, record.as_ref()).ok()?;
            core.reader.runtime_meta(channel).ok().flatten()
        };
        match read {
            StrayRead::Candidate { channel, ask } => match meta_of(self, &channel) {
                Some(meta) => {
                    self.feed_shard(&channel.clone(), ShardInput::StrayConfirmed { channel, ask, meta: Some(meta) })
                }
                // The local replica could not tell: nodes that keep the group may.
                None => {
                    let group = self.slot.table().group_of_key(channel.route_key());
                    self.confirm_remotely(channel, ask, group);
                }
            },
            StrayRead::Peer { to, request, channel } => {
                let meta = meta_of(self, &channel);
                self.send_node(to, NodeMessage::MetaConfirmed { request, channel, meta });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn channel(name: &str) -> ChannelId {
        ChannelId::new(tidings_types::ChannelType::GROUP, name).unwrap()
    }

    /// Pages follow one another from the last channel listed, a short page ends the pass, and the next
    /// pass waits for its interval; a page lost on its way is asked again from the same place.
    #[test]
    fn a_pass_pages_from_the_last_channel_listed_and_the_next_waits_its_interval() {
        let config = StrayLogConfig {
            page: 2,
            page_interval: Duration::from_secs(1),
            pass_interval: Duration::from_secs(60),
            resume_after: Duration::from_secs(2),
        };
        let start = Time::ZERO;
        let me = NodeId::new(1);
        let mut sweep = StrayLogSweep::new(config, 7, start);
        assert!(sweep.page_due(start, me, false).is_none(), "no fanout, no resume pass");
        assert!(sweep.page_due(start, me, true).is_none(), "the first pass waits a pass interval after the start");
        let at = start + Duration::from_secs(60);
        let first = sweep.page_due(at, me, true).expect("due");
        assert_eq!((first.after.clone(), first.limit), (None, 2));
        assert!(sweep.page_due(at, me, true).is_none(), "one page at a time");
        let listed = |name: &str, named: bool| ListedLog { channel: channel(name), named, fanout_behind: false };
        sweep.listed(at, &first, Some(&[listed("a", false), listed("b", true)]));
        assert!(sweep.page_due(at, me, true).is_none());
        let at = at + Duration::from_secs(1);
        let second = sweep.page_due(at, me, true).expect("due after the page interval");
        assert_eq!(second.after, Some(channel("b")));
        // Lost: asked again from the same place once its patience ran out.
        assert!(sweep.page_due(at + Duration::from_secs(29), me, true).is_none());
        let again = sweep.page_due(at + PAGE_PATIENCE, me, true).expect("asked again");
        assert_eq!(again.after, Some(channel("b")));
        let at = at + PAGE_PATIENCE;
        sweep.listed(at, &again, Some(&[listed("c", false)]));
        assert_eq!((sweep.passes, sweep.cursor.clone()), (1, None), "a short page ends the pass");
        assert!(sweep.page_due(at + Duration::from_secs(59), me, true).is_none());
        assert_eq!(sweep.page_due(at + Duration::from_secs(60), me, true).expect("next pass").after, None);
    }

    /// A start is followed by the resume pass: `resume_after` later, in pages of `RESUME_PAGE` a short
    /// pause apart; it is no regular pass (none is counted), and the first regular pass keeps its time.
    #[test]
    fn a_start_is_followed_by_a_quick_resume_pass_and_the_regular_passes_keep_their_time() {
        let config = StrayLogConfig {
            page: 2,
            page_interval: Duration::from_secs(1),
            pass_interval: Duration::from_secs(60),
            resume_after: Duration::from_secs(2),
        };
        let me = NodeId::new(1);
        let mut sweep = StrayLogSweep::new(config, 7, Time::ZERO);
        assert!(sweep.page_due(Time::ZERO, me, true).is_none(), "the resume pass waits resume_after");
        let at = Time::ZERO + Duration::from_secs(2);
        let first = sweep.page_due(at, me, true).expect("the resume pass starts");
        assert!(first.resume);
        assert_eq!((first.after.clone(), first.limit), (None, RESUME_PAGE));
        let full: Vec<ListedLog> = (0..RESUME_PAGE)
            .map(|i| ListedLog { channel: channel(&format!("c{i:05}")), named: true, fanout_behind: false })
            .collect();
        sweep.listed(at, &first, Some(&full));
        let at = at + RESUME_PAGE_INTERVAL;
        let second = sweep.page_due(at, me, true).expect("the next page after a short pause");
        assert!(second.resume);
        assert_eq!(second.after, Some(full[RESUME_PAGE - 1].channel.clone()));
        sweep.listed(at, &second, Some(&[]));
        assert_eq!((sweep.passes, sweep.cursor.clone()), (0, None), "the resume pass is over, and no regular pass");
        assert!(sweep.page_due(Time::ZERO + Duration::from_secs(59), me, true).is_none());
        let regular = sweep.page_due(Time::ZERO + Duration::from_secs(60), me, true).expect("the first regular pass");
        assert!(!regular.resume);
        assert_eq!((regular.after, regular.limit), (None, 2));
    }

    /// Request ids carry the node's boot id: two starts never share one.
    #[test]
    fn request_ids_of_two_starts_differ() {
        let mut one = StrayLogSweep::new(StrayLogConfig::default(), 1, Time::ZERO);
        let mut two = StrayLogSweep::new(StrayLogConfig::default(), 2, Time::ZERO);
        assert_ne!(one.next_request(), two.next_request());
        assert!(StrayLogConfig { page: 0, ..StrayLogConfig::default() }.validate().is_err());
        assert!(StrayLogConfig::default().validate().is_ok());
    }
}
