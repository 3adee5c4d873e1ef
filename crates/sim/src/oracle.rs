//! The client-side oracle: every request and its answer, and the invariants over them.

use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet};
use tidings::node::{ApiId, ApiResult, NodeError};
use tidings::store::message::{IdempotencyKey, Record, RecordKind};
use tidings::types::{ChannelId, DetRng, NodeId, Seq};

/// The channel machine's default idempotency window, in seqs.
const IDEMPOTENCY_WINDOW: u64 = 1024;

enum Expect {
    Create(ChannelId),
    /// A metadata write of the setup, named.
    Setup(String),
    /// `append_from` by a sender the channel must refuse (banned, or on its deny list).
    RefusedSender {
        channel: ChannelId,
        sender: &'static str,
    },
    /// `floor`: for a fresh append (not a retry of a key seen before), the highest seq of the channel
    /// acknowledged before it was submitted — a linearizable log must place it above.
    Append {
        channel: ChannelId,
        payload: Bytes,
        key: Option<IdempotencyKey>,
        floor: Option<Seq>,
    },
    /// A retention move: give up the channel's records through `through`.
    Retain {
        channel: ChannelId,
        through: Seq,
    },
}

/// What a read asked for, and what the replica had at that instant.
#[derive(Clone, Copy, Debug)]
pub struct ReadAsked {
    /// First seq asked.
    pub from: Seq,
    /// Most records asked.
    pub limit: usize,
    /// The replica's HW at the read.
    pub hw: Seq,
    /// After a short page: the first message a read from just past the page found (a leader may know a
    /// HW beyond its own durable log when MinISR counts others first: a page stops there).
    pub next: Option<Seq>,
    /// The retention boundary in force on the replica at the read.
    pub retained_through: Seq,
}

/// Requests, answers and violations.
#[derive(Default)]
pub struct Oracle {
    expected: BTreeMap<ApiId, (NodeId, Expect)>,
    created: BTreeSet<ChannelId>,
    /// Acknowledged appends: channel → seq → payload.
    acked: BTreeMap<ChannelId, BTreeMap<Seq, Bytes>>,
    /// The seq an idempotency key was first acknowledged at.
    key_seq: BTreeMap<(ChannelId, IdempotencyKey), Seq>,
    /// Keyed appends to retry: channel, key, payload.
    keyed: Vec<(ChannelId, IdempotencyKey, Bytes)>,
    /// Every key submitted, acknowledged or not (a later request with one is a retry).
    submitted_keys: BTreeSet<(ChannelId, IdempotencyKey)>,
    /// Payloads sent with an idempotency key: a retry of one may legitimately commit again (its first
    /// copy given up, or out of the idempotency window). Every other payload is sent once.
    keyed_payloads: BTreeSet<Bytes>,
    /// Setup writes acknowledged.
    setup_done: BTreeSet<String>,
    /// The furthest retention boundary asked for per channel (answered or not: one that timed out may
    /// still come into force). Acknowledged records at or below it may be gone.
    retention_asked: BTreeMap<ChannelId, Seq>,
    /// The furthest boundary that may be in force per channel: answered in force, or aborted after
    /// admission (it may still come into force). Moves refused at admission never are; moves still
    /// unanswered at the end count too. The durable check excuses only records at or below it.
    retention_possible: BTreeMap<ChannelId, Seq>,
    violations: Vec<String>,
}

impl Oracle {
    pub fn expect_create(&mut self, api: ApiId, node: NodeId, channel: ChannelId) {
        self.expected.insert(api, (node, Expect::Create(channel)));
    }

    pub fn expect_append(
        &mut self,
        api: ApiId,
        node: NodeId,
        channel: ChannelId,
        payload: Bytes,
        key: Option<IdempotencyKey>,
    ) {
        let mut fresh = true;
        if let Some(key) = &key {
            self.keyed_payloads.insert(payload.clone());
            if !self.keyed.iter().any(|(c, k, _)| *c == channel && k == key) && self.keyed.len() < 1_000 {
                self.keyed.push((channel.clone(), key.clone(), payload.clone()));
            }
            fresh = self.submitted_keys.insert((channel.clone(), key.clone()));
        }
        let floor = fresh.then(|| self.acked.get(&channel).and_then(|a| a.keys().next_back().copied())).flatten();
        self.expected.insert(api, (node, Expect::Append { channel, payload, key, floor }));
    }

    /// A retention move through `through`: from now on, records of `channel` at or below it may be gone.
    pub fn expect_retention(&mut self, api: ApiId, node: NodeId, channel: ChannelId, through: Seq) {
        let asked = self.retention_asked.entry(channel.clone()).or_default();
        *asked = (*asked).max(through);
        self.expected.insert(api, (node, Expect::Retain { channel, through }));
    }

    /// The furthest retention boundary asked for on `channel` (0 before any).
    pub fn retained_through(&self, channel: &ChannelId) -> Seq {
        self.retention_asked.get(channel).copied().unwrap_or_default()
    }

    pub fn expect_setup(&mut self, api: ApiId, node: NodeId, label: String) {
        self.expected.insert(api, (node, Expect::Setup(label)));
    }

    pub fn setup_done(&self, label: &str) -> bool {
        self.setup_done.contains(label)
    }

    /// `append_from` by `sender`, whom `channel` must refuse: acknowledging it is a violation.
    pub fn expect_refused_sender(&mut self, api: ApiId, node: NodeId, channel: ChannelId, sender: &'static str) {
        self.expected.insert(api, (node, Expect::RefusedSender { channel, sender }));
    }

    pub fn pick_retry(&self, rng: &mut DetRng) -> Option<(ChannelId, IdempotencyKey, Bytes)> {
        rng.pick(&self.keyed).cloned()
    }

    pub fn created(&self) -> impl Iterator<Item = ChannelId> + '_ {
        self.created.iter().cloned()
    }

    pub fn violation(&mut self, what: String) {
        self.violations.push(what);
    }

    /// Requests in a crashed node die with it (a real client sees its connection drop).
    pub fn node_crashed(&mut self, node: NodeId) {
        let lost: Vec<ApiId> = self.expected.iter().filter(|(_, (n, _))| *n == node).map(|(api, _)| *api).collect();
        for api in lost {
            // Its caller never hears back; a retention move it carried may still come into force.
            if let Some((_, Expect::Retain { channel, through })) = self.expected.remove(&api) {
                let in_force = self.retention_possible.entry(channel).or_default();
                *in_force = (*in_force).max(through);
            }
        }
    }

    pub fn answered(&mut self, api: ApiId, result: ApiResult) {
        if std::env::var("SIM_DEBUG_RETAIN").is_ok() {
            if let Some((n, Expect::Retain { channel, through })) = self.expected.get(&api) {
                eprintln!("retain {api:?} via {n} {channel} through {through}: {result:?}");
            }
        }
        let Some((_, expect)) = self.expected.remove(&api) else { return };
        match (expect, result) {
            (Expect::Create(channel), ApiResult::Meta(Ok(()))) => {
                self.created.insert(channel);
            }
            (Expect::Create(channel), other) if std::env::var("SIM_DEBUG").is_ok() => {
                eprintln!("create {channel}: {other:?}");
            }
            (Expect::Setup(label), ApiResult::Meta(Ok(()))) => {
                self.setup_done.insert(label);
            }
            (Expect::Retain { channel, through }, ApiResult::Retained(result)) => {
                let possible = match result {
                    Ok(boundary) if boundary < through => {
                        self.violation(format!("{channel}: retention through {through} answered with {boundary}"));
                        boundary
                    }
                    Ok(boundary) => boundary,
                    Err(NodeError::Aborted(_)) => through,
                    // Refused at admission: nothing was proposed.
                    Err(_) => Seq::new(0),
                };
                let in_force = self.retention_possible.entry(channel).or_default();
                *in_force = (*in_force).max(possible);
            }
            (Expect::RefusedSender { channel, sender }, ApiResult::Appended(Ok(seqs))) => {
                self.violation(format!("{channel}: an append from {sender} was acknowledged at {seqs:?}"));
            }
            (Expect::Append { channel, payload, key, floor }, ApiResult::Appended(Ok(seqs))) => {
                self.append_acknowledged(api, channel, payload, key, floor, &seqs);
            }
            // Refusals and aborts are answers: the client may retry.
            _ => {}
        }
    }

    /// An append acknowledged at `seqs`: after any seq acknowledged before it was submitted (`floor`),
    /// one record per idempotency key within the window, one payload per seq.
    fn append_acknowledged(
        &mut self,
        api: ApiId,
        channel: ChannelId,
        payload: Bytes,
        key: Option<IdempotencyKey>,
        floor: Option<Seq>,
        seqs: &[Seq],
    ) {
        let Some(seq) = seqs.first().copied() else {
            self.violation(format!("{channel}: append acknowledged without a seq"));
            return;
        };
        if let Some(floor) = floor.filter(|floor| seq <= *floor) {
            self.violation(format!(
                "{channel}: append acknowledged at {seq}, but {floor} was acknowledged before it was submitted"
            ));
        }
        if let Some(key) = key {
            match self.key_seq.get(&(channel.clone(), key.clone())) {
                // Keys are remembered for the channel's last `IDEMPOTENCY_WINDOW` seqs; an older key
                // may legitimately append again.
                // A key whose record was given up (retention) may append again too: the earlier
                // of its two records, whichever was acknowledged first (the original append's
                // answer may come after its retry's, appended anew past a retention move that
                // gave the original up — sim seed 226004206).
                Some(first)
                    if *first != seq
                        && seq.get().abs_diff(first.get()) < IDEMPOTENCY_WINDOW
                        && (*first).min(seq) > self.retention_asked.get(&channel).copied().unwrap_or_default() =>
                {
                    self.violation(format!(
                        "{channel}: idempotent retry acknowledged at {seq}, first at {first} (two records)"
                    ))
                }
                Some(_) => {}
                None => {
                    self.key_seq.insert((channel.clone(), key), seq);
                }
            }
        }
        if std::env::var("SIM_DEBUG_CHANNEL").is_ok_and(|c| c == channel.to_string()) {
            eprintln!("ack {channel} {seq} {api:?} {payload:?}");
        }
        let acked = self.acked.entry(channel.clone()).or_default();
        match acked.get(&seq) {
            Some(other) if *other != payload => {
                if std::env::var("SIM_DEBUG").is_ok() {
                    eprintln!("conflict at {seq}: had {other:?}, now {payload:?} (api {api:?})");
                }
                self.violations.push(format!("{channel}: seq {seq} acknowledged for two payloads"));
            }
            _ => {
                acked.insert(seq, payload);
            }
        }
    }

    /// Records a read returned must match what was acknowledged at their seqs.
    pub fn check_read(&mut self, node: NodeId, channel: &ChannelId, read: &ReadAsked, records: &[Record]) {
        let mut problems = Vec::new();
        if records.len() > read.limit {
            problems.push(format!("{} records for a limit of {}", records.len(), read.limit));
        }
        if let Some(record) = records.iter().find(|r| r.kind != RecordKind::Message) {
            problems.push(format!("a {:?} record at {}", record.kind, record.seq));
        }
        if records.windows(2).any(|w| w[0].seq >= w[1].seq) {
            problems.push("seqs out of order".into());
        }
        if let Some(record) = records.iter().find(|r| r.seq <= read.retained_through) {
            problems.push(format!("seq {} given up (retention through {})", record.seq, read.retained_through));
        }
        if let Some(record) = records.iter().find(|r| r.seq < read.from || r.seq > read.hw) {
            problems.push(format!("seq {} outside [{}, HW {}]", record.seq, read.from, read.hw));
        }
        let acked = self.acked.get(channel);
        for record in records {
            if acked.and_then(|a| a.get(&record.seq)).is_some_and(|payload| *payload != record.payload) {
                problems.push(format!("seq {} differs from the acknowledged one", record.seq));
            }
        }
        if let (Some(first), Some(last), Some(acked)) = (records.first(), records.last(), acked) {
            // Everything acknowledged is committed, and the replica's log is contiguous up to its last
            // record read: a page has no holes. A replica that joined after a trim starts later: only what
            // follows the page's first record is checked.
            let returned: BTreeSet<Seq> = records.iter().map(|r| r.seq).collect();
            if let Some(missing) =
                acked.range(first.seq..=last.seq).map(|(seq, _)| *seq).find(|s| !returned.contains(s))
            {
                problems.push(format!("acknowledged seq {missing} missing inside the page"));
            }
        }
        // A page comes back short only where the replica has nothing more to read within its HW (barriers
        // are read past; sim payloads are far below the byte limit).
        if let Some(next) = read.next.filter(|next| *next <= read.hw) {
            if records.len() < read.limit {
                problems.push(format!("short page ({} of {}) while {next} was readable", records.len(), read.limit));
            }
        }
        for problem in problems {
            self.violations
                .push(format!("{node}: read of {channel} from {} (limit {}): {problem}", read.from, read.limit));
        }
    }

    /// The highest acknowledged seq of `channel` (0 before any).
    pub fn last_acked(&self, channel: &ChannelId) -> u64 {
        self.acked.get(channel).and_then(|a| a.keys().next_back()).map_or(0, |seq| seq.get())
    }

    /// Every acknowledged append is on some replica's durable log unchanged; replicas agree at every seq at
    /// or below both their HWs.
    /// Leader completeness (Raft's): the leader the newest meta names holds every message another
    /// replica holds at or below its HW — apart from what a retention move may have given up. Replicas
    /// agreeing below their HWs do not show it: a leader elected without committed records holds its own
    /// records at those seqs above its own HW, and the replicas holding the committed ones refuse to
    /// truncate them, so the channel only stops taking appends (sim seed 241005257).
    /// `in_memory_end`: the end of the leader's log in memory, when it is active (a record committed on
    /// followers may not be on the leader's disk yet).
    pub fn check_leader_complete(
        &mut self,
        channel: &ChannelId,
        leader: NodeId,
        in_memory_end: Option<Seq>,
        logs: &[(NodeId, Seq, Vec<Record>)],
    ) {
        let Some((_, _, leader_log)) = logs.iter().find(|(id, _, _)| *id == leader) else { return };
        let durable_end = leader_log.last().map_or(Seq::new(0), |r| r.seq);
        let on_its_way = |seq: Seq| seq > durable_end && in_memory_end.is_some_and(|end| seq <= end);
        let retained_through = self.retention_asked.get(channel).copied().unwrap_or_default();
        let held: BTreeMap<Seq, &Bytes> =
            leader_log.iter().filter(|r| r.kind == RecordKind::Message).map(|r| (r.seq, &r.payload)).collect();
        for (id, hw, log) in logs.iter().filter(|(id, _, _)| *id != leader) {
            let committed = log.iter().filter(|r| r.kind == RecordKind::Message && r.seq <= *hw);
            let lacking = |r: &&Record| held.get(&r.seq) != Some(&&r.payload) && !on_its_way(r.seq);
            if let Some(missing) = committed.filter(|r| r.seq > retained_through).find(lacking) {
                self.violations.push(format!(
                    "{channel}: leader {leader} lacks the message {id} holds committed at {} (HW {hw})",
                    missing.seq
                ));
            }
        }
    }

    pub fn check_durable(&mut self, channel: &ChannelId, logs: &[(NodeId, Seq, Vec<Record>)]) {
        let messages = |records: &[Record]| -> BTreeMap<Seq, Bytes> {
            records.iter().filter(|r| r.kind == RecordKind::Message).map(|r| (r.seq, r.payload.clone())).collect()
        };
        let held: Vec<(NodeId, Seq, BTreeMap<Seq, Bytes>)> =
            logs.iter().map(|(id, hw, records)| (*id, *hw, messages(records))).collect();
        let unanswered = self.expected.values().filter_map(|(_, e)| match e {
            Expect::Retain { channel: c, through } if c == channel => Some(*through),
            _ => None,
        });
        let retained_through =
            unanswered.chain(self.retention_possible.get(channel).copied()).max().unwrap_or_default();
        for (seq, payload) in self.acked.get(channel).into_iter().flatten().filter(|(seq, _)| **seq > retained_through)
        {
            if !held.iter().any(|(_, _, log)| log.get(seq) == Some(payload)) {
                self.violations.push(format!("{channel}: acknowledged seq {seq} lost or changed on every replica"));
            }
        }
        // A message sent once (no key) is committed once: a forward delivered twice must not append twice.
        for (node, hw, log) in &held {
            let mut first_at: BTreeMap<&Bytes, Seq> = BTreeMap::new();
            for (seq, payload) in log.range(..=*hw) {
                if let Some(first) = first_at.insert(payload, *seq) {
                    if !self.keyed_payloads.contains(payload) {
                        self.violations.push(format!(
                            "{channel}: a message sent once is committed twice on {node}, at {first} and {seq}"
                        ));
                    }
                }
            }
        }
        for (i, (a, hw_a, log_a)) in held.iter().enumerate() {
            for (b, hw_b, log_b) in &held[i + 1..] {
                let through = (*hw_a).min(*hw_b);
                for (seq, payload) in log_a.range(..=through) {
                    if log_b.get(seq).is_some_and(|other| other != payload) {
                        self.violations.push(format!("{channel}: {a} and {b} differ at {seq} below HW {through}"));
                    }
                }
            }
        }
    }

    /// Every request was answered (an append commits, fails or times out; none waits forever).
    pub fn check_answered(&mut self) {
        let unanswered: Vec<String> = self
            .expected
            .values()
            .map(|(_, e)| match e {
                Expect::Append { channel, .. }
                | Expect::Create(channel)
                | Expect::RefusedSender { channel, .. }
                | Expect::Retain { channel, .. } => channel.to_string(),
                Expect::Setup(label) => label.clone(),
            })
            .collect();
        if std::env::var("SIM_DEBUG").is_ok() {
            for (api, (node, e)) in &self.expected {
                if let Expect::Append { channel, payload, key, .. } = e {
                    eprintln!("unanswered {api:?} on {node}: {channel} {payload:?} key {key:?}");
                }
            }
        }
        if !unanswered.is_empty() {
            self.violations.push(format!(
                "liveness: {} requests never answered ({:?}...)",
                unanswered.len(),
                unanswered.first()
            ));
        }
    }

    pub fn acked_count(&self) -> usize {
        self.acked.values().map(BTreeMap::len).sum()
    }

    pub fn unanswered(&self) -> usize {
        self.expected.len()
    }

    pub fn into_violations(self) -> Vec<String> {
        self.violations
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidings::types::{ChannelType, LeaderEpoch};

    fn message(seq: u64, epoch: u64, payload: &'static str) -> Record {
        Record::message(Seq::new(seq), LeaderEpoch::new(epoch), payload)
    }

    #[test]
    fn a_leader_without_a_message_another_replica_holds_committed_is_reported_and_one_with_it_is_not() {
        let channel = ChannelId::new(ChannelType::GROUP, "c").expect("channel id");
        let (leader, follower) = (NodeId::new(4), NodeId::new(1));
        let committed = vec![message(1, 1, "a"), message(2, 1, "b")];
        // The follower's HW covers seq 2; the leader holds its own record there, above its HW of 1.
        let incomplete = [
            (leader, Seq::new(1), vec![message(1, 1, "a"), message(2, 2, "x")]),
            (follower, Seq::new(2), committed.clone()),
        ];
        let mut oracle = Oracle::default();
        oracle.check_leader_complete(&channel, leader, None, &incomplete);
        let violations = oracle.into_violations();
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(violations[0].contains("lacks the message n1 holds committed at #2"), "{violations:?}");
        // A follower's uncommitted tail (above its HW) the leader does not hold is no violation.
        let complete = [
            (leader, Seq::new(2), committed.clone()),
            (follower, Seq::new(2), {
                let mut log = committed.clone();
                log.push(message(3, 1, "tail"));
                log
            }),
        ];
        let mut oracle = Oracle::default();
        oracle.check_leader_complete(&channel, leader, None, &complete);
        assert!(oracle.into_violations().is_empty());
        // A record committed on the follower and not yet on the leader's disk is on its way there.
        let on_its_way = [(leader, Seq::new(1), vec![message(1, 1, "a")]), (follower, Seq::new(2), committed.clone())];
        let mut oracle = Oracle::default();
        oracle.check_leader_complete(&channel, leader, Some(Seq::new(2)), &on_its_way);
        assert!(oracle.into_violations().is_empty());
    }
}
