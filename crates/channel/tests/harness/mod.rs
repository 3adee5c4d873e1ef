//! A small cluster of channel replicas in one thread, on virtual time: seeded network faults (loss,
//! duplication, delay and so reordering, partitions), storage with latency and a crash model, a stand-in
//! for the slot layer (authoritative meta, compare-and-set proposals, failover with evidence), and a
//! client-side oracle with invariant checks after every step.
#![allow(dead_code, clippy::disallowed_methods)]

use bytes::Bytes;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use tidings_channel::machine::{
    AppendAborted, AppendError, AppendRecord, AppendRequest, ChannelMachine, ChannelMessage, Effect, MachineConfig,
    PersistToken, ReadToken, RequestId, RetentionRequest, RoleKind,
};
use tidings_store::message::{
    IdempotencyKey, LogBatch, LogLimits, MemoryLog, MessageLog, ReadLimits, Record, RecordKind,
};
use tidings_types::{
    ChannelId, ChannelRuntimeMeta, ChannelType, DetRng, Epoch, LeaderEpoch, NodeId, Seq, Time, WriteFence,
};

pub fn node(i: u64) -> NodeId {
    NodeId::new(i)
}

pub fn channel() -> ChannelId {
    ChannelId::new(ChannelType::GROUP, "room").unwrap()
}

/// Fault rates, per million.
#[derive(Clone, Copy, Debug, Default)]
pub struct Faults {
    pub loss: u32,
    pub duplicate: u32,
    /// Network delay range, ms.
    pub delay_ms: (u64, u64),
    /// Storage latency range, ms.
    pub disk_ms: (u64, u64),
}

#[derive(Debug)]
enum Event {
    Deliver { from: NodeId, to: NodeId, message: ChannelMessage },
    Persisted { node: NodeId, incarnation: u64, token: PersistToken, batch: LogBatch },
    Read { node: NodeId, incarnation: u64, token: ReadToken, from: Seq, through: Seq, max_bytes: usize },
    Meta { node: NodeId, meta: ChannelRuntimeMeta },
}

pub struct Replica {
    pub machine: Option<ChannelMachine>,
    pub log: MemoryLog,
    pub incarnation: u64,
    /// Highest HW seen since the last restart (HW never goes back on a replica that did not crash).
    pub hw_seen: Seq,
}

/// What the client was told.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Pending,
    Acked(Vec<Seq>),
    Aborted(AppendAborted),
    /// The node holding the request crashed: the client never hears back (outcome unknown).
    Lost,
}

pub struct Submitted {
    pub to: NodeId,
    pub payloads: Vec<Bytes>,
    pub keys: Vec<Option<IdempotencyKey>>,
    pub outcome: Outcome,
}

pub struct Cluster {
    pub now: Time,
    pub rng: DetRng,
    pub faults: Faults,
    pub config: MachineConfig,
    pub replicas: BTreeMap<NodeId, Replica>,
    /// The authoritative meta (what the slot layer holds).
    pub meta: ChannelRuntimeMeta,
    events: BinaryHeap<Reverse<(Time, u64, usize)>>,
    event_bodies: Vec<Option<Event>>,
    next_event: u64,
    /// One-way blocked links (from, to).
    pub blocked: BTreeSet<(NodeId, NodeId)>,
    next_incarnation: u64,
    next_request: u64,
    pub requests: BTreeMap<RequestId, Submitted>,
    /// First committed record seen at each seq (by any replica, at or below its HW).
    pub committed: BTreeMap<Seq, Record>,
    pub trace: Vec<String>,
    /// Whether the slot-layer stand-in applies meta proposals from leaders.
    pub accept_proposals: bool,
    /// Replicas that hear no meta (published or asked for): a node whose meta pushes and answers are lost.
    pub meta_unheard: BTreeSet<NodeId>,
    /// Retention moves submitted, and their outcome once known.
    pub retentions: BTreeMap<RequestId, Option<Result<Seq, AppendAborted>>>,
    /// Every message a replica handed to fanout (`Committed`), in order.
    pub handed_off: Vec<(NodeId, Seq)>,
    /// While set, handed-off messages wait in `fanning` (a slow fanout) instead of finishing at once.
    pub fanout_held: bool,
    /// Messages whose fanout has not finished, per replica (lost with a crash, as the planner's memory).
    pub fanning: BTreeMap<NodeId, Vec<Seq>>,
}

impl Cluster {
    /// `n` replicas, all in the ISR, node 1 leading, with `min_isr`.
    pub fn new(seed: u64, n: u64, min_isr: u8, faults: Faults, config: MachineConfig) -> Self {
        let nodes: Vec<NodeId> = (1..=n).map(node).collect();
        let meta = ChannelRuntimeMeta {
            channel: channel(),
            version: 1,
            leader: node(1),
            replicas: nodes.clone(),
            isr: nodes.clone(),
            min_isr,
            epoch: Epoch::new(1),
            leader_epoch: LeaderEpoch::new(1),
            write_fence: None,
            retention_through: Seq::new(0),
        };
        let mut cluster = Cluster {
            now: Time::ZERO,
            rng: DetRng::new(seed),
            faults,
            config,
            replicas: BTreeMap::new(),
            meta: meta.clone(),
            events: BinaryHeap::new(),
            event_bodies: Vec::new(),
            next_event: 0,
            blocked: BTreeSet::new(),
            next_incarnation: 1,
            next_request: 1,
            requests: BTreeMap::new(),
            committed: BTreeMap::new(),
            trace: Vec::new(),
            accept_proposals: true,
            meta_unheard: BTreeSet::new(),
            retentions: BTreeMap::new(),
            handed_off: Vec::new(),
            fanout_held: false,
            fanning: BTreeMap::new(),
        };
        for id in nodes {
            cluster.replicas.insert(
                id,
                Replica {
                    machine: None,
                    log: MemoryLog::new(LogLimits::default()),
                    incarnation: 0,
                    hw_seen: Seq::new(0),
                },
            );
            cluster.start(id);
        }
        cluster
    }

    fn schedule(&mut self, at: Time, event: Event) {
        let index = self.event_bodies.len();
        self.event_bodies.push(Some(event));
        self.events.push(Reverse((at, self.next_event, index)));
        self.next_event += 1;
    }

    fn random_delay(&mut self, (low, high): (u64, u64)) -> std::time::Duration {
        std::time::Duration::from_millis(self.rng.range(low, high.max(low)))
    }

    /// (Re)starts `id` from its durable log, with the authoritative meta.
    pub fn start(&mut self, id: NodeId) {
        self.start_incarnation(id, false);
    }

    /// Evicts `id`'s quiescent machine (no crash: its log keeps everything) and builds the next
    /// incarnation, which resumes leading its epoch as a runtime's activation lets it.
    pub fn evict_and_resume(&mut self, id: NodeId) {
        assert!(self.machine(id).is_quiescent(), "only a quiescent replica is evicted");
        self.trace.push(format!("{} evict {id}", self.now));
        self.start_incarnation(id, true);
    }

    /// [`Cluster::evict_and_resume`] under `meta` rather than the authoritative one: a runtime whose
    /// copy of the meta is stale (its pushes lost) builds the next incarnation under it.
    pub fn evict_and_resume_under(&mut self, id: NodeId, meta: ChannelRuntimeMeta) {
        assert!(self.machine(id).is_quiescent(), "only a quiescent replica is evicted");
        self.trace.push(format!("{} evict {id}, resumed under meta v{}", self.now, meta.version));
        self.start_incarnation_under(id, true, meta);
    }

    fn start_incarnation(&mut self, id: NodeId, resume: bool) {
        let meta = self.meta.clone();
        self.start_incarnation_under(id, resume, meta);
    }

    fn start_incarnation_under(&mut self, id: NodeId, resume: bool, meta: ChannelRuntimeMeta) {
        let incarnation = self.next_incarnation;
        self.next_incarnation += 1;
        let replica = self.replicas.get_mut(&id).unwrap();
        let state = replica.log.state(&channel()).unwrap();
        let from = Seq::new(state.last_seq.get().saturating_sub(1024).max(1));
        let recent = replica
            .log
            .read(&channel(), from, state.last_seq, ReadLimits { records_max: usize::MAX, bytes_max: usize::MAX })
            .unwrap();
        let mut machine = ChannelMachine::new(channel(), id, self.config.clone(), incarnation, self.now, state, recent);
        if resume {
            machine.resume_leadership(meta.leader_epoch);
        }
        machine.handle_meta(self.now, meta).unwrap();
        replica.machine = Some(machine);
        replica.incarnation = incarnation;
        replica.hw_seen = Seq::new(0);
        self.trace.push(format!("{} start {id} inc {incarnation}", self.now));
        self.drain(id);
    }

    /// Crashes `id`: its machine is gone and every write not yet durable is lost.
    pub fn crash(&mut self, id: NodeId) {
        let replica = self.replicas.get_mut(&id).unwrap();
        replica.machine = None;
        replica.log.crash();
        self.fanning.remove(&id);
        for submitted in self.requests.values_mut().filter(|r| r.to == id && r.outcome == Outcome::Pending) {
            submitted.outcome = Outcome::Lost;
        }
        self.trace.push(format!("{} crash {id}", self.now));
    }

    /// Fanout of `seqs`, held on `id` (`fanning`), finishes.
    pub fn finish_fanout(&mut self, id: NodeId, seqs: &[Seq]) {
        if let Some(fanning) = self.fanning.get_mut(&id) {
            fanning.retain(|seq| !seqs.contains(seq));
        }
        if let Some(machine) = self.replicas.get_mut(&id).and_then(|r| r.machine.as_mut()) {
            for seq in seqs {
                machine.fanout_finished(*seq);
            }
        }
        self.drain(id);
    }

    /// The messages `id` handed to fanout, in order.
    pub fn handed_off_by(&self, id: NodeId) -> Vec<Seq> {
        self.handed_off.iter().filter(|(n, _)| *n == id).map(|(_, seq)| *seq).collect()
    }

    pub fn is_up(&self, id: NodeId) -> bool {
        self.replicas[&id].machine.is_some()
    }

    pub fn machine(&self, id: NodeId) -> &ChannelMachine {
        self.replicas[&id].machine.as_ref().expect("replica is up")
    }

    /// Submits an append to `to`; returns the request id, or the synchronous refusal.
    pub fn append(&mut self, to: NodeId, payloads: &[&str], keys: &[Option<&str>]) -> Result<RequestId, AppendError> {
        let id = RequestId(self.next_request);
        self.next_request += 1;
        let payloads: Vec<Bytes> = payloads.iter().map(|p| Bytes::from(p.to_string())).collect();
        let keys: Vec<Option<IdempotencyKey>> = (0..payloads.len())
            .map(|i| keys.get(i).copied().flatten().map(|k| IdempotencyKey::new(k.as_bytes().to_vec()).unwrap()))
            .collect();
        let records = payloads
            .iter()
            .zip(&keys)
            .map(|(payload, key)| AppendRecord { idempotency_key: key.clone(), payload: payload.clone() })
            .collect();
        let now = self.now;
        let Some(machine) = self.replicas.get_mut(&to).and_then(|r| r.machine.as_mut()) else {
            return Err(AppendError::NotReady);
        };
        machine.handle_append(now, AppendRequest { id, records })?;
        self.requests.insert(id, Submitted { to, payloads, keys, outcome: Outcome::Pending });
        self.drain(to);
        Ok(id)
    }

    /// Submits `count` one-record appends to `to` (payloads `m0`, `m1`, ...); returns their request ids.
    pub fn append_each(&mut self, to: NodeId, count: usize) -> Vec<RequestId> {
        (0..count).map(|i| self.append(to, &[format!("m{i}").as_str()], &[]).unwrap()).collect()
    }

    /// Asks `to` to give up the records through `through`; returns the request id, or the refusal.
    pub fn retain(&mut self, to: NodeId, through: Seq) -> Result<RequestId, AppendError> {
        let id = RequestId(self.next_request);
        self.next_request += 1;
        let now = self.now;
        let Some(machine) = self.replicas.get_mut(&to).and_then(|r| r.machine.as_mut()) else {
            return Err(AppendError::NotReady);
        };
        machine.handle_retention(now, RetentionRequest { id, through })?;
        self.retentions.insert(id, None);
        self.drain(to);
        Ok(id)
    }

    /// Carries out every effect `id` produced.
    fn drain(&mut self, id: NodeId) {
        loop {
            let Some(effect) =
                self.replicas.get_mut(&id).and_then(|r| r.machine.as_mut()).and_then(|m| m.poll_effect())
            else {
                break;
            };
            self.carry_out(id, effect);
        }
        self.check_invariants();
    }

    fn carry_out(&mut self, id: NodeId, effect: Effect) {
        let incarnation = self.replicas[&id].incarnation;
        match effect {
            Effect::Persist { token, batch } => {
                let at = self.now + self.random_delay(self.faults.disk_ms);
                self.schedule(at, Event::Persisted { node: id, incarnation, token, batch });
            }
            Effect::Send { to, message } => self.send(id, to, message),
            Effect::Read { token, from, through, max_bytes } => {
                let at = self.now + self.random_delay(self.faults.disk_ms);
                self.schedule(at, Event::Read { node: id, incarnation, token, from, through, max_bytes });
            }
            Effect::AppendDone { id: request, result } => {
                let outcome = match result {
                    Ok(seqs) => Outcome::Acked(seqs),
                    Err(reason) => Outcome::Aborted(reason),
                };
                self.trace.push(format!("{} done {request:?} {outcome:?}", self.now));
                if let Some(submitted) = self.requests.get_mut(&request) {
                    assert_eq!(submitted.outcome, Outcome::Pending, "request completed twice");
                    submitted.outcome = outcome;
                }
            }
            Effect::RetentionDone { id: request, result } => {
                self.trace.push(format!("{} retention done {request:?} {result:?}", self.now));
                let outcome = self.retentions.get_mut(&request).expect("a submitted retention move");
                assert!(outcome.is_none(), "retention move completed twice");
                *outcome = Some(result);
            }
            Effect::Committed { messages, .. } => {
                self.handed_off.extend(messages.iter().map(|seq| (id, *seq)));
                if self.fanout_held {
                    self.fanning.entry(id).or_default().extend(messages);
                } else if let Some(machine) = self.replicas.get_mut(&id).and_then(|r| r.machine.as_mut()) {
                    for seq in messages {
                        machine.fanout_finished(seq);
                    }
                }
            }
            Effect::ProposeMeta { expected_version, meta, reason } => {
                if self.accept_proposals && expected_version == self.meta.version {
                    self.trace.push(format!("{} meta cas ok {reason:?}", self.now));
                    self.publish(*meta);
                }
            }
            Effect::RefreshMeta => {
                let meta = self.meta.clone();
                let at = self.now + self.random_delay(self.faults.delay_ms);
                self.schedule(at, Event::Meta { node: id, meta });
            }
            Effect::StorageFailed => self.trace.push(format!("{} storage failed on {id}", self.now)),
            Effect::FanoutHandedOver => {
                // The planner forgets the channel's unfinished messages: the next leader has them.
                self.trace.push(format!("{} {id} hands its unfinished fanout over", self.now));
                self.fanning.remove(&id);
            }
            Effect::NeedsFailover => {
                // The controller's repair loop: fail over with evidence from every live ISR member.
                if self.meta.leader == id {
                    let down: Vec<NodeId> =
                        self.replicas.iter().filter(|(_, r)| r.machine.is_none()).map(|(n, _)| *n).collect();
                    self.trace.push(format!("{} {id} needs failover", self.now));
                    self.failover(&down, None, None);
                }
            }
        }
    }

    fn send(&mut self, from: NodeId, to: NodeId, message: ChannelMessage) {
        // Every message crosses the wire encoding.
        let bytes = postcard::to_allocvec(&message).unwrap();
        let message: ChannelMessage = postcard::from_bytes(&bytes).unwrap();
        if self.blocked.contains(&(from, to)) || self.rng.chance(self.faults.loss) {
            return;
        }
        let copies = if self.rng.chance(self.faults.duplicate) { 2 } else { 1 };
        for _ in 0..copies {
            let at = self.now + self.random_delay(self.faults.delay_ms);
            self.schedule(at, Event::Deliver { from, to, message: message.clone() });
        }
    }

    /// Makes `meta` authoritative and delivers it to every replica (old and new members).
    pub fn publish(&mut self, meta: ChannelRuntimeMeta) {
        self.trace.push(format!(
            "{} publish v{} leader {} le {} isr {:?}",
            self.now, meta.version, meta.leader, meta.leader_epoch, meta.isr
        ));
        self.meta = meta.clone();
        let targets: Vec<NodeId> = self.replicas.keys().copied().collect();
        for id in targets {
            let at = self.now + self.random_delay(self.faults.delay_ms);
            self.schedule(at, Event::Meta { node: id, meta: meta.clone() });
        }
    }

    /// Delivers the authoritative meta to `id` right away.
    pub fn deliver_meta_now(&mut self, id: NodeId) {
        let (now, meta) = (self.now, self.meta.clone());
        if let Some(machine) = self.replicas.get_mut(&id).and_then(|r| r.machine.as_mut()) {
            let _ = machine.handle_meta(now, meta);
        }
        self.drain(id);
    }

    /// Failover with evidence, as the controller runs it: first a durable fence that freezes replication
    /// (delivered to every reachable live ISR member before it reports), then evidence (last epoch, last
    /// seq) from at least |ISR| − MinISR + 1 of them, then the most advanced becomes leader under a new
    /// leader epoch with the fence lifted. `isr`/`min_isr` optionally replace the ISR (e.g. dropping a dead
    /// member). Returns the new leader, or `None` when the evidence is insufficient: the channel then stays
    /// fenced (fail closed) until a later failover succeeds.
    pub fn failover(&mut self, exclude: &[NodeId], isr: Option<Vec<NodeId>>, min_isr: Option<u8>) -> Option<NodeId> {
        let reporters: Vec<NodeId> = self
            .meta
            .isr
            .iter()
            .copied()
            .filter(|n| !exclude.contains(n) && self.replicas[n].machine.is_some())
            .collect();
        let needed = self.meta.isr.len() - usize::from(self.meta.min_isr) + 1;
        if !self.meta.replication_frozen() {
            let mut fenced = self.meta.clone();
            fenced.version += 1;
            fenced.write_fence =
                Some(WriteFence { task: fenced.version, since_version: fenced.version, freeze_replication: true });
            self.publish(fenced);
        }
        for id in &reporters {
            self.deliver_meta_now(*id);
        }
        let evidence: Vec<_> = reporters.iter().map(|n| self.machine(*n).evidence()).collect();
        if evidence.len() < needed {
            self.trace.push(format!("{} failover refused: {} of {needed} evidences", self.now, evidence.len()));
            return None;
        }
        let best = evidence.iter().max_by_key(|e| (e.last_epoch, e.last_seq, Reverse(e.node)))?;
        self.trace.push(format!(
            "{} evidence (min_isr {}): {:?}",
            self.now,
            self.meta.min_isr,
            evidence
                .iter()
                .map(|e| (e.node.get(), e.last_epoch.get(), e.last_seq.get(), e.hw.get()))
                .collect::<Vec<_>>()
        ));
        let mut next = self.meta.clone();
        next.version += 1;
        next.leader = best.node;
        next.leader_epoch = next.leader_epoch.next();
        next.write_fence = None;
        if let Some(isr) = isr {
            next.isr = isr;
            next.epoch = next.epoch.next();
        }
        if let Some(min_isr) = min_isr {
            next.min_isr = min_isr;
        }
        let leader = best.node;
        self.publish(next);
        Some(leader)
    }

    /// Runs until `deadline`, processing events and timers in time order.
    pub fn run_until(&mut self, deadline: Time) {
        while let Some(at) = self.next_time() {
            if at > deadline {
                break;
            }
            self.step_at(at);
        }
        self.now = self.now.max(deadline);
    }

    /// Runs in 1 ms steps until `done` holds; panics after `limit_ms`.
    pub fn run_until_cond(&mut self, limit_ms: u64, mut done: impl FnMut(&Cluster) -> bool) {
        for _ in 0..limit_ms {
            if done(self) {
                return;
            }
            self.run_for(1);
        }
        assert!(done(self), "condition not reached in {limit_ms} ms\n{}", self.trace.join("\n"));
    }

    /// Blocks both directions between `a` and each of `others`.
    pub fn isolate(&mut self, a: NodeId, others: &[NodeId]) {
        for b in others {
            self.blocked.insert((a, *b));
            self.blocked.insert((*b, a));
        }
    }

    /// Runs for `ms` milliseconds.
    pub fn run_for(&mut self, ms: u64) {
        let deadline = self.now + std::time::Duration::from_millis(ms);
        self.run_until(deadline);
    }

    fn next_time(&self) -> Option<Time> {
        let event = self.events.peek().map(|Reverse((at, _, _))| *at);
        let timer = self.replicas.values().filter_map(|r| r.machine.as_ref()?.poll_timeout()).min();
        [event, timer].into_iter().flatten().min()
    }

    fn step_at(&mut self, at: Time) {
        self.now = self.now.max(at);
        let event_due = self.events.peek().is_some_and(|Reverse((t, _, _))| *t <= self.now);
        if event_due {
            let Reverse((_, _, index)) = self.events.pop().unwrap();
            let event = self.event_bodies[index].take().unwrap();
            self.handle_event(event);
            return;
        }
        let due: Vec<NodeId> = self
            .replicas
            .iter()
            .filter(|(_, r)| r.machine.as_ref().and_then(|m| m.poll_timeout()).is_some_and(|t| t <= self.now))
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            let now = self.now;
            if let Some(machine) = self.replicas.get_mut(&id).and_then(|r| r.machine.as_mut()) {
                machine.handle_timeout(now);
            }
            self.drain(id);
        }
    }

    fn handle_event(&mut self, event: Event) {
        let now = self.now;
        match event {
            Event::Deliver { from, to, message } => {
                let Some(machine) = self.replicas.get_mut(&to).and_then(|r| r.machine.as_mut()) else { return };
                machine.handle_message(now, from, message);
                self.drain(to);
            }
            Event::Persisted { node, incarnation, token, batch } => {
                let replica = self.replicas.get_mut(&node).unwrap();
                if replica.incarnation != incarnation || replica.machine.is_none() {
                    return; // Crashed before the write became durable: it is lost.
                }
                let result = replica.log.commit(batch);
                replica.machine.as_mut().unwrap().handle_persisted(now, token, result);
                self.drain(node);
            }
            Event::Read { node, incarnation, token, from, through, max_bytes } => {
                let replica = self.replicas.get_mut(&node).unwrap();
                if replica.incarnation != incarnation || replica.machine.is_none() {
                    return;
                }
                let limits = ReadLimits { records_max: usize::MAX, bytes_max: max_bytes };
                let result = replica.log.read(&channel(), from, through, limits);
                replica.machine.as_mut().unwrap().handle_read(now, token, result);
                self.drain(node);
            }
            Event::Meta { node, meta } => {
                if self.meta_unheard.contains(&node) {
                    return;
                }
                if let Some(machine) = self.replicas.get_mut(&node).and_then(|r| r.machine.as_mut()) {
                    // Stale or repeated metas are refused by the machine; that is expected here.
                    let _ = machine.handle_meta(now, meta);
                }
                self.drain(node);
            }
        }
    }

    /// The durable records of `id`, from seq 1.
    pub fn durable_records(&self, id: NodeId) -> Vec<Record> {
        let limits = ReadLimits { records_max: usize::MAX, bytes_max: usize::MAX };
        self.replicas[&id].log.read(&channel(), Seq::new(1), Seq::new(u64::MAX), limits).unwrap()
    }

    /// Invariants checked after every step.
    pub fn check_invariants(&mut self) {
        let limits = ReadLimits { records_max: usize::MAX, bytes_max: usize::MAX };
        let ids: Vec<NodeId> = self.replicas.keys().copied().collect();
        for id in ids {
            let replica = self.replicas.get_mut(&id).unwrap();
            let Some(machine) = &replica.machine else { continue };
            let hw = machine.hw();
            assert!(
                hw >= replica.hw_seen,
                "HW went back on {id}: {hw} < {}\n{}",
                replica.hw_seen,
                self.trace.join("\n")
            );
            if hw > replica.hw_seen {
                let m = replica.machine.as_ref().unwrap();
                self.trace.push(format!(
                    "{} hw {id} -> {hw} (role {:?}, end {}, durable {}, le {:?})",
                    self.now,
                    m.role(),
                    m.log_end(),
                    m.durable_last(),
                    m.meta().map(|m| m.leader_epoch)
                ));
            }
            replica.hw_seen = hw;
            // Every replica agrees on every seq at or below its HW (what is durable of it so far).
            let records = replica.log.read(&channel(), Seq::new(1), hw, limits).unwrap();
            for record in records {
                match self.committed.get(&record.seq) {
                    Some(first) => assert_eq!(
                        first,
                        &record,
                        "replica {id} disagrees at committed seq {}\n{}",
                        record.seq,
                        self.trace.join("\n")
                    ),
                    None => {
                        self.committed.insert(record.seq, record);
                    }
                }
            }
        }
        // Leader completeness: the leader the meta in force names, once it leads under that meta, holds
        // every committed record durably (a leader elected without one would overwrite it).
        // A record committed on followers may not be durable on the leader yet: past its durable end it
        // must at least be in the leader's log.
        let leader = self.meta.leader;
        let leading = self.replicas.get(&leader).and_then(|r| r.machine.as_ref()).filter(|m| {
            m.role() == RoleKind::Leader && m.meta().is_some_and(|own| own.leader_epoch == self.meta.leader_epoch)
        });
        if let Some((durable_last, log_end)) = leading.map(|m| (m.durable_last(), m.log_end())) {
            let held = self.replicas[&leader].log.read(&channel(), Seq::new(1), durable_last, limits).unwrap();
            let retained = self
                .meta
                .retention_through
                .max(self.replicas[&leader].log.state(&channel()).map_or(Seq::new(0), |s| s.retention_through));
            for (seq, record) in self.committed.range(retained.next()..) {
                // `held` is in seq order.
                let held_here = if *seq <= durable_last {
                    held.binary_search_by_key(seq, |r| r.seq).is_ok_and(|i| held[i] == *record)
                } else {
                    *seq <= log_end
                };
                assert!(
                    held_here,
                    "leader {leader} lacks the record at committed seq {seq}\n{}",
                    self.trace.join("\n")
                );
            }
        }
        // Every acknowledged record is committed with its payload.
        for submitted in self.requests.values() {
            let Outcome::Acked(seqs) = &submitted.outcome else { continue };
            for (seq, payload) in seqs.iter().zip(&submitted.payloads) {
                if let Some(record) = self.committed.get(seq) {
                    assert_eq!(&record.payload, payload, "acked payload changed at {seq}\n{}", self.trace.join("\n"));
                }
            }
        }
    }

    /// After healing: every acknowledged record is at its seq on every live ISR replica, and all live ISR
    /// replicas hold the same log through the leader's HW.
    pub fn check_converged(&self) {
        let isr: Vec<NodeId> = self.meta.isr.iter().copied().filter(|n| self.is_up(*n)).collect();
        // Records given up (retention) are gone by design.
        let retained_after = self.meta.retention_through;
        for submitted in self.requests.values() {
            let Outcome::Acked(seqs) = &submitted.outcome else { continue };
            for (seq, payload) in seqs.iter().zip(&submitted.payloads).filter(|(seq, _)| **seq > retained_after) {
                for id in &isr {
                    let records = self.durable_records(*id);
                    let found = records.iter().find(|r| r.seq == *seq);
                    assert_eq!(
                        found.map(|r| &r.payload),
                        Some(payload),
                        "acked seq {seq} missing or changed on {id}\n{}",
                        self.trace.join("\n")
                    );
                }
            }
        }
        let leader_hw = self.machine(self.meta.leader).hw();
        let reference = self.durable_records(self.meta.leader);
        for id in &isr {
            let records = self.durable_records(*id);
            let upto = |rs: &[Record]| {
                rs.iter().filter(|r| r.seq > retained_after && r.seq <= leader_hw).cloned().collect::<Vec<_>>()
            };
            assert_eq!(upto(&records), upto(&reference), "{id} differs from the leader through HW {leader_hw}");
        }
        if !self.fanout_held {
            self.check_every_committed_message_handed_off();
        }
    }

    /// With fanout finishing at once, every committed message went to fanout at least once: on the
    /// leader that committed it, or on a successor that inherited it uncommitted.
    pub fn check_every_committed_message_handed_off(&self) {
        let handed: BTreeSet<Seq> = self.handed_off.iter().map(|(_, seq)| *seq).collect();
        for (seq, _) in self.committed_messages() {
            assert!(handed.contains(&seq), "committed message {seq} never went to fanout\n{}", self.trace.join("\n"));
        }
    }

    /// Messages (records that are not barriers) committed, in seq order.
    pub fn committed_messages(&self) -> Vec<(Seq, Bytes)> {
        self.committed.values().filter(|r| r.kind == RecordKind::Message).map(|r| (r.seq, r.payload.clone())).collect()
    }

    pub fn outcome(&self, id: RequestId) -> &Outcome {
        &self.requests[&id].outcome
    }
}
