//! A single machine driven by hand: meta validation, stale completions, storage failure, retention,
//! drain and evidence.

use bytes::Bytes;
use tidings_channel::machine::{
    AppendAborted, AppendError, AppendRecord, AppendRequest, ApplyMetaError, ChannelMachine, ChannelMessage, Effect,
    MachineConfig, PullRequest, RequestId, RoleKind,
};
use tidings_store::message::{ChannelLogState, LogLimits, LogOp, MemoryLog, MessageLog};
use tidings_store::StoreError;
use tidings_types::{ChannelId, ChannelRuntimeMeta, ChannelType, Epoch, LeaderEpoch, MetaError, NodeId, Seq, Time};

fn channel() -> ChannelId {
    ChannelId::new(ChannelType::GROUP, "unit").unwrap()
}

fn meta(leader: u64, leader_epoch: u64, version: u64) -> ChannelRuntimeMeta {
    ChannelRuntimeMeta {
        channel: channel(),
        version,
        leader: NodeId::new(leader),
        replicas: vec![NodeId::new(1), NodeId::new(2)],
        isr: vec![NodeId::new(1), NodeId::new(2)],
        min_isr: 1,
        epoch: Epoch::new(1),
        leader_epoch: LeaderEpoch::new(leader_epoch),
        write_fence: None,
        retention_through: Seq::new(0),
    }
}

fn t(ms: u64) -> Time {
    Time::from_millis(ms)
}

fn machine() -> ChannelMachine {
    empty_replica(1)
}

/// Node `me`'s replica over an empty log, default config, created at 0.
fn empty_replica(me: u64) -> ChannelMachine {
    ChannelMachine::new(
        channel(),
        NodeId::new(me),
        MachineConfig::default(),
        1,
        t(0),
        ChannelLogState::default(),
        vec![],
    )
}

/// Carries out persists against `log` until none is left; returns every other effect.
fn settle(machine: &mut ChannelMachine, log: &MemoryLog, now: Time) -> Vec<Effect> {
    let mut others = Vec::new();
    while let Some(effect) = machine.poll_effect() {
        match effect {
            Effect::Persist { token, batch } => {
                let result = log.commit(batch);
                machine.handle_persisted(now, token, result);
            }
            other => others.push(other),
        }
    }
    others
}

/// A pull (id 1, no byte limit to speak of) from a replica under `leader_epoch` (and membership epoch 1),
/// asking from `next_seq` with `last_epoch` as the epoch of its last record.
fn pull(leader_epoch: u64, next_seq: u64, last_epoch: u64) -> ChannelMessage {
    pull_under(leader_epoch, 1, next_seq, last_epoch)
}

/// [`pull`] made under a meta of membership epoch `epoch`.
fn pull_under(leader_epoch: u64, epoch: u64, next_seq: u64, last_epoch: u64) -> ChannelMessage {
    ChannelMessage::Pull(PullRequest {
        channel: channel(),
        pull_id: 1,
        leader_epoch: LeaderEpoch::new(leader_epoch),
        epoch: Epoch::new(epoch),
        next_seq: Seq::new(next_seq),
        last_epoch: LeaderEpoch::new(last_epoch),
        max_bytes: 1 << 20,
    })
}

fn request(id: u64, payloads: &[&str]) -> AppendRequest {
    AppendRequest {
        id: RequestId(id),
        records: payloads
            .iter()
            .map(|p| AppendRecord { idempotency_key: None, payload: Bytes::from(p.to_string()) })
            .collect(),
    }
}

#[test]
fn invalid_or_older_meta_is_refused_and_changes_nothing() {
    let mut m = machine();
    assert!(matches!(m.handle_append(t(1), request(1, &["x"])), Err(AppendError::NotReady)));
    m.handle_meta(t(1), meta(1, 2, 5)).unwrap();
    let generation = m.generation();
    assert_eq!(
        m.handle_meta(t(2), meta(1, 2, 5)),
        Err(ApplyMetaError::Invalid(MetaError::StaleVersion { offered: 5, current: 5 }))
    );
    assert!(matches!(
        m.handle_meta(t(2), meta(2, 1, 6)),
        Err(ApplyMetaError::Invalid(MetaError::EpochRegression { .. }))
    ));
    assert!(matches!(
        m.handle_meta(t(2), meta(2, 2, 6)),
        Err(ApplyMetaError::Invalid(MetaError::LeaderChangeWithoutEpoch { .. }))
    ));
    let mut bad = meta(1, 3, 6);
    bad.min_isr = 3;
    assert!(matches!(m.handle_meta(t(2), bad), Err(ApplyMetaError::Invalid(MetaError::BadSizes { .. }))));
    let mut other = meta(1, 3, 6);
    other.channel = ChannelId::new(ChannelType::PERSON, "unit").unwrap();
    assert_eq!(m.handle_meta(t(2), other), Err(ApplyMetaError::Invalid(MetaError::WrongChannel)));
    assert_eq!(m.generation(), generation);
    assert_eq!(m.meta().unwrap().version, 5);
    assert_eq!(m.role(), RoleKind::Leader);
}

#[test]
fn stale_persist_completions_are_ignored() {
    let mut m = machine();
    m.handle_meta(t(1), meta(1, 1, 1)).unwrap();
    let persist = std::iter::from_fn(|| m.poll_effect()).find(|e| matches!(e, Effect::Persist { .. }));
    let Some(Effect::Persist { token, batch }) = persist else { panic!("barrier persist expected") };
    let mut stale = token;
    stale.id += 7;
    m.handle_persisted(t(2), stale, Ok(()));
    assert_eq!(m.durable_last(), Seq::new(0), "a completion that is not in flight changes nothing");
    let mut old_incarnation = token;
    old_incarnation.incarnation = 0;
    m.handle_persisted(t(2), old_incarnation, Ok(()));
    assert_eq!(m.durable_last(), Seq::new(0));
    let log = MemoryLog::new(LogLimits::default());
    log.commit(batch).unwrap();
    m.handle_persisted(t(3), token, Ok(()));
    assert_eq!(m.durable_last(), Seq::new(1));
}

#[test]
fn leader_storage_failure_aborts_pending_appends_and_stops_leading() {
    let mut m = machine();
    let log = MemoryLog::new(LogLimits::default());
    m.handle_meta(t(1), meta(1, 1, 1)).unwrap();
    // Node 2 pulls once so admission sees two live ISR members.
    m.handle_message(t(1), NodeId::new(2), pull(1, 1, 0));
    settle(&mut m, &log, t(1));
    m.handle_append(t(2), request(9, &["a"])).unwrap();
    let persist = std::iter::from_fn(|| m.poll_effect()).find(|e| matches!(e, Effect::Persist { .. }));
    let Some(Effect::Persist { token, .. }) = persist else { panic!("persist expected") };
    m.handle_persisted(t(3), token, Err(StoreError::io("test", std::io::Error::other("disk gone"))));
    let effects: Vec<Effect> = std::iter::from_fn(|| m.poll_effect()).collect();
    assert!(effects.contains(&Effect::AppendDone { id: RequestId(9), result: Err(AppendAborted::StorageFailed) }));
    assert!(effects.contains(&Effect::StorageFailed));
    assert_eq!(m.handle_append(t(4), request(10, &["b"])), Err(AppendError::StorageFailed));
}

#[test]
fn drain_and_evidence_report_the_durable_log() {
    let mut m = machine();
    let log = MemoryLog::new(LogLimits::default());
    let mut single = meta(1, 1, 1);
    single.replicas = vec![NodeId::new(1)];
    single.isr = vec![NodeId::new(1)];
    m.handle_meta(t(1), single).unwrap();
    settle(&mut m, &log, t(1));
    m.handle_append(t(2), request(1, &["a", "b"])).unwrap();
    assert!(!m.drain_status().drained);
    let effects = settle(&mut m, &log, t(3));
    assert!(effects.iter().any(|e| matches!(e, Effect::AppendDone { id: RequestId(1), result: Ok(_) })));
    let drain = m.drain_status();
    assert!(drain.drained, "{drain:?}");
    assert_eq!(drain.hw, Seq::new(3));
    let evidence = m.evidence();
    assert_eq!((evidence.last_epoch, evidence.last_seq), (LeaderEpoch::new(1), Seq::new(3)));
}

#[test]
fn retention_moves_only_within_hw_and_reads_start_after_it() {
    let mut m = machine();
    let log = MemoryLog::new(LogLimits::default());
    let mut single = meta(1, 1, 1);
    single.replicas = vec![NodeId::new(1)];
    single.isr = vec![NodeId::new(1)];
    m.handle_meta(t(1), single.clone()).unwrap();
    settle(&mut m, &log, t(1));
    m.handle_append(t(2), request(1, &["a", "b", "c"])).unwrap();
    settle(&mut m, &log, t(2));
    // Retention far beyond HW: the log moves only to HW.
    let mut retained = single;
    retained.version += 1;
    retained.retention_through = Seq::new(100);
    m.handle_meta(t(3), retained).unwrap();
    settle(&mut m, &log, t(3));
    m.handle_timeout(t(2_000));
    settle(&mut m, &log, t(2_000));
    let state = log.state(&channel()).unwrap();
    assert_eq!(state.retention_through, m.hw());
    assert!(state.retention_through <= state.hw);
    let limits = tidings_store::message::ReadLimits { records_max: 10, bytes_max: 1 << 20 };
    assert!(log.read(&channel(), Seq::new(1), Seq::new(10), limits).unwrap().is_empty());
}

#[test]
fn pulls_from_nodes_outside_the_replica_set_are_ignored() {
    let mut m = machine();
    let log = MemoryLog::new(LogLimits::default());
    m.handle_meta(t(1), meta(1, 1, 1)).unwrap();
    settle(&mut m, &log, t(1));
    m.handle_message(t(2), NodeId::new(42), pull(1, 1, 0));
    assert!(settle(&mut m, &log, t(2)).is_empty());
}

/// The pulls a settled machine sent.
fn pulls(effects: &[Effect]) -> Vec<u64> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Send { message: ChannelMessage::Pull(pull), .. } => Some(pull.pull_id),
            _ => None,
        })
        .collect()
}

/// A follower's first pull can be lost (its leader's replica was not active yet and dropped it). The
/// leader's hint then brings a new pull at once, not after the pull timeout: first appends to a fresh
/// channel waited the whole 2 s before.
#[test]
fn a_hint_from_the_leader_replaces_a_pull_that_was_lost() {
    let mut m = machine();
    let log = MemoryLog::new(LogLimits::default());
    m.handle_meta(t(1), meta(2, 1, 1)).unwrap();
    let first = pulls(&settle(&mut m, &log, t(1)));
    assert_eq!(first.len(), 1, "a new follower pulls at once");
    // No answer; the leader hints a moment later (well before the pull timeout).
    let hint = tidings_channel::machine::PullHint { channel: channel(), leader_epoch: LeaderEpoch::new(1) };
    m.handle_message(t(50), NodeId::new(2), ChannelMessage::Hint(hint.clone()));
    let second = pulls(&settle(&mut m, &log, t(50)));
    assert_eq!(second.len(), 1, "the hint brings a new pull");
    assert_ne!(second[0], first[0], "under a new id (a late answer to the old one is ignored)");
    // A hint from a node that is not the leader changes nothing.
    m.handle_message(t(60), NodeId::new(3), ChannelMessage::Hint(hint));
    assert!(pulls(&settle(&mut m, &log, t(60))).is_empty());
}

/// The hints a settled machine sent to `to`.
fn hints_to(effects: &[Effect], to: u64) -> usize {
    let to = NodeId::new(to);
    effects
        .iter()
        .filter(|e| matches!(e, Effect::Send { to: peer, message: ChannelMessage::Hint(_) } if *peer == to))
        .count()
}

/// A leader's start hints its followers, so that idle or evicted ones pull at once. A pull from one that
/// comes before the hint went out is what the hint asks for: the hint is dropped, since it would only
/// make the follower give that pull up and send another. (A leadership resumed for its followers' pulls
/// hinted them all the same; two such leaders sharing one leader's place then evicted each other at
/// once, for ever, each start's hints bringing the pulls that activated it again.)
#[test]
fn a_hint_still_queued_is_dropped_once_its_follower_pulls() {
    let log = MemoryLog::new(LogLimits::default());
    let mut started = machine();
    started.handle_meta(t(1), meta(1, 1, 1)).unwrap();
    assert_eq!(hints_to(&settle(&mut started, &log, t(1)), 2), 1, "a leader's start hints its follower");

    let log = MemoryLog::new(LogLimits::default());
    let mut pulled = machine();
    pulled.handle_meta(t(1), meta(1, 1, 1)).unwrap();
    pulled.handle_message(t(1), NodeId::new(2), pull(1, 1, 0));
    let effects = settle(&mut pulled, &log, t(1));
    assert_eq!(hints_to(&effects, 2), 0, "the follower's pull came first: no hint");
    // The pull itself stands: once the barrier is durable it is answered with it.
    let answered = effects.iter().any(|e| {
        matches!(e, Effect::Send { to, message: ChannelMessage::PullResponse(response) } if *to == NodeId::new(2) && response.pull_id == 1)
    });
    assert!(answered, "the pull is answered: {effects:?}");
}

/// A leader that missed its successor's meta (cut off, or drained out of the channel with no slot
/// replica of its own to tell it) keeps hinting the ISR members that no longer pull from it. Each answers
/// with the epoch in force, which sends the stale leader for the meta: without the answer such a leader
/// held its node's place for an active channel for good (sim seed 265002888).
#[test]
fn a_hint_of_an_older_epoch_is_answered_with_the_epoch_in_force_and_its_sender_refreshes_its_meta() {
    use tidings_channel::machine::PullHint;
    let log = MemoryLog::new(LogLimits::default());
    // Node 1 follows node 2 at leader epoch 3.
    let mut current = machine();
    current.handle_meta(t(1), meta(2, 3, 3)).unwrap();
    settle(&mut current, &log, t(1));
    let stale = PullHint { channel: channel(), leader_epoch: LeaderEpoch::new(1) };
    current.handle_message(t(10), NodeId::new(3), ChannelMessage::Hint(stale));
    let answers: Vec<Effect> = settle(&mut current, &log, t(10));
    let answer = match answers.as_slice() {
        [Effect::Send { to, message: ChannelMessage::Hint(hint) }] if *to == NodeId::new(3) => hint.clone(),
        other => panic!("expected one hint back to the stale sender, got {other:?}"),
    };
    assert_eq!(answer.leader_epoch, LeaderEpoch::new(3));
    // A hint of the epoch in force from a node that is not the leader gets no answer: two replicas
    // never answer each other's hints back and forth.
    let same = PullHint { channel: channel(), leader_epoch: LeaderEpoch::new(3) };
    current.handle_message(t(20), NodeId::new(3), ChannelMessage::Hint(same));
    assert!(settle(&mut current, &log, t(20)).is_empty());
    // The stale leader (node 1 of another log, leading at epoch 1) takes the answer and asks for the meta.
    let stale_log = MemoryLog::new(LogLimits::default());
    let mut leader = machine();
    leader.handle_meta(t(1), meta(1, 1, 1)).unwrap();
    settle(&mut leader, &stale_log, t(1));
    leader.handle_message(t(30), NodeId::new(2), ChannelMessage::Hint(answer));
    let effects = settle(&mut leader, &stale_log, t(30));
    assert!(effects.iter().any(|e| matches!(e, Effect::RefreshMeta)), "{effects:?}");
    assert_eq!(leader.role(), RoleKind::Leader, "a hint carries no authority: the meta decides");
}

/// A leader whose records wait to commit hints its silent followers every pull timeout; once they
/// have waited two, it also asks for the meta in force (once per wake-up): the replicas it hints may no
/// longer run the channel, removed from it by a successor whose meta this leader missed, and so never
/// tell it of the newer epoch.
#[test]
fn a_leader_whose_records_wait_two_pull_timeouts_asks_for_the_meta_in_force() {
    let log = MemoryLog::new(LogLimits::default());
    let mut m = machine();
    let needs_both = ChannelRuntimeMeta { min_isr: 2, ..meta(1, 1, 1) };
    m.handle_meta(t(1), needs_both).unwrap();
    settle(&mut m, &log, t(1));
    m.handle_append(t(10), request(1, &["waits"])).unwrap();
    settle(&mut m, &log, t(10));
    assert!(m.hw() < m.log_end(), "node 2 never pulls: nothing commits");
    let pull_timeout = u64::try_from(MachineConfig::default().pull_timeout.as_millis()).unwrap();
    let mut refreshes = Vec::new();
    let mut hints = Vec::new();
    while let Some(at) = m.poll_timeout().filter(|at| at.as_millis() <= 4 * pull_timeout) {
        m.handle_timeout(at);
        for effect in settle(&mut m, &log, at) {
            match effect {
                Effect::RefreshMeta => refreshes.push(at.as_millis()),
                Effect::Send { message: ChannelMessage::Hint(_), .. } => hints.push(at.as_millis()),
                _ => {}
            }
        }
    }
    assert!(!hints.is_empty() && hints[0] < 2 * pull_timeout, "hints first: {hints:?}");
    assert!(!refreshes.is_empty(), "no meta asked for in {}ms of waiting", 4 * pull_timeout);
    assert!(refreshes.iter().all(|at| *at >= 2 * pull_timeout), "asked too soon: {refreshes:?}");
    assert!(refreshes.iter().all(|at| hints.contains(at)), "only with a wake-up: {refreshes:?} {hints:?}");
}

/// A hint replaces the pull out with a new one, but the replaced pull may not be lost: it may be what
/// woke the hinting leader (activated by it, the new incarnation hints every replica). Its answer is
/// still taken while the pull out asks from the same seq; an answer to a pull replaced before the last
/// answer taken is not. Without that, two learners whose pulls each woke a leader evicted for room
/// between them dropped every answer (sim seed 279006691).
#[test]
fn the_answer_to_a_pull_a_hint_replaced_is_still_taken_while_it_fits() {
    use tidings_channel::machine::{PullBody, PullHint, PullResponse};
    use tidings_store::message::Record;
    let log = MemoryLog::new(LogLimits::default());
    let mut m =
        ChannelMachine::new(channel(), NodeId::new(2), MachineConfig::default(), 1, t(0), Default::default(), vec![]);
    m.handle_meta(t(1), meta(1, 1, 1)).unwrap();
    let first = pulls(&settle(&mut m, &log, t(1)));
    let hint = PullHint { channel: channel(), leader_epoch: LeaderEpoch::new(1) };
    m.handle_message(t(2), NodeId::new(1), ChannelMessage::Hint(hint.clone()));
    let second = pulls(&settle(&mut m, &log, t(2)));
    assert_eq!((first.len(), second.len()), (1, 1));
    let answer = |pull_id: u64, seq: u64| {
        let record = Record::message(Seq::new(seq), LeaderEpoch::new(1), Bytes::from_static(b"m"));
        ChannelMessage::PullResponse(PullResponse {
            channel: channel(),
            pull_id,
            leader_epoch: LeaderEpoch::new(1),
            body: PullBody::Records { records: vec![record], hw: Seq::new(0), fanned_through: Seq::new(0) },
        })
    };
    // The answer to the replaced pull comes first: taken.
    m.handle_message(t(3), NodeId::new(1), answer(first[0], 1));
    let third = pulls(&settle(&mut m, &log, t(3)));
    assert_eq!(m.log_end(), Seq::new(1), "the replaced pull's answer is taken");
    assert_eq!(third.len(), 1, "and the next pull goes out");
    // The answer to the pull that replaced it comes late: ignored, as is a second copy of the first.
    m.handle_message(t(4), NodeId::new(1), answer(second[0], 1));
    m.handle_message(t(4), NodeId::new(1), answer(first[0], 1));
    settle(&mut m, &log, t(4));
    assert_eq!(m.log_end(), Seq::new(1));
    // A hint now, then an answer to a pull replaced before the last answer taken: ignored.
    m.handle_message(t(5), NodeId::new(1), ChannelMessage::Hint(hint));
    settle(&mut m, &log, t(5));
    m.handle_message(t(6), NodeId::new(1), answer(second[0], 2));
    settle(&mut m, &log, t(6));
    assert_eq!(m.log_end(), Seq::new(1), "an answer to a pull replaced earlier is stale");
    // The replaced pull (the third) is still welcome.
    m.handle_message(t(7), NodeId::new(1), answer(third[0], 2));
    settle(&mut m, &log, t(7));
    assert_eq!(m.log_end(), Seq::new(2));
}

/// Three records durable, HW checkpointed at 1: the store of a replica rebuilt after a storage failure,
/// whose previous incarnation knew seq 3 committed.
fn log_with_hw_checkpoint_behind() -> MemoryLog {
    use tidings_store::message::{LogBatch, LogOp, Record, RecordKind};
    let log = MemoryLog::new(LogLimits::default());
    let records = (1..=3)
        .map(|seq| Record {
            seq: Seq::new(seq),
            kind: RecordKind::Message,
            leader_epoch: LeaderEpoch::new(1),
            idempotency_key: None,
            timestamp_ms: 0,
            payload: Bytes::from_static(b"m"),
        })
        .collect();
    let ops = vec![LogOp::Append(records), LogOp::CheckpointHw(Seq::new(1))];
    log.commit(LogBatch::new(channel(), ops)).unwrap();
    log
}

/// A leader's late answer to a pull of an earlier machine of this replica (evicted and loaded again, or
/// its node restarted; the answer waited in the network or a host's transport) is not taken for the
/// answer to this machine's pull. Pull ids once started at 1 in every machine and every term as
/// follower, so the first pulls of two incarnations shared an id: a divergence answer about the log as
/// it was then cut the records through 3, acknowledged since, which an evidence quorum counts on.
#[test]
fn a_late_answer_to_a_pull_of_an_earlier_incarnation_is_ignored() {
    use tidings_channel::machine::{PullBody, PullResponse};
    let log = log_with_hw_checkpoint_behind();
    let state = log.state(&channel()).unwrap();
    let first_pull = |incarnation: u64| {
        let mut m = ChannelMachine::new(
            channel(),
            NodeId::new(2),
            MachineConfig::default(),
            incarnation,
            t(0),
            state.clone(),
            vec![],
        );
        m.handle_meta(t(1), meta(1, 1, 1)).unwrap();
        let sent = pulls(&settle(&mut m, &log, t(1)));
        assert_eq!(sent.len(), 1, "a follower pulls at once");
        (m, sent[0])
    };
    let (_earlier, late_id) = first_pull(1);
    let (mut m, id) = first_pull(2);
    assert_ne!(late_id, id, "two incarnations' pulls share no id");
    // The leader's log holds epoch 1 only through `end`: cut the rest.
    let diverging = |pull_id: u64, end: u64| {
        ChannelMessage::PullResponse(PullResponse {
            channel: channel(),
            pull_id,
            leader_epoch: LeaderEpoch::new(1),
            body: PullBody::Diverging { epoch: LeaderEpoch::new(1), end_seq: Seq::new(end) },
        })
    };
    m.handle_message(t(2), NodeId::new(1), diverging(late_id, 1));
    settle(&mut m, &log, t(2));
    assert_eq!(m.log_end(), Seq::new(3), "nothing cut");
    assert_eq!(log.state(&channel()).unwrap().last_seq, Seq::new(3));
    // The answer to this machine's own pull is taken.
    m.handle_message(t(3), NodeId::new(1), diverging(id, 2));
    settle(&mut m, &log, t(3));
    assert_eq!(m.log_end(), Seq::new(2), "its own answer is followed");
}

/// A follower's pulls keep distinct ids across its terms as follower within one machine: removed from
/// the replicas and added back under the same leader and leader epoch, it starts a new term, whose
/// pulls must not match a late answer to the previous term's.
#[test]
fn pull_ids_run_on_across_terms_as_follower() {
    let log = log_with_hw_checkpoint_behind();
    let state = log.state(&channel()).unwrap();
    let mut m = ChannelMachine::new(channel(), NodeId::new(2), MachineConfig::default(), 1, t(0), state, vec![]);
    m.handle_meta(t(1), meta(1, 1, 1)).unwrap();
    let first = pulls(&settle(&mut m, &log, t(1)));
    let mut removed = meta(1, 1, 2);
    removed.replicas = vec![NodeId::new(1), NodeId::new(3)];
    removed.isr = vec![NodeId::new(1), NodeId::new(3)];
    removed.epoch = Epoch::new(2);
    m.handle_meta(t(2), removed.clone()).unwrap();
    settle(&mut m, &log, t(2));
    let mut back = meta(1, 1, 3);
    back.replicas = vec![NodeId::new(1), NodeId::new(3), NodeId::new(2)];
    back.isr = vec![NodeId::new(1), NodeId::new(3)];
    back.epoch = Epoch::new(3);
    m.handle_meta(t(3), back).unwrap();
    let second = pulls(&settle(&mut m, &log, t(3)));
    assert_eq!((first.len(), second.len()), (1, 1), "{first:?} {second:?}");
    assert_ne!(first[0], second[0]);
}

/// A follower away while a retention move passed its log end holds records the leader no longer has:
/// the leader answers its pull with `StartAfter`. Every record it holds is at or below the boundary, so
/// it gives them all up (the ones past its checkpointed HW truncated, the rest as a retention move) and
/// restarts its log after the boundary. Before, only an empty replica restarted: this one pulled the
/// same answer for good, and a replacement waiting for it timed out again and again (sim seed 269000187).
#[test]
fn a_follower_behind_the_leaders_retention_boundary_gives_up_what_it_holds_and_starts_after_it() {
    use tidings_channel::machine::{PullBody, PullResponse};
    let log = log_with_hw_checkpoint_behind(); // records 1..=3, HW checkpointed at 1
    let state = log.state(&channel()).unwrap();
    let mut m = ChannelMachine::new(channel(), NodeId::new(2), MachineConfig::default(), 1, t(0), state, vec![]);
    m.handle_meta(t(1), meta(1, 1, 1)).unwrap();
    let first = pulls(&settle(&mut m, &log, t(1)));
    assert_eq!(first.len(), 1);
    let start_after = |pull_id: u64, seq: u64| {
        ChannelMessage::PullResponse(PullResponse {
            channel: channel(),
            pull_id,
            leader_epoch: LeaderEpoch::new(1),
            body: PullBody::StartAfter { seq: Seq::new(seq), epoch: LeaderEpoch::new(1), hw: Seq::new(9) },
        })
    };
    m.handle_message(t(2), NodeId::new(1), start_after(first[0], 6));
    let effects = settle(&mut m, &log, t(2));
    let stored = log.state(&channel()).unwrap();
    assert_eq!((stored.last_seq, stored.retention_through, stored.hw), (Seq::new(6), Seq::new(6), Seq::new(6)));
    let readable = log.read(
        &channel(),
        Seq::new(1),
        Seq::new(u64::MAX),
        tidings_store::message::ReadLimits { records_max: usize::MAX, bytes_max: usize::MAX },
    );
    assert!(readable.unwrap().is_empty(), "the records at or below the boundary are given up");
    assert_eq!((m.log_end(), m.durable_last()), (Seq::new(6), Seq::new(6)));
    // It pulls on from after the boundary.
    let next: Vec<Seq> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Send { message: ChannelMessage::Pull(pull), .. } => Some(pull.next_seq),
            _ => None,
        })
        .collect();
    assert_eq!(next, vec![Seq::new(7)], "{effects:?}");
    // A log holding records past a boundary was not asking from before it: such an answer is stale and
    // changes nothing (the follower asks for the meta instead).
    let log_b = log_with_hw_checkpoint_behind();
    let state_b = log_b.state(&channel()).unwrap();
    let mut m_b = ChannelMachine::new(channel(), NodeId::new(2), MachineConfig::default(), 1, t(0), state_b, vec![]);
    m_b.handle_meta(t(1), meta(1, 1, 1)).unwrap();
    let pull_b = pulls(&settle(&mut m_b, &log_b, t(1)));
    m_b.handle_message(t(2), NodeId::new(1), start_after(pull_b[0], 2));
    let effects_b = settle(&mut m_b, &log_b, t(2));
    assert_eq!(log_b.state(&channel()).unwrap().last_seq, Seq::new(3), "nothing given up");
    assert!(effects_b.iter().any(|e| matches!(e, Effect::RefreshMeta)), "{effects_b:?}");
}

/// Replica of node `me`, created at `created` ms over [`log_with_hw_checkpoint_behind`], its HW raised
/// to `floor` (capped at the log end, 3).
fn replica_with_hw_ahead_of_its_checkpoint(me: u64, created: u64, floor: u64) -> (MemoryLog, ChannelMachine) {
    let log = log_with_hw_checkpoint_behind();
    let state = log.state(&channel()).unwrap();
    let config = MachineConfig::default();
    let mut m = ChannelMachine::new(channel(), NodeId::new(me), config, 1, t(created), state, vec![]);
    m.raise_hw(Seq::new(floor));
    (log, m)
}

/// [`replica_with_hw_ahead_of_its_checkpoint`] as node 2 with HW 3, a follower under a meta since 10 ms,
/// settled: only its HW checkpoint is left to write.
fn settled_follower_with_hw_ahead_of_its_checkpoint() -> (MemoryLog, ChannelMachine) {
    let (log, mut m) = replica_with_hw_ahead_of_its_checkpoint(2, 0, 3);
    m.handle_meta(t(10), meta(1, 1, 1)).unwrap();
    settle(&mut m, &log, t(10));
    (log, m)
}

#[test]
fn a_raised_hw_keeps_the_replica_from_eviction_until_it_is_checkpointed() {
    let (log, mut m) = replica_with_hw_ahead_of_its_checkpoint(2, 0, 7);
    assert_eq!(m.hw(), Seq::new(3), "capped at the durable log end");
    // Everything committed and durable, but the HW is ahead of the store's checkpoint: evicting the replica
    // now would bring it back with HW 1.
    assert!(!m.is_quiescent());
    // A follower under a meta; once the checkpoint is due and written, the replica may leave memory.
    m.handle_meta(t(10), meta(1, 1, 1)).unwrap();
    settle(&mut m, &log, t(10));
    m.handle_timeout(t(1_500));
    settle(&mut m, &log, t(1_500));
    assert_eq!(log.state(&channel()).unwrap().hw, Seq::new(3));
    assert!(m.is_quiescent());
}

#[test]
fn a_replica_kept_only_by_its_checkpoint_writes_it_at_once_when_asked() {
    let (log, mut m) = settled_follower_with_hw_ahead_of_its_checkpoint();
    assert!(!m.can_leave_memory_as_follower(), "its HW is ahead of the store's");
    assert!(m.kept_only_by_its_checkpoint());
    // Asked at 20 ms, it writes the checkpoint then, not when it falls due (1.1 s).
    assert!(m.checkpoint_to_leave(t(20)));
    assert!(!m.kept_only_by_its_checkpoint(), "the checkpoint is on its way");
    assert!(!m.checkpoint_to_leave(t(20)), "one write for one ask");
    settle(&mut m, &log, t(20));
    assert_eq!(log.state(&channel()).unwrap().hw, Seq::new(3));
    assert!(m.can_leave_memory_as_follower() && m.is_quiescent());
    assert!(!m.kept_only_by_its_checkpoint() && !m.checkpoint_to_leave(t(30)), "nothing keeps it now");
}

/// A node stopping cleanly asks every active replica for its checkpoint (`checkpoint_now`), and waits
/// until each is `written_out`.
#[test]
fn a_replica_asked_for_its_checkpoint_at_a_stop_writes_it_at_once_and_is_then_written_out() {
    let (log, mut m) = settled_follower_with_hw_ahead_of_its_checkpoint();
    assert!(!m.written_out(), "its HW is ahead of the store's");
    m.checkpoint_now(t(20));
    assert!(!m.written_out(), "the checkpoint is on its way");
    settle(&mut m, &log, t(20));
    assert_eq!(log.state(&channel()).unwrap().hw, Seq::new(3), "written at 20 ms, not when due");
    assert!(m.written_out());

    // A leader whose append just committed: the batch that made it durable checkpointed the HW before
    // the commit, and the ask writes the one after it.
    let log = MemoryLog::new(LogLimits::default());
    let mut m = empty_replica(1);
    m.handle_meta(t(1), meta(1, 1, 1)).unwrap();
    settle(&mut m, &log, t(1));
    m.handle_append(t(2), request(9, &["a"])).unwrap();
    assert!(!m.written_out(), "its record is not durable yet");
    settle(&mut m, &log, t(2));
    assert_eq!((m.hw(), log.state(&channel()).unwrap().hw), (Seq::new(2), Seq::new(1)));
    assert!(!m.written_out(), "its HW is ahead of the store's");
    m.checkpoint_now(t(3));
    settle(&mut m, &log, t(3));
    assert_eq!(log.state(&channel()).unwrap().hw, Seq::new(2));
    assert!(m.written_out());
}

#[test]
fn a_leader_waiting_for_a_commit_is_not_kept_only_by_its_checkpoint() {
    let log = MemoryLog::new(LogLimits::default());
    let mut m = empty_replica(1);
    m.handle_meta(t(1), meta(1, 1, 1)).unwrap();
    settle(&mut m, &log, t(1));
    m.handle_append(t(2), request(9, &["a"])).unwrap();
    settle(&mut m, &log, t(2));
    // Its record is durable but waits for the follower: only a commit lets it leave.
    assert!(!m.is_quiescent());
    assert!(!m.kept_only_by_its_checkpoint());
    assert!(!m.checkpoint_to_leave(t(3)));
}

#[test]
fn a_leader_may_leave_memory_with_uncommitted_records_only_once_no_caller_waits_on_it() {
    let log = MemoryLog::new(LogLimits::default());
    let mut m = empty_replica(1);
    // MinISR is the whole ISR: the silent follower is not shrunk out, and nothing commits.
    let every_replica = ChannelRuntimeMeta { min_isr: 2, ..meta(1, 1, 1) };
    m.handle_meta(t(1), every_replica).unwrap();
    settle(&mut m, &log, t(1));
    m.handle_append(t(2), request(9, &["a"])).unwrap();
    settle(&mut m, &log, t(2));
    assert!(!m.can_leave_memory_as_stalled_leader(), "its append's caller waits");
    // No follower acknowledges: the append times out, and its record stays durable and uncommitted.
    let timeout = u64::try_from(MachineConfig::default().append_timeout.as_millis()).expect("a timeout of ms");
    m.handle_timeout(t(3 + timeout));
    let effects = settle(&mut m, &log, t(3 + timeout));
    assert!(effects.iter().any(|e| matches!(e, Effect::AppendDone { result: Err(_), .. })), "{effects:?}");
    assert!(m.hw() < log.state(&channel()).unwrap().last_seq, "records wait for a commit");
    assert!(!m.is_quiescent());
    assert!(m.can_leave_memory_as_stalled_leader());
    // A follower is never one.
    let follower = settled_follower();
    assert!(!follower.can_leave_memory_as_stalled_leader());
}

#[test]
fn a_stalled_leader_that_may_yet_shrink_its_isr_stays_in_memory_for_the_isr_lag() {
    // Appends time out well before the ISR lag, so the leader is stalled with no caller waiting while
    // it may still drop a silent follower on its own: evicted then, each incarnation would judge its
    // followers from its own start and never drop one.
    let config = MachineConfig { append_timeout: std::time::Duration::from_secs(2), ..MachineConfig::default() };
    let isr_lag = u64::try_from(config.isr_lag.as_millis()).expect("a lag of ms");
    let log = MemoryLog::new(LogLimits::default());
    let mut m = ChannelMachine::new(channel(), NodeId::new(1), config, 1, t(0), ChannelLogState::default(), vec![]);
    let three = vec![NodeId::new(1), NodeId::new(2), NodeId::new(3)];
    let shrinkable = ChannelRuntimeMeta { replicas: three.clone(), isr: three.clone(), min_isr: 2, ..meta(1, 1, 1) };
    m.handle_meta(t(1), shrinkable.clone()).unwrap();
    settle(&mut m, &log, t(1));
    m.handle_append(t(2), request(9, &["a"])).unwrap();
    settle(&mut m, &log, t(2));
    m.handle_timeout(t(2_003));
    let effects = settle(&mut m, &log, t(2_003));
    assert!(effects.iter().any(|e| matches!(e, Effect::AppendDone { result: Err(_), .. })), "{effects:?}");
    assert!(!m.can_leave_memory_as_stalled_leader(), "it may yet shrink its ISR");
    // Past the lag it proposes dropping a silent follower, and stays while the proposal is out.
    m.handle_timeout(t(2 + isr_lag));
    let effects = settle(&mut m, &log, t(2 + isr_lag));
    assert!(effects.iter().any(|e| matches!(e, Effect::ProposeMeta { .. })), "{effects:?}");
    assert!(!m.can_leave_memory_as_stalled_leader(), "its proposal is out");
    // The proposal lost to another change (same ISR, newer version): nothing is out, it has led for
    // the lag, and the records still wait: it may leave.
    m.handle_meta(t(3 + isr_lag), ChannelRuntimeMeta { version: 2, ..shrinkable }).unwrap();
    settle(&mut m, &log, t(3 + isr_lag));
    assert!(m.hw() < log.state(&channel()).unwrap().last_seq, "records wait for a commit");
    assert!(m.can_leave_memory_as_stalled_leader());
}

#[test]
fn standalone_hw_checkpoints_of_replicas_whose_hw_moved_apart_fall_due_together() {
    // Two replicas (of quiet channels) whose HW moved past its checkpoint 44 ms apart, with no records
    // to carry a checkpoint: both write theirs at the same instant, a second after their last one
    // rounded up to the 100 ms grid, so a node sends them to storage in one pass.
    let replicas: Vec<(MemoryLog, ChannelMachine)> = [37, 81]
        .into_iter()
        .map(|created| {
            let (log, mut m) = replica_with_hw_ahead_of_its_checkpoint(2, created, 3);
            m.handle_meta(t(created + 3), meta(1, 1, 1)).unwrap();
            settle(&mut m, &log, t(created + 3));
            (log, m)
        })
        .collect();
    for (log, mut m) in replicas {
        // Due a second after its creation (its last checkpoint) without the grid: 1,037 and 1,081 ms.
        m.handle_timeout(t(1_090));
        settle(&mut m, &log, t(1_090));
        assert_eq!(log.state(&channel()).unwrap().hw, Seq::new(1), "not before the grid point");
        assert!(m.poll_timeout().is_some_and(|at| at <= t(1_100)), "a timer for the grid point");
        m.handle_timeout(t(1_100));
        settle(&mut m, &log, t(1_100));
        assert_eq!(log.state(&channel()).unwrap().hw, Seq::new(3), "written at the grid point");
        assert!(m.is_quiescent());
    }
}

#[test]
fn a_broken_log_files_no_checkpoint_timer() {
    // A leader whose durable append failed writes nothing more: an HW ahead of its checkpoint must not
    // leave a checkpoint timer that is due at once for ever (the runtime would spin on it).
    let (_log, mut m) = replica_with_hw_ahead_of_its_checkpoint(1, 0, 3);
    m.handle_meta(t(10), meta(1, 2, 1)).unwrap();
    let mut failed = false;
    while let Some(effect) = m.poll_effect() {
        if let Effect::Persist { token, .. } = effect {
            m.handle_persisted(t(20), token, Err(StoreError::Dropped));
            failed = true;
        }
    }
    assert!(failed, "the new leader's barrier went to storage and failed");
    assert!(m.poll_timeout().is_none_or(|at| at > t(20)), "no timer due at once: {:?}", m.poll_timeout());
}

#[test]
fn a_machine_built_without_its_recent_records_follows_but_never_leads() {
    let log = log_with_hw_checkpoint_behind();
    let state = log.state(&channel()).unwrap();
    let build = |me: u64| {
        ChannelMachine::new(channel(), NodeId::new(me), MachineConfig::default(), 1, t(0), state.clone(), vec![])
            .without_recent()
    };
    assert!(build(1).recent_left_out());
    // An empty log has nothing to leave out.
    assert!(!machine().without_recent().recent_left_out());
    // As a follower it runs as any other.
    let mut follower = build(2);
    follower.handle_meta(t(0), meta(1, 1, 1)).unwrap();
    assert_eq!(follower.role(), RoleKind::Follower);
    // Named leader, it does not lead (its idempotency window would miss the keys of the records it left
    // out) and asks for a failover instead.
    let mut would_lead = build(1);
    would_lead.handle_meta(t(0), meta(1, 2, 1)).unwrap();
    assert_eq!(would_lead.role(), RoleKind::None);
    assert!(settle(&mut would_lead, &log, t(0)).iter().any(|e| matches!(e, Effect::NeedsFailover)));
}

/// A log whose epoch 1 wrote #1-#4 and epoch 2 began at #5 (its barrier) and wrote #6-#7, with HW #7
/// and retention through #4, led by node 1 in epoch 3 (its barrier #8 commits at once: MinISR 1).
fn leader_past_a_retention_boundary_where_an_epoch_begins() -> (MemoryLog, ChannelMachine) {
    leader_past_a_retention_boundary(4)
}

/// Leader (node 1, leader epoch 3) of records 1..=7 — epoch 1 through 4, epoch 2 from the barrier at 5 —
/// committed, given up through `retention`.
fn leader_past_a_retention_boundary(retention: u64) -> (MemoryLog, ChannelMachine) {
    use tidings_store::message::{LogBatch, LogOp, Record, RecordKind};
    let log = MemoryLog::new(LogLimits::default());
    let record = |seq: u64| Record {
        seq: Seq::new(seq),
        kind: if seq == 1 || seq == 5 { RecordKind::Barrier } else { RecordKind::Message },
        leader_epoch: LeaderEpoch::new(if seq < 5 { 1 } else { 2 }),
        idempotency_key: None,
        timestamp_ms: 0,
        payload: Bytes::from_static(b"m"),
    };
    let records = (1..=7).map(record).collect();
    let ops = vec![LogOp::Append(records), LogOp::CheckpointHw(Seq::new(7)), LogOp::SetRetention(Seq::new(retention))];
    log.commit(LogBatch::new(channel(), ops)).unwrap();
    let state = log.state(&channel()).unwrap();
    let mut m = ChannelMachine::new(channel(), NodeId::new(1), MachineConfig::default(), 1, t(0), state, vec![]);
    let mut leading = meta(1, 3, 5);
    leading.retention_through = Seq::new(retention);
    m.handle_meta(t(1), leading).unwrap();
    settle(&mut m, &log, t(1));
    (log, m)
}

/// The leader's answer to node 2's pull from `next_seq` with `last_epoch`.
fn answer_to_pull(
    m: &mut ChannelMachine,
    log: &MemoryLog,
    next_seq: u64,
    last_epoch: u64,
) -> Option<tidings_channel::machine::PullBody> {
    m.handle_message(t(2), NodeId::new(2), pull(3, next_seq, last_epoch));
    let mut effects = settle(m, log, t(2));
    // Records older than the machine's cache come from a store read.
    if let Some((token, from, through, max_bytes)) = effects.iter().find_map(|e| match e {
        Effect::Read { token, from, through, max_bytes } => Some((*token, *from, *through, *max_bytes)),
        _ => None,
    }) {
        let limits = tidings_store::message::ReadLimits { records_max: usize::MAX, bytes_max: max_bytes };
        m.handle_read(t(3), token, log.read(&channel(), from, through, limits));
        effects = settle(m, log, t(3));
    }
    effects.into_iter().find_map(|e| match e {
        Effect::Send { message: ChannelMessage::PullResponse(response), .. } => Some(response.body),
        _ => None,
    })
}

/// A leader reading records from its store to answer a follower's pull is not quiescent until the read
/// is done. Evicted meanwhile, the read's answer found no machine and the follower waited a pull timeout
/// for nothing (seen tracing sim seed 560000612: at the cap, a draining node's leaders were evicted for
/// room within a millisecond of their activation).
#[test]
fn a_leader_reading_for_a_followers_pull_is_not_quiescent_until_the_read_is_done() {
    let (log, mut m) = leader_past_a_retention_boundary(0);
    assert!(m.checkpoint_to_leave(t(1)), "only the new barrier's checkpoint keeps it");
    settle(&mut m, &log, t(1));
    assert!(m.is_quiescent());

    m.handle_message(t(2), NodeId::new(2), pull(3, 6, 2));
    let effects = settle(&mut m, &log, t(2));
    let (token, from, through, max_bytes) = effects
        .iter()
        .find_map(|e| match e {
            Effect::Read { token, from, through, max_bytes } => Some((*token, *from, *through, *max_bytes)),
            _ => None,
        })
        .expect("records older than the cache are read");
    assert!(!m.is_quiescent(), "its read's answer waits for it");

    let limits = tidings_store::message::ReadLimits { records_max: usize::MAX, bytes_max: max_bytes };
    m.handle_read(t(3), token, log.read(&channel(), from, through, limits));
    let answered = settle(&mut m, &log, t(3));
    assert!(answered.iter().any(|e| matches!(e, Effect::Send { message: ChannelMessage::PullResponse(_), .. })));
    assert!(m.is_quiescent());
}

/// A replica that must start its log after the retention boundary takes as its last epoch the one in
/// force at the first record it will receive. When a leader epoch begins right after the boundary (its
/// barrier the first readable record), the leader answered with its own, newer epoch: the replica then
/// refused every record that followed (a lower epoch) and never caught up — seed 164004465.
#[test]
fn a_replica_started_after_the_retention_boundary_takes_the_epoch_of_the_next_record() {
    use tidings_channel::machine::PullBody;
    let (log, mut m) = leader_past_a_retention_boundary_where_an_epoch_begins();
    let answer = answer_to_pull(&mut m, &log, 1, 0);
    assert_eq!(answer, Some(PullBody::StartAfter { seq: Seq::new(4), epoch: LeaderEpoch::new(2), hw: Seq::new(8) }));
}

/// A follower whose last record is the retention boundary proves its log by that record's epoch. The
/// boundary dropped that epoch from the leader's history when the next record began a new one: the
/// leader then answered `Diverging` at seq 0, below the follower's HW, and the follower (an ISR member)
/// stopped for good, holding the channel below MinISR — seed 164004465 again.
#[test]
fn a_follower_whose_last_record_is_the_retention_boundary_gets_the_records_after_it() {
    use tidings_channel::machine::PullBody;
    let (log, mut m) = leader_past_a_retention_boundary_where_an_epoch_begins();
    let answer = answer_to_pull(&mut m, &log, 5, 1);
    assert!(
        matches!(&answer, Some(PullBody::Records { records, .. }) if records.first().map(|r| r.seq) == Some(Seq::new(5))),
        "{answer:?}"
    );
}

/// A follower whose log ends before the retention boundary, in an epoch the boundary took out of the
/// leader's history, is told to start after the boundary — not to truncate by the epochs left, which
/// named a point below its HW: it refused, and pulled the same answer for good (sim seed 273001409).
#[test]
fn a_follower_whose_log_ends_before_the_retention_boundary_is_told_to_start_after_it_whatever_its_epoch() {
    use tidings_channel::machine::PullBody;
    let (log, mut m) = leader_past_a_retention_boundary(6); // epoch 1 (records 1..=4) gone from the history
    let answer = answer_to_pull(&mut m, &log, 3, 1);
    assert_eq!(answer, Some(PullBody::StartAfter { seq: Seq::new(6), epoch: LeaderEpoch::new(2), hw: Seq::new(8) }));
}

/// A follower whose last epoch the leader's history no longer holds (given up with the records before
/// the retention boundary), with records of that epoch past the boundary: those diverge, since every
/// record the leader holds past the boundary is of a later epoch. It is told to truncate at the boundary,
/// then gets the records after it. Before, the leader answered `Diverging` at seq 0, below the
/// follower's HW: the follower refused it and pulled the same answer for good (sim seed 376003898).
#[test]
fn a_follower_whose_epoch_the_leader_gave_up_truncates_at_the_retention_boundary() {
    use tidings_channel::machine::PullBody;
    let (log, mut m) = leader_past_a_retention_boundary(6); // epoch 1 (records 1..=4) gone from the history
    let answer = answer_to_pull(&mut m, &log, 8, 1);
    assert_eq!(answer, Some(PullBody::Diverging { epoch: LeaderEpoch::new(1), end_seq: Seq::new(6) }));
    let answer = answer_to_pull(&mut m, &log, 7, 1);
    assert!(
        matches!(&answer, Some(PullBody::Records { records, .. }) if records.first().map(|r| r.seq) == Some(Seq::new(7))),
        "{answer:?}"
    );
}

/// A new leader plans again at most `handoff_slots` of its predecessors' messages past what their
/// fanout was known to finish, the most recent, and says how many it left.
#[test]
fn a_new_leader_plans_again_at_most_its_handoff_slots_and_counts_the_rest() {
    use tidings_store::message::{LogBatch, LogOp, Record, RecordKind};
    let log = MemoryLog::new(LogLimits::default());
    let record = |seq: u64| Record {
        seq: Seq::new(seq),
        kind: if seq == 1 { RecordKind::Barrier } else { RecordKind::Message },
        leader_epoch: LeaderEpoch::new(1),
        idempotency_key: None,
        timestamp_ms: 0,
        payload: Bytes::from_static(b"m"),
    };
    // Epoch 1: barrier #1, messages #2-#400, all committed; fanout known to finish through #1 only.
    let ops = vec![
        LogOp::Append((1..=400).map(record).collect()),
        LogOp::CheckpointHw(Seq::new(400)),
        LogOp::CheckpointFanned(Seq::new(1)),
    ];
    log.commit(LogBatch::new(channel(), ops)).unwrap();
    let state = log.state(&channel()).unwrap();
    let config = MachineConfig { handoff_slots: 256, ..MachineConfig::default() };
    let mut m = ChannelMachine::new(channel(), NodeId::new(1), config, 1, t(0), state, vec![]);
    m.handle_meta(t(1), meta(1, 2, 2)).unwrap();
    let committed = settle(&mut m, &log, t(1)).into_iter().find_map(|e| match e {
        Effect::Committed { messages, inherited, skipped, .. } => Some((messages, inherited, skipped)),
        _ => None,
    });
    let (messages, inherited, skipped) = committed.expect("the new leader hands off at once");
    assert_eq!((messages.len(), inherited, skipped), (256, 256, 143), "399 messages past #1: 256 planned, 143 left");
    assert_eq!((messages[0], messages[255]), (Seq::new(145), Seq::new(400)), "the most recent");
}

/// A replica that joins by a `StartAfter` right before a leader's barrier, and leads next, plans again
/// the messages after the barrier but not the barrier: a successor tells barriers by the epoch starts,
/// and the `StartAfter` put the epoch's start at the skipped seq (sim seed 317006295: the barrier was
/// fanned out to every member as a message).
#[test]
fn a_replica_that_started_after_a_boundary_right_before_a_barrier_does_not_fan_the_barrier_out() {
    use tidings_channel::machine::{PullBody, PullResponse};
    use tidings_store::message::{Record, RecordKind};
    let log = MemoryLog::new(LogLimits::default());
    let mut m = empty_replica(2);
    m.handle_meta(t(1), meta(1, 2, 1)).unwrap();
    let answer = |m: &mut ChannelMachine, at: u64, body: PullBody| {
        let pull_id = *pulls(&settle(m, &log, t(at))).last().expect("a pull out");
        let response = PullResponse { channel: channel(), pull_id, leader_epoch: LeaderEpoch::new(2), body };
        m.handle_message(t(at), NodeId::new(1), ChannelMessage::PullResponse(response));
    };
    // Leader 1 gave up everything through #6, the last record of epoch 1; its epoch 2 began at #7.
    let start = PullBody::StartAfter { seq: Seq::new(6), epoch: LeaderEpoch::new(2), hw: Seq::new(6) };
    answer(&mut m, 2, start);
    let record = |seq: u64, kind: RecordKind| Record {
        kind,
        ..Record::message(Seq::new(seq), LeaderEpoch::new(2), Bytes::from_static(b"m"))
    };
    let records = vec![record(7, RecordKind::Barrier), record(8, RecordKind::Message), record(9, RecordKind::Message)];
    answer(&mut m, 3, PullBody::Records { records, hw: Seq::new(9), fanned_through: Seq::new(6) });
    settle(&mut m, &log, t(3));
    assert_eq!((m.durable_last(), m.hw()), (Seq::new(9), Seq::new(9)));
    // Leader 1 fails before its fanout of #8 and #9 is known to have finished; this replica leads.
    m.handle_meta(t(4), meta(2, 3, 2)).unwrap();
    let committed = settle(&mut m, &log, t(4)).into_iter().find_map(|e| match e {
        Effect::Committed { messages, inherited, skipped, .. } => Some((messages, inherited, skipped)),
        _ => None,
    });
    assert_eq!(committed, Some((vec![Seq::new(8), Seq::new(9)], 2, 0)), "the messages, not the barrier");
    let epochs = log.state(&channel()).unwrap().epochs;
    assert_eq!(epochs, vec![(LeaderEpoch::new(2), Seq::new(7)), (LeaderEpoch::new(3), Seq::new(10))]);
}

/// Node 1 leading with MinISR 2 of {1, 2} (appends wait for follower 2), appends timing out before a
/// pull timeout: the machine and its log.
fn leader_waiting_for_follower_2() -> (ChannelMachine, MemoryLog) {
    let config = MachineConfig {
        pull_park: std::time::Duration::from_millis(500),
        pull_timeout: std::time::Duration::from_secs(2),
        idle_pull_interval: std::time::Duration::from_millis(500),
        isr_alive: std::time::Duration::from_secs(5),
        append_timeout: std::time::Duration::from_secs(1),
        ..MachineConfig::default()
    };
    let mut m = ChannelMachine::new(channel(), NodeId::new(1), config, 1, t(0), ChannelLogState::default(), vec![]);
    let log = MemoryLog::new(LogLimits::default());
    let mut both = meta(1, 1, 1);
    both.min_isr = 2;
    m.handle_meta(t(0), both).unwrap();
    settle(&mut m, &log, t(0));
    (m, log)
}

/// `true` if `effects` send follower 2 a hint.
fn hinted(effects: &[Effect]) -> bool {
    effects.iter().any(|e| matches!(e, Effect::Send { to, message: ChannelMessage::Hint(_) } if *to == NodeId::new(2)))
}

/// An ISR follower silent for a pull timeout (evicted, restarted, refused room) comes back only on news:
/// an append that must wait for it tells it at once, even when appends time out before a pull timeout.
#[test]
fn an_append_waiting_for_a_silent_follower_hints_it_at_once() {
    let (mut m, log) = leader_waiting_for_follower_2();
    // Follower 2 never pulled; 3 s on (silent past the pull timeout, alive for admission) an append
    // comes: it waits for 2, which hears of it now.
    m.handle_append(t(3_000), request(1, &["a"])).unwrap();
    let effects = settle(&mut m, &log, t(3_000));
    assert!(hinted(&effects), "no hint to the silent follower: {effects:?}");
    // A second append right after: no second hint within the pull timeout.
    m.handle_append(t(3_100), request(2, &["b"])).unwrap();
    assert!(!hinted(&settle(&mut m, &log, t(3_100))), "hinted twice within a pull timeout");
    // Both time out (1 s); their records stay, uncommitted: 2 is told again every pull timeout.
    m.handle_timeout(t(4_200));
    let effects = settle(&mut m, &log, t(4_200));
    assert!(effects.iter().any(|e| matches!(e, Effect::AppendDone { result: Err(AppendAborted::Timeout), .. })));
    let due = m.poll_timeout().expect("a timer while records wait to commit");
    assert!(due <= t(5_000), "next wake-up at {due:?}, past the pull timeout after the last hint");
    m.handle_timeout(t(5_000));
    assert!(hinted(&settle(&mut m, &log, t(5_000))), "the silent follower is not told again");
}

/// A follower that pulled just after the leader last woke its silent followers, then went silent
/// (evicted for room, restarted), is told at the next wake-up, a pull timeout later — not only at the
/// one after, two pull timeouts without a word (sim seed 216002928: the healed phase ended first).
#[test]
fn a_follower_silent_since_just_after_a_wake_up_is_told_at_the_next() {
    let (mut m, log) = leader_waiting_for_follower_2();
    m.handle_append(t(3_000), request(1, &["a"])).unwrap();
    assert!(hinted(&settle(&mut m, &log, t(3_000))), "told as the append comes");
    // It pulls once, 50 ms after the hint, and is not heard from again.
    m.handle_message(t(3_050), NodeId::new(2), pull(1, 1, 0));
    settle(&mut m, &log, t(3_050));
    m.handle_timeout(t(4_000));
    settle(&mut m, &log, t(4_000));
    m.handle_timeout(t(5_000));
    assert!(hinted(&settle(&mut m, &log, t(5_000))), "not told at the next wake-up");
}

/// A keyed record given up by a retention move, appended again by a retry, then retried once more on
/// a replica that kept the first: the retry finds the record still there, not the one given up. The
/// index kept a key's first record for good, so a replica that saw both answered with the given-up seq
/// while another leader had appended the retry anew (sim seed 206002248, with skewed clocks).
#[test]
fn a_retry_after_a_retention_move_finds_the_record_that_is_still_there() {
    use tidings_channel::machine::{PullBody, PullResponse};
    use tidings_store::message::{IdempotencyKey, Record, RecordKind};
    let key = IdempotencyKey::new(Bytes::from_static(b"k")).unwrap();
    let keyed = |seq: u64| Record {
        seq: Seq::new(seq),
        kind: RecordKind::Message,
        leader_epoch: LeaderEpoch::new(1),
        idempotency_key: Some(key.clone()),
        timestamp_ms: 0,
        payload: Bytes::from_static(b"hello"),
    };
    let log = MemoryLog::new(LogLimits::default());
    let mut m = empty_replica(2);
    m.handle_meta(t(1), meta(1, 1, 1)).unwrap();
    // Follows node 1: the keyed record at 1, committed; then, 1 given up, the retry appended at 2.
    let mut last_pull = None;
    let mut answer = |m: &mut ChannelMachine, at: u64, records: Vec<Record>, hw: u64| {
        last_pull = pulls(&settle(m, &log, t(at))).last().copied().or(last_pull);
        let pull_id = last_pull.expect("a pull out");
        let body = PullBody::Records { records, hw: Seq::new(hw), fanned_through: Seq::new(0) };
        let response = PullResponse { channel: channel(), pull_id, leader_epoch: LeaderEpoch::new(1), body };
        m.handle_message(t(at), NodeId::new(1), ChannelMessage::PullResponse(response));
    };
    answer(&mut m, 2, vec![keyed(1)], 1);
    let mut given_up = meta(1, 1, 2);
    given_up.retention_through = Seq::new(1);
    answer(&mut m, 3, vec![], 1);
    m.handle_meta(t(3), given_up).unwrap();
    answer(&mut m, 4, vec![keyed(2)], 2);
    answer(&mut m, 5, vec![], 2);
    settle(&mut m, &log, t(5));
    assert_eq!(m.hw(), Seq::new(2));
    // Node 1 fails; this replica leads, and the client retries once more.
    let mut leads = meta(2, 2, 3);
    leads.retention_through = Seq::new(1);
    m.handle_meta(t(6), leads).unwrap();
    settle(&mut m, &log, t(6));
    let retry = AppendRequest {
        id: RequestId(7),
        records: vec![AppendRecord { idempotency_key: Some(key.clone()), payload: Bytes::from_static(b"hello") }],
    };
    m.handle_append(t(7), retry).unwrap();
    let done = settle(&mut m, &log, t(7)).into_iter().find_map(|e| match e {
        Effect::AppendDone { id: RequestId(7), result } => Some(result),
        _ => None,
    });
    assert_eq!(done, Some(Ok(vec![Seq::new(2)])), "the retry names the record that is still there");
}

/// A follower that leaves memory while its pull waits for an answer hands the pull to its next
/// incarnation, which takes the answer (its log is where the pull left off) instead of ignoring it as
/// another machine's and pulling anew: at the cap on active replicas each activation evicted the
/// follower activated last, and no follower ever took an answer (sim seed 208000252). An incarnation
/// that does not start where the pull left off does not take it.
#[test]
fn an_evicted_followers_unanswered_pull_is_taken_over_by_its_next_incarnation() {
    use tidings_channel::machine::{PullBody, PullResponse};
    use tidings_store::message::{Record, RecordKind};
    let log = log_with_hw_checkpoint_behind();
    let state = log.state(&channel()).unwrap();
    let follower = |incarnation: u64, state: ChannelLogState| {
        ChannelMachine::new(channel(), NodeId::new(2), MachineConfig::default(), incarnation, t(0), state, vec![])
    };
    let mut first = follower(1, state.clone());
    first.handle_meta(t(1), meta(1, 1, 1)).unwrap();
    let sent = pulls(&settle(&mut first, &log, t(1)));
    let pull = first.pull_in_flight().expect("a pull waits for its answer");
    let answer = PullResponse {
        channel: channel(),
        pull_id: sent[0],
        leader_epoch: LeaderEpoch::new(1),
        body: PullBody::Records {
            records: vec![Record {
                seq: Seq::new(4),
                kind: RecordKind::Message,
                leader_epoch: LeaderEpoch::new(1),
                idempotency_key: None,
                timestamp_ms: 0,
                payload: Bytes::from_static(b"m"),
            }],
            hw: Seq::new(4),
            fanned_through: Seq::new(0),
        },
    };
    // The next incarnation starts from the same log: it waits for that answer and takes it.
    let mut next = follower(2, state);
    next.inherit_pull(pull);
    next.handle_meta(t(2), meta(1, 1, 1)).unwrap();
    assert!(pulls(&settle(&mut next, &log, t(2))).is_empty(), "no second pull while the first is out");
    next.handle_message(t(3), NodeId::new(1), ChannelMessage::PullResponse(answer.clone()));
    settle(&mut next, &log, t(3));
    assert_eq!(next.log_end(), Seq::new(4), "the answer is taken");
    // One that starts elsewhere (its log ends at 4 now) pulls for itself and ignores the answer.
    let mut elsewhere = follower(3, log.state(&channel()).unwrap());
    elsewhere.inherit_pull(pull);
    elsewhere.handle_meta(t(4), meta(1, 1, 1)).unwrap();
    assert_eq!(pulls(&settle(&mut elsewhere, &log, t(4))).len(), 1);
    elsewhere.handle_message(t(5), NodeId::new(1), ChannelMessage::PullResponse(answer));
    settle(&mut elsewhere, &log, t(5));
    assert_eq!(elsewhere.durable_last(), Seq::new(4), "nothing taken twice");
}

/// A leader's ISR proposal leaves it only once its record (`LogOp::ProposeIsr`) is durable in the
/// leader's log, where its next incarnation — evicted, or restarted — learns of it.
#[test]
fn an_isr_proposal_is_sent_only_once_its_record_is_durable() {
    let log = MemoryLog::new(LogLimits::default());
    let mut m = machine();
    m.handle_meta(t(1), meta(1, 1, 1)).unwrap();
    settle(&mut m, &log, t(1));
    let record = LogOp::ProposeIsr { from_version: 1, isr: vec![NodeId::new(1)] };
    // Node 2 never pulls: past the ISR lag bound the leader proposes to drop it.
    let mut held = None;
    let mut now = t(1);
    while held.is_none() {
        now = m.poll_timeout().expect("a leader keeps a timer");
        assert!(now.as_millis() < 60_000, "no shrink proposed");
        m.handle_timeout(now);
        while let Some(effect) = m.poll_effect() {
            match effect {
                Effect::Persist { token, batch } if batch.ops.contains(&record) => held = Some((token, batch)),
                Effect::Persist { token, batch } => {
                    let result = log.commit(batch);
                    m.handle_persisted(now, token, result);
                }
                Effect::ProposeMeta { .. } => panic!("proposed before its record was durable"),
                _ => {}
            }
        }
    }
    let (token, batch) = held.expect("the loop ends with it");
    let result = log.commit(batch);
    m.handle_persisted(now, token, result);
    let proposed = settle(&mut m, &log, now).into_iter().find_map(|effect| match effect {
        Effect::ProposeMeta { expected_version, meta, .. } => Some((expected_version, meta.isr)),
        _ => None,
    });
    assert_eq!(proposed, Some((1, vec![NodeId::new(1)])));
    assert_eq!(log.state(&channel()).unwrap().isr_proposals, vec![(1, vec![NodeId::new(1)])]);
}

/// A leader whose only work left is its fanout may leave memory only once fanout progress of its own
/// is checkpointed: a message it handed off finished and the log says so. Leaving sooner, turn after
/// turn at a node's cap, each incarnation would start the same message over.
#[test]
fn a_leader_only_fanning_out_may_leave_memory_once_its_own_fanout_progress_is_checkpointed() {
    let log = MemoryLog::new(LogLimits::default());
    let mut m = leader_alone_fanning_out_two_messages(&log);
    assert!(!m.can_leave_memory_fanning_out(), "none of its messages finished fanning out");

    m.fanout_finished(Seq::new(2));
    assert_eq!(m.fanned_through(), Seq::new(2));
    assert!(!m.can_leave_memory_fanning_out(), "its progress is not checkpointed yet");
    m.handle_timeout(t(4_000));
    settle(&mut m, &log, t(4_000));
    assert_eq!(log.state(&channel()).unwrap().fanned_through, Seq::new(2));
    assert!(m.can_leave_memory_fanning_out());
    assert!(!m.is_quiescent(), "message 3 is still out");

    // A follower never is one, nor a leader with nothing left to fan out.
    m.fanout_finished(Seq::new(3));
    assert!(!m.leads_only_fanning_out() && !m.can_leave_memory_fanning_out());
    let follower = settled_follower();
    assert!(!follower.can_leave_memory_fanning_out());
}

/// A leader only fanning out whose own fanout progress is known but not checkpointed is kept from
/// leaving only by that checkpoint: asked to (`checkpoint_to_leave`, a node out of room), it writes it
/// at once rather than at its due time, up to ~1.1 s later, and may leave once it lands. With no
/// progress of its own there is nothing to hurry.
#[test]
fn a_leader_only_fanning_out_writes_its_fanout_progress_at_once_when_asked_to_leave() {
    let log = MemoryLog::new(LogLimits::default());
    let mut m = leader_alone_fanning_out_two_messages(&log);
    assert!(!m.kept_fanning_out_only_by_its_checkpoint() && !m.checkpoint_to_leave(t(2_001)));
    assert!(settle(&mut m, &log, t(2_001)).is_empty(), "nothing written");

    m.fanout_finished(Seq::new(2));
    assert!(m.kept_fanning_out_only_by_its_checkpoint());
    assert!(!m.kept_only_by_its_checkpoint(), "message 3 is still out: not at rest after it");
    assert!(m.checkpoint_to_leave(t(2_002)));
    settle(&mut m, &log, t(2_002));
    assert_eq!(log.state(&channel()).unwrap().fanned_through, Seq::new(2));
    assert!(m.can_leave_memory_fanning_out());
    assert!(!m.kept_fanning_out_only_by_its_checkpoint() && !m.checkpoint_to_leave(t(2_003)), "written");
}

/// A leader alone in its ISR that committed messages 2 and 3 (its barrier is 1) and checkpointed its HW,
/// with both out to fanout: it leads only fanning out.
fn leader_alone_fanning_out_two_messages(log: &MemoryLog) -> ChannelMachine {
    let mut m = empty_replica(1);
    // The ISR is the leader alone: its appends commit with its own durable write.
    let alone = ChannelRuntimeMeta { isr: vec![NodeId::new(1)], ..meta(1, 1, 1) };
    m.handle_meta(t(1), alone).unwrap();
    settle(&mut m, log, t(1));
    m.handle_append(t(2), request(9, &["a", "b"])).unwrap();
    let effects = settle(&mut m, log, t(2));
    let committed: Vec<Seq> = effects
        .into_iter()
        .filter_map(|e| match e {
            Effect::Committed { messages, .. } => Some(messages),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(committed, vec![Seq::new(2), Seq::new(3)]);
    assert!(m.leads_only_fanning_out());
    // Its HW checkpoint falls due (within ~1.1 s), with fanout progress through its own barrier.
    m.handle_timeout(t(2_000));
    settle(&mut m, log, t(2_000));
    let stored = log.state(&channel()).unwrap();
    assert_eq!((stored.hw, stored.fanned_through), (Seq::new(3), Seq::new(1)));
    m
}

/// Node 2's replica made a follower of node 1, its first pull out and never answered.
fn settled_follower() -> ChannelMachine {
    let mut follower = empty_replica(2);
    follower.handle_meta(t(1), meta(1, 1, 1)).unwrap();
    settle(&mut follower, &MemoryLog::new(LogLimits::default()), t(1));
    follower
}

/// A copy of a pull a replica sent before it was taken off the channel, delivered after the replica was
/// added back (same leader epoch: the leader stayed), claims records the new replica's empty log does
/// not hold. Taken, it made the leader count the replica caught up, propose it into the ISR, and, once
/// there, count its claim toward MinISR: records only the leader held were acknowledged. Pulls name the
/// membership epoch of the meta they are made under, and the leader refuses one older than the meta
/// that (re)added its sender (`StaleEpoch`: the sender refreshes its meta).
#[test]
fn a_pull_from_before_its_replica_left_and_came_back_counts_for_nothing() {
    use tidings_channel::machine::PullBody;
    let log = MemoryLog::new(LogLimits::default());
    let mut m = machine();
    let with = |version: u64, epoch: u64, replicas: &[u64], isr: &[u64]| {
        let mut next = meta(1, 1, version);
        next.epoch = Epoch::new(epoch);
        next.min_isr = 2;
        next.replicas = replicas.iter().copied().map(NodeId::new).collect();
        next.isr = isr.iter().copied().map(NodeId::new).collect();
        next
    };
    // Node 3 a learner; node 2 in the ISR holds only the barrier.
    m.handle_meta(t(1), with(1, 1, &[1, 2, 3], &[1, 2])).unwrap();
    settle(&mut m, &log, t(1));
    m.handle_append(t(2), request(1, &["a", "b", "c", "d"])).unwrap();
    settle(&mut m, &log, t(2));
    m.handle_message(t(3), NodeId::new(2), pull_under(1, 1, 2, 1));
    settle(&mut m, &log, t(3));
    assert_eq!(m.hw(), Seq::new(1));
    // The pull node 3 made before it left: through seq 5, under membership epoch 1.
    let late = pull_under(1, 1, 6, 1);

    // Node 3 leaves and comes back with an empty log.
    m.handle_meta(t(4), with(2, 2, &[1, 2], &[1, 2])).unwrap();
    m.handle_meta(t(5), with(3, 3, &[1, 2, 3], &[1, 2])).unwrap();
    settle(&mut m, &log, t(5));
    m.handle_message(t(6), NodeId::new(3), late);
    let effects = settle(&mut m, &log, t(6));
    let answer = effects.iter().find_map(|e| match e {
        Effect::Send { message: ChannelMessage::PullResponse(response), .. } => Some(response.body.clone()),
        _ => None,
    });
    assert_eq!(answer, Some(PullBody::StaleEpoch), "{effects:?}");
    assert!(!effects.iter().any(|e| matches!(e, Effect::ProposeMeta { .. })), "no ISR expansion: {effects:?}");

    // Even in the ISR (say a replacement put it there), the late claim does not count.
    m.handle_meta(t(7), with(4, 4, &[1, 2, 3], &[1, 2, 3])).unwrap();
    m.handle_message(t(8), NodeId::new(3), pull_under(1, 1, 6, 1));
    settle(&mut m, &log, t(8));
    assert_eq!(m.hw(), Seq::new(1), "records only the leader holds are not committed");
    // A pull under the meta that added it back counts.
    m.handle_message(t(9), NodeId::new(3), pull_under(1, 3, 6, 1));
    settle(&mut m, &log, t(9));
    assert_eq!(m.hw(), Seq::new(5));
}

/// A follower told its pull was made under a meta too old (`StaleEpoch`: a leader refuses one older
/// than the meta that added the follower) asks for the meta in force and pulls again as soon as a newer
/// one comes, not after its idle back-off (2 s), which slowed channels at the cap where leaders are
/// started often.
#[test]
fn a_follower_refused_for_an_old_meta_pulls_again_once_a_newer_one_comes() {
    use tidings_channel::machine::{PullBody, PullResponse};
    let mut m = machine();
    let log = MemoryLog::new(LogLimits::default());
    m.handle_meta(t(1), meta(2, 1, 1)).unwrap();
    let first = pulls(&settle(&mut m, &log, t(1)));
    assert_eq!(first.len(), 1);
    let refusal = PullResponse {
        channel: channel(),
        pull_id: first[0],
        leader_epoch: LeaderEpoch::new(1),
        body: PullBody::StaleEpoch,
    };
    m.handle_message(t(2), NodeId::new(2), ChannelMessage::PullResponse(refusal));
    let effects = settle(&mut m, &log, t(2));
    assert!(effects.iter().any(|e| matches!(e, Effect::RefreshMeta)), "{effects:?}");
    assert!(pulls(&effects).is_empty(), "it waits for the meta");
    let mut newer = meta(2, 1, 2);
    newer.epoch = Epoch::new(2);
    newer.isr = vec![NodeId::new(2)];
    m.handle_meta(t(5), newer).unwrap();
    assert_eq!(pulls(&settle(&mut m, &log, t(5))).len(), 1, "the newer meta brings the pull at once");
}
