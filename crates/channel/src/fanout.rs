//! Post-commit fanout: one committed copy of a message, delivered to a channel's online members by a
//! bounded, sans-IO planner.
//!
//! For each committed message the planner pages through the channel's subscribers (one bounded page at a
//! time, cursor-based — never the whole member list in memory), asks the host where each member is online
//! ([`FanoutEffect::Locate`]), and emits per-target delivery plans of bounded size
//! ([`FanoutEffect::Deliver`]). Person (1:1) channels skip paging: their two members come from the
//! channel id. "Committed" and "delivered" are separate events: a failed delivery is retried a bounded
//! number of times and then reported ([`FanoutEffect::Failed`]); it never touches the log. When too many
//! plans are in flight the planner waits (it slows down, it does not drop), and the queue of committed
//! messages waiting for fanout is bounded: the channel reserves that capacity before it appends.
//!
//! A message's fanout finishes ([`FanoutEffect::Finished`]) once every page was planned and each plan
//! was delivered or reported failed: only then does its channel's leader count it as fanned out, and a
//! leader that crashes before makes its successor fan the message out again (at least once; see
//! `ChannelMachine::fanout_finished`).
//!
//! Members that left are skipped, and so are members on the channel's deny list; a member whose
//! conversation is hidden is delivered with `unhide` set. Every plan entry carries what the host needs
//! to update conversation lists and unread badges without another read: the message's seq and sender,
//! and whether the member is the sender (no unread increment).
//!
//! Subscribers added while a message fans out are delivered if the page holding them has not been read
//! yet; subscribers removed are skipped if their page has not been read yet. Either way each member gets
//! at most one plan entry per message.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use tidings_types::{ChannelId, NodeId, Seq};

/// Limits of a [`FanoutPlanner`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FanoutConfig {
    /// Subscribers read per page. Default 1,000.
    pub page_size: usize,
    /// Members in one delivery plan. Default 500.
    pub plan_members_max: usize,
    /// Delivery plans handed to the host and not yet acknowledged; beyond it the planner waits. Default 64.
    pub plans_in_flight_max: usize,
    /// Messages paged and located at once (one page each, at most one per channel, so a channel's
    /// messages are planned in seq order): each waits for its page and its presence answer, and with
    /// one at a time those waits, not the work, bound how many messages a node fans out per second.
    /// Default 16.
    pub jobs_active_max: usize,
    /// Committed messages waiting for fanout (the handoff capacity). Default 10,000.
    pub queue_max: usize,
    /// Delivery attempts per plan before it is reported failed. Default 3.
    pub attempts_max: u32,
}

impl FanoutConfig {
    /// Most requests a planner has outstanding at once: a delivery plan per place in flight, and a page
    /// or a presence lookup per active job.
    pub fn requests_max(&self) -> usize {
        self.plans_in_flight_max.saturating_add(self.jobs_active_max.max(1))
    }
}

impl Default for FanoutConfig {
    fn default() -> Self {
        Self {
            page_size: 1000,
            plan_members_max: 500,
            plans_in_flight_max: 64,
            jobs_active_max: 16,
            queue_max: 10_000,
            attempts_max: 3,
        }
    }
}

/// A committed message to fan out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageRef {
    /// The channel.
    pub channel: ChannelId,
    /// Its seq.
    pub seq: Seq,
    /// The sender's uid, if known.
    pub sender: Option<String>,
}

/// A subscriber as a page lists it, with the state fanout needs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// The member's uid.
    pub uid: String,
    /// The member left the channel (skipped).
    pub left: bool,
    /// The member hid the conversation (delivered with `unhide`).
    pub hidden: bool,
    /// The member is on the channel's deny list (skipped).
    pub denied: bool,
}

/// Where a member is online, as the host's presence says.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Target {
    /// The node (or gateway) holding the member's session.
    pub node: NodeId,
}

/// One member in a delivery plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanEntry {
    /// The member.
    pub uid: String,
    /// The member is the sender: no unread increment.
    pub is_sender: bool,
    /// The member's conversation was hidden: show it again.
    pub unhide: bool,
}

/// A bounded delivery plan for one target.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliveryPlan {
    /// Identifies the plan in acknowledgements.
    pub id: u64,
    /// Where to deliver.
    pub target: Target,
    /// The message (one committed copy; the host reads it by reference).
    pub message: MessageRef,
    /// Who to deliver to there.
    pub members: Vec<PlanEntry>,
}

/// Identifies one message's fanout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct JobId(pub u64);

/// Why a message could not be queued for fanout.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FanoutError {
    /// The fanout queue is full; the channel must not append until capacity returns.
    #[error("fanout queue full ({max} messages)")]
    Full {
        /// The limit.
        max: usize,
    },
}

/// What the planner asks the runtime to do.
#[derive(Clone, Debug, PartialEq)]
#[must_use]
pub enum FanoutEffect {
    /// Read up to `limit` subscribers of `channel` after `cursor`, then call
    /// [`FanoutPlanner::handle_page`].
    FetchPage {
        /// The job.
        job: JobId,
        /// The channel.
        channel: ChannelId,
        /// Continue after this cursor (`None`: from the start).
        cursor: Option<Vec<u8>>,
        /// Page size.
        limit: usize,
    },
    /// Ask the host's presence where these members are online, then call
    /// [`FanoutPlanner::handle_located`].
    Locate {
        /// The job.
        job: JobId,
        /// Members to locate.
        uids: Vec<String>,
    },
    /// Hand this plan to the host's delivery, then call [`FanoutPlanner::handle_delivered`].
    Deliver(DeliveryPlan),
    /// A plan failed after every attempt; the message stays committed.
    Failed(DeliveryPlan),
    /// The job finished: every online member was planned, and each plan was delivered or reported
    /// failed. Its handoff slot is free again, and the channel's leader reports fanout past it.
    Finished {
        /// The job.
        job: JobId,
        /// The message.
        message: MessageRef,
    },
}

#[derive(Debug)]
enum Phase {
    /// Waiting for a page.
    Page,
    /// The next page starts after this cursor; it is fetched once the current page's plans are handed out.
    NextPage(Vec<u8>),
    /// Waiting for presence of the page's members.
    Locate { members: Vec<Member>, next: Option<Vec<u8>>, last_page: bool },
}

#[derive(Debug)]
struct Job {
    id: JobId,
    message: MessageRef,
    /// Person channels: the two members, no paging.
    fixed_members: Option<Vec<Member>>,
}

#[derive(Debug)]
struct Active {
    job: Job,
    phase: Phase,
}

#[derive(Debug)]
struct InFlight {
    job: JobId,
    plan: DeliveryPlan,
    attempts: u32,
}

/// The fanout planner of one node. Calling contract as for the channel machine: `handle_*`, then drain
/// [`FanoutPlanner::poll_effect`].
#[derive(Debug)]
pub struct FanoutPlanner {
    config: FanoutConfig,
    queue: VecDeque<Job>,
    /// Jobs being paged or located, at most `jobs_active_max`, at most one per channel.
    active: Vec<Active>,
    /// Plans built but not yet handed out (waiting for in-flight capacity), with their job.
    ready: VecDeque<(JobId, DeliveryPlan)>,
    in_flight: BTreeMap<u64, InFlight>,
    /// Plans built and not yet delivered or failed, per job (ready or in flight).
    plans_open: BTreeMap<JobId, usize>,
    /// Jobs whose every page was planned, waiting for their last plans to end before they finish.
    planned: BTreeMap<JobId, MessageRef>,
    effects: VecDeque<FanoutEffect>,
    next_job: u64,
    next_plan: u64,
}

impl FanoutPlanner {
    /// A planner with `config`.
    pub fn new(config: FanoutConfig) -> Self {
        Self {
            config,
            queue: VecDeque::new(),
            active: Vec::new(),
            ready: VecDeque::new(),
            in_flight: BTreeMap::new(),
            plans_open: BTreeMap::new(),
            planned: BTreeMap::new(),
            effects: VecDeque::new(),
            next_job: 1,
            next_plan: 1,
        }
    }

    /// Free handoff capacity (messages that can still be queued).
    pub fn capacity(&self) -> usize {
        self.config.queue_max.saturating_sub(self.queue.len() + self.active.len())
    }

    /// Queues a committed message. Person channels (`person_members`: the two uids) fan out without paging.
    pub fn submit(&mut self, message: MessageRef, person_members: Option<[String; 2]>) -> Result<JobId, FanoutError> {
        if self.capacity() == 0 {
            return Err(FanoutError::Full { max: self.config.queue_max });
        }
        let id = JobId(self.next_job);
        self.next_job += 1;
        let fixed_members = person_members.map(|uids| {
            uids.into_iter().map(|uid| Member { uid, left: false, hidden: false, denied: false }).collect()
        });
        self.queue.push_back(Job { id, message, fixed_members });
        self.advance();
        Ok(id)
    }

    /// A page of subscribers arrived (`next` is `None` on the last page).
    pub fn handle_page(&mut self, job: JobId, members: Vec<Member>, next: Option<Vec<u8>>) {
        let Some(active) = self.active.iter_mut().find(|a| a.job.id == job && matches!(a.phase, Phase::Page)) else {
            return;
        };
        let members: Vec<Member> = members.into_iter().filter(|m| !m.left && !m.denied).collect();
        let uids = members.iter().map(|m| m.uid.clone()).collect();
        let last_page = next.is_none();
        active.phase = Phase::Locate { members, next, last_page };
        self.effects.push_back(FanoutEffect::Locate { job, uids });
    }

    /// Presence answered: `targets[i]` is where `uids[i]` of the `Locate` is online (`None`: offline).
    pub fn handle_located(&mut self, job: JobId, targets: Vec<Option<Target>>) {
        let Some(index) = self.active.iter().position(|a| a.job.id == job) else { return };
        let active = &mut self.active[index];
        let Phase::Locate { members, next, last_page } = std::mem::replace(&mut active.phase, Phase::Page) else {
            return;
        };
        let message = active.job.message.clone();
        let mut by_target: BTreeMap<Target, Vec<PlanEntry>> = BTreeMap::new();
        for (member, target) in members.into_iter().zip(targets) {
            let Some(target) = target else { continue };
            let is_sender = message.sender.as_deref() == Some(member.uid.as_str());
            by_target.entry(target).or_default().push(PlanEntry { uid: member.uid, is_sender, unhide: member.hidden });
        }
        for (target, entries) in by_target {
            for chunk in entries.chunks(self.config.plan_members_max) {
                let id = self.next_plan;
                self.next_plan += 1;
                let plan =
                    DeliveryPlan { id, target: target.clone(), message: message.clone(), members: chunk.to_vec() };
                self.ready.push_back((job, plan));
                *self.plans_open.entry(job).or_default() += 1;
            }
        }
        match next {
            Some(cursor) if !last_page => active.phase = Phase::NextPage(cursor),
            _ => {
                let active = self.active.remove(index);
                if self.plans_open.contains_key(&job) {
                    self.planned.insert(job, active.job.message);
                } else {
                    self.effects.push_back(FanoutEffect::Finished { job, message: active.job.message });
                }
            }
        }
        self.advance();
    }

    /// The host delivered (or failed to deliver) plan `id`.
    pub fn handle_delivered(&mut self, id: u64, delivered: bool) {
        let Some(mut flight) = self.in_flight.remove(&id) else { return };
        if !delivered {
            if flight.attempts < self.config.attempts_max {
                flight.attempts += 1;
                self.effects.push_back(FanoutEffect::Deliver(flight.plan.clone()));
                self.in_flight.insert(id, flight);
                return;
            }
            self.effects.push_back(FanoutEffect::Failed(flight.plan));
        }
        self.plan_ended(flight.job);
        self.advance();
    }

    /// A plan of `job` was delivered or failed for good; the job finishes with its last plan.
    fn plan_ended(&mut self, job: JobId) {
        let Some(open) = self.plans_open.get_mut(&job) else { return };
        *open -= 1;
        if *open > 0 {
            return;
        }
        self.plans_open.remove(&job);
        if let Some(message) = self.planned.remove(&job) {
            self.effects.push_back(FanoutEffect::Finished { job, message });
        }
    }

    /// Stops planning `channel`'s messages (its replica here no longer leads; the next leader plans them
    /// again): its queued jobs go, the job in progress too (answers for it are ignored), and its plans
    /// not yet handed out. Plans already with the host end as they will, but none of these jobs reports
    /// [`FanoutEffect::Finished`]: the same message may be this node's to fan out again by then (it led
    /// the channel once more), and an old job's end must not count for the new one.
    pub fn cancel_channel(&mut self, channel: &ChannelId) {
        self.queue.retain(|job| job.message.channel != *channel);
        self.active.retain(|active| active.job.message.channel != *channel);
        self.planned.retain(|_, message| message.channel != *channel);
        let mut dropped = Vec::new();
        self.ready.retain(|(job, plan)| {
            let keep = plan.message.channel != *channel;
            if !keep {
                dropped.push(*job);
            }
            keep
        });
        for job in dropped {
            self.plan_ended(job);
        }
        self.advance();
    }

    /// Next effect to carry out.
    pub fn poll_effect(&mut self) -> Option<FanoutEffect> {
        self.effects.pop_front()
    }

    /// Plans built and not yet acknowledged (memory held is bounded by this and one page).
    pub fn plans_pending(&self) -> usize {
        self.ready.len() + self.in_flight.len()
    }

    /// Messages submitted and not finished: queued, being paged, or waiting for their last plans.
    pub fn jobs_open(&self) -> usize {
        self.queue.len() + self.active.len() + self.planned.len()
    }

    /// Hands out ready plans within the in-flight bound; once every plan built is handed out, fetches
    /// the next page of the jobs waiting for one and starts queued jobs up to `jobs_active_max` (so a
    /// huge group never builds more than a page of plans ahead, and a slow host holds everything back).
    fn advance(&mut self) {
        while self.in_flight.len() < self.config.plans_in_flight_max {
            let Some((job, plan)) = self.ready.pop_front() else { break };
            self.effects.push_back(FanoutEffect::Deliver(plan.clone()));
            self.in_flight.insert(plan.id, InFlight { job, plan, attempts: 1 });
        }
        if !self.ready.is_empty() {
            return; // A page of plans at a time: memory stays bounded by the page size.
        }
        for active in &mut self.active {
            // A job goes on with its next page, if it is waiting for one.
            if matches!(active.phase, Phase::NextPage(_)) {
                let Phase::NextPage(cursor) = std::mem::replace(&mut active.phase, Phase::Page) else { unreachable!() };
                let (job, channel, limit) = (active.job.id, active.job.message.channel.clone(), self.config.page_size);
                self.effects.push_back(FanoutEffect::FetchPage { job, channel, cursor: Some(cursor), limit });
            }
        }
        while self.active.len() < self.config.jobs_active_max.max(1) {
            // The first queued job of a channel with none active: a channel's messages start in order.
            let busy = |job: &Job| self.active.iter().any(|a| a.job.message.channel == job.message.channel);
            let Some(position) = self.queue.iter().take(QUEUE_SCAN_MAX).position(|job| !busy(job)) else { return };
            let job = self.queue.remove(position).expect("position found in the queue");
            self.start(job);
        }
    }

    /// Starts `job`: its first page, or straight to presence for a person channel's two members.
    fn start(&mut self, job: Job) {
        let id = job.id;
        match job.fixed_members.clone() {
            Some(members) => {
                let uids = members.iter().map(|m| m.uid.clone()).collect();
                self.active.push(Active { job, phase: Phase::Locate { members, next: None, last_page: true } });
                self.effects.push_back(FanoutEffect::Locate { job: id, uids });
            }
            None => {
                let channel = job.message.channel.clone();
                self.active.push(Active { job, phase: Phase::Page });
                let limit = self.config.page_size;
                self.effects.push_back(FanoutEffect::FetchPage { job: id, channel, cursor: None, limit });
            }
        }
    }
}

/// Queued jobs looked at for one that may start (its channel has none active): a queue headed by many
/// messages of busy channels waits for them rather than being searched through.
const QUEUE_SCAN_MAX: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;
    use tidings_types::ChannelType;

    fn message(seq: u64) -> MessageRef {
        MessageRef {
            channel: ChannelId::new(ChannelType::GROUP, "g").unwrap(),
            seq: Seq::new(seq),
            sender: Some("u0".into()),
        }
    }

    /// What a planner asked for and got no answer to yet.
    #[derive(Debug)]
    enum Asked {
        Page(JobId, usize),
        Locate(JobId, usize),
        Deliver(u64),
    }

    /// Answers in a scrambled order (pages of two, the last after three; every member online, on one of
    /// three nodes; a third of the deliveries refused): what the planner asks for and has no answer to is
    /// never more than `requests_max`, which the runtime sizes its fanout queue by.
    #[test]
    fn outstanding_requests_never_exceed_requests_max() {
        let config = FanoutConfig {
            page_size: 2,
            plan_members_max: 1,
            plans_in_flight_max: 3,
            jobs_active_max: 2,
            ..FanoutConfig::default()
        };
        let mut planner = FanoutPlanner::new(config);
        for (i, name) in ["g", "h", "k", "m", "n", "p"].iter().enumerate() {
            for seq in 1..=3 {
                let message = MessageRef { channel: ChannelId::new(ChannelType::GROUP, name).unwrap(), ..message(seq) };
                let person = (i % 3 == 0).then(|| [format!("{name}-a"), format!("{name}-b")]);
                planner.submit(message, person).unwrap();
            }
        }
        let (mut asked, mut most, mut state, mut finished) = (Vec::new(), 0, 7_u64, 0);
        loop {
            while let Some(effect) = planner.poll_effect() {
                match effect {
                    FanoutEffect::FetchPage { job, cursor, .. } => {
                        let page = cursor.map_or(0, |c| usize::from(c[0]));
                        asked.push(Asked::Page(job, page));
                    }
                    FanoutEffect::Locate { job, uids } => asked.push(Asked::Locate(job, uids.len())),
                    FanoutEffect::Deliver(plan) => asked.push(Asked::Deliver(plan.id)),
                    FanoutEffect::Failed(_) => {}
                    FanoutEffect::Finished { .. } => finished += 1,
                }
            }
            most = most.max(asked.len());
            assert!(asked.len() <= config.requests_max(), "{} outstanding: {asked:?}", asked.len());
            if asked.is_empty() {
                break;
            }
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let pick = usize::try_from(state >> 33).unwrap() % asked.len();
            match asked.swap_remove(pick) {
                Asked::Page(job, page) => {
                    let member =
                        |k: usize| Member { uid: format!("u{page}-{k}"), left: false, hidden: false, denied: false };
                    let next = (page < 2).then(|| vec![u8::try_from(page + 1).unwrap()]);
                    planner.handle_page(job, vec![member(0), member(1)], next);
                }
                Asked::Locate(job, count) => {
                    let targets = (0..count).map(|k| Some(Target { node: NodeId::new(1 + (k % 3) as u64) })).collect();
                    planner.handle_located(job, targets);
                }
                Asked::Deliver(id) => planner.handle_delivered(id, state % 3 != 0),
            }
        }
        assert_eq!((finished, planner.jobs_open()), (18, 0), "every message's fanout ends");
        assert_eq!(most, config.requests_max(), "the bound is reached, so the check can fail");
    }

    #[test]
    fn full_queue_is_a_typed_refusal() {
        let mut planner = FanoutPlanner::new(FanoutConfig { queue_max: 2, ..FanoutConfig::default() });
        planner.submit(message(1), None).unwrap();
        planner.submit(message(2), None).unwrap();
        assert_eq!(planner.submit(message(3), None), Err(FanoutError::Full { max: 2 }));
    }

    #[test]
    fn failed_deliveries_retry_then_report() {
        let config = FanoutConfig { attempts_max: 2, ..FanoutConfig::default() };
        let mut planner = FanoutPlanner::new(config);
        let job = planner.submit(message(1), Some(["a".into(), "b".into()])).unwrap();
        let Some(FanoutEffect::Locate { .. }) = planner.poll_effect() else { panic!("locate expected") };
        planner.handle_located(job, vec![Some(Target { node: NodeId::new(1) }), None]);
        let effects: Vec<FanoutEffect> = std::iter::from_fn(|| planner.poll_effect()).collect();
        let plan = effects
            .iter()
            .find_map(|e| match e {
                FanoutEffect::Deliver(p) => Some(p.clone()),
                _ => None,
            })
            .unwrap();
        assert_eq!(plan.members.len(), 1, "offline member not planned");
        planner.handle_delivered(plan.id, false);
        assert!(matches!(planner.poll_effect(), Some(FanoutEffect::Deliver(_))));
        planner.handle_delivered(plan.id, false);
        assert!(matches!(planner.poll_effect(), Some(FanoutEffect::Failed(_))));
        assert_eq!(planner.plans_pending(), 0);
    }

    #[test]
    fn a_cancelled_channel_plans_nothing_more_and_the_others_go_on() {
        let other = |seq| MessageRef { channel: ChannelId::new(ChannelType::GROUP, "h").unwrap(), ..message(seq) };
        let mut planner = FanoutPlanner::new(FanoutConfig::default());
        // A person channel's job has its plan with the host when the channel is cancelled.
        let person = MessageRef { channel: ChannelId::new(ChannelType::PERSON, "a@b").unwrap(), ..message(7) };
        let with_host = planner.submit(person.clone(), Some(["a".into(), "b".into()])).unwrap();
        assert!(matches!(planner.poll_effect(), Some(FanoutEffect::Locate { .. })));
        planner.handle_located(with_host, vec![Some(Target { node: NodeId::new(1) }), None]);
        let Some(FanoutEffect::Deliver(out)) = planner.poll_effect() else { panic!("its plan goes out") };
        planner.cancel_channel(&person.channel);
        planner.handle_delivered(out.id, true);
        assert_eq!(planner.poll_effect(), None, "a cancelled job reports no end");
        let cancelled = planner.submit(message(1), None).unwrap();
        planner.submit(message(2), None).unwrap();
        let kept = planner.submit(other(1), None).unwrap();
        let Some(FanoutEffect::FetchPage { job, .. }) = planner.poll_effect() else { panic!("a page of the first") };
        assert_eq!(job, cancelled);
        planner.cancel_channel(&message(1).channel);
        // The other channel's job starts at once; a late page for the cancelled job changes nothing.
        let Some(FanoutEffect::FetchPage { job, .. }) = planner.poll_effect() else { panic!("the next job starts") };
        assert_eq!(job, kept);
        planner.handle_page(
            cancelled,
            vec![Member { uid: "a".into(), left: false, hidden: false, denied: false }],
            None,
        );
        assert_eq!(planner.poll_effect(), None);
        planner.handle_page(kept, vec![Member { uid: "b".into(), left: false, hidden: false, denied: false }], None);
        let Some(FanoutEffect::Locate { job, .. }) = planner.poll_effect() else { panic!("the kept job goes on") };
        planner.handle_located(job, vec![Some(Target { node: NodeId::new(1) })]);
        let Some(FanoutEffect::Deliver(plan)) = planner.poll_effect() else { panic!("its plan") };
        planner.handle_delivered(plan.id, true);
        assert!(matches!(planner.poll_effect(), Some(FanoutEffect::Finished { job, .. }) if job == kept));
        assert_eq!((planner.poll_effect(), planner.capacity()), (None, FanoutConfig::default().queue_max));
    }

    #[test]
    fn a_cancelled_channel_s_plans_waiting_for_room_go_and_nothing_of_its_job_stays() {
        let config = FanoutConfig { plans_in_flight_max: 1, ..FanoutConfig::default() };
        let mut planner = FanoutPlanner::new(config);
        let job = planner.submit(message(1), None).unwrap();
        assert!(matches!(planner.poll_effect(), Some(FanoutEffect::FetchPage { .. })));
        let member = |uid: &str| Member { uid: uid.into(), left: false, hidden: false, denied: false };
        planner.handle_page(job, vec![member("a"), member("b"), member("c")], None);
        assert!(matches!(planner.poll_effect(), Some(FanoutEffect::Locate { .. })));
        // Three targets, three plans: one goes out, two wait for room.
        let targets = (1..=3).map(|node| Some(Target { node: NodeId::new(node) })).collect();
        planner.handle_located(job, targets);
        let Some(FanoutEffect::Deliver(out)) = planner.poll_effect() else { panic!("one plan goes out") };
        assert_eq!((planner.poll_effect(), planner.plans_pending()), (None, 3));
        planner.cancel_channel(&message(1).channel);
        assert_eq!(planner.plans_pending(), 1, "only the plan with the host is left");
        // The plan with the host ends as it will; the job reports no end, and nothing of it is kept.
        planner.handle_delivered(out.id, true);
        assert_eq!(planner.poll_effect(), None);
        assert_eq!((planner.plans_pending(), planner.jobs_open()), (0, 0));
        assert!(planner.plans_open.is_empty() && planner.planned.is_empty());
    }

    #[test]
    fn several_messages_are_paged_at_once_and_a_channels_next_waits_for_its_previous() {
        let in_channel =
            |name: &str, seq| MessageRef { channel: ChannelId::new(ChannelType::GROUP, name).unwrap(), ..message(seq) };
        let fetched = |planner: &mut FanoutPlanner| -> Vec<JobId> {
            std::iter::from_fn(|| planner.poll_effect())
                .filter_map(|effect| match effect {
                    FanoutEffect::FetchPage { job, .. } => Some(job),
                    _ => None,
                })
                .collect()
        };
        let mut planner = FanoutPlanner::new(FanoutConfig { jobs_active_max: 2, ..FanoutConfig::default() });
        let g1 = planner.submit(in_channel("g", 1), None).unwrap();
        let g2 = planner.submit(in_channel("g", 2), None).unwrap();
        let h1 = planner.submit(in_channel("h", 1), None).unwrap();
        let k1 = planner.submit(in_channel("k", 1), None).unwrap();
        assert_eq!(fetched(&mut planner), vec![g1, h1], "two at once, g's second after its first");
        assert_eq!(planner.jobs_open(), 4);
        let member = Member { uid: "a".into(), left: false, hidden: false, denied: false };
        planner.handle_page(h1, vec![member.clone()], None);
        planner.handle_located(h1, vec![None]);
        // h's message is planned (nobody online: it finished at once), and the first queued job whose
        // channel has none active starts: k's, since g's first is still being paged.
        let effects: Vec<FanoutEffect> = std::iter::from_fn(|| planner.poll_effect()).collect();
        assert!(matches!(effects.first(), Some(FanoutEffect::Locate { job, .. }) if *job == h1));
        assert!(effects.iter().any(|e| matches!(e, FanoutEffect::Finished { job, .. } if *job == h1)));
        assert!(effects.iter().any(|e| matches!(e, FanoutEffect::FetchPage { job, .. } if *job == k1)));
        planner.handle_page(g1, vec![member], None);
        planner.handle_located(g1, vec![None]);
        assert!(fetched(&mut planner).contains(&g2), "g's second starts once its first is planned");
    }

    #[test]
    fn a_job_finishes_only_once_each_of_its_plans_was_delivered_or_failed() {
        let mut planner = FanoutPlanner::new(FanoutConfig { attempts_max: 1, ..FanoutConfig::default() });
        let job = planner.submit(message(1), Some(["a".into(), "b".into()])).unwrap();
        let Some(FanoutEffect::Locate { .. }) = planner.poll_effect() else { panic!("locate expected") };
        let (one, two) = (Target { node: NodeId::new(1) }, Target { node: NodeId::new(2) });
        planner.handle_located(job, vec![Some(one), Some(two)]);
        let plans: Vec<u64> = std::iter::from_fn(|| planner.poll_effect())
            .map(|effect| match effect {
                FanoutEffect::Deliver(plan) => plan.id,
                other => panic!("only deliveries before the plans end, got {other:?}"),
            })
            .collect();
        assert_eq!(plans.len(), 2, "one plan per target");
        planner.handle_delivered(plans[0], true);
        assert_eq!(planner.poll_effect(), None, "one plan still out");
        planner.handle_delivered(plans[1], false);
        assert!(matches!(planner.poll_effect(), Some(FanoutEffect::Failed(_))));
        assert!(matches!(planner.poll_effect(), Some(FanoutEffect::Finished { job: finished, .. }) if finished == job));
        assert_eq!(planner.poll_effect(), None);
    }
}
